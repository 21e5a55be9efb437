"""A Hugging Face Bucket (``hf://buckets/OWNER/NAME[/PREFIX]``) as a :class:`Bucket`.

Objects are uploaded with :meth:`huggingface_hub.HfApi.batch_bucket_files` (the bytes go to Xet
storage first, then one ``/batch`` call makes them visible, so readers see either the old or the
new object), downloaded with :meth:`~huggingface_hub.HfApi.download_bucket_files`, and listed with
:meth:`~huggingface_hub.HfApi.list_bucket_tree`.

Errors from ``huggingface_hub`` are mapped onto the bucket error types:

- 404 on an object -> :class:`ObjectNotFoundError`;
- 404 on the bucket itself -> :class:`BucketError` (a missing bucket is a configuration error, not
  an empty bucket);
- 404 without the Hub's ``X-Error-Code`` -> :class:`BucketError` (not a Hub answer: wrong endpoint or
  a proxy), never an empty listing;
- 408, 429, 5xx and connection/timeouts -> :class:`TransientBucketError`, with ``retry_after`` taken
  from the ``Retry-After`` header (seconds or HTTP date, or the Hub's ``RateLimit`` header), bounded
  by the rate-limit window (:func:`rlsync.retry.retry_after_seconds`);
- 401/403 -> :class:`BucketError` saying the token lacks access (read or write);
- errors from hf_xet (Xet token endpoint and Xet storage), which arrive as ``RuntimeError`` or
  ``ConnectionError`` carrying the HTTP status in their message, are classified by that status the
  same way (a storage 404 is a missing object, a 401/403 from the token endpoint a permission error);
- anything else -> :class:`BucketError`.

Every request has a timeout and is made once; retries are :class:`RetryingBucket`'s alone (see
:mod:`rlsync.bucket.hf_transport`).

The access token comes from the ``token`` argument, else the ``HF_TOKEN`` environment variable,
else ``huggingface_hub``'s own lookup (the saved login). None of these tokens ever appears in an
exception message, ``repr`` or log line raised or written by this module: messages are built from
the status code, the server's message and the request id, and scrubbed of every token in case the
server echoed it.
"""

from __future__ import annotations

import logging
import re
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import httpx2
from hf_xet import XetAuthenticationError, XetObjectNotFoundError
from huggingface_hub import BucketFile, HfApi, get_token
from huggingface_hub.errors import (
    BucketBatchError,
    BucketNotFoundError,
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
)
from huggingface_hub.utils import parse_hf_uri

from ..errors import BucketError, ObjectNotFoundError, ObjectTooLargeError, RetryableHttpError, TransientBucketError
from ..retry import retry_after_seconds
from .base import Bucket, ObjectInfo, part_path, validate_key, validate_prefix
from .budget import RequestMeter
from .hf_transport import HfTransferConfig, install, metering, single_attempt

__all__ = ["HfBucket"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: HTTP statuses worth retrying: request timeout, rate limit, server errors.
_TRANSIENT_STATUSES = frozenset({408, 429})
#: Connection-level failures (no HTTP status) worth retrying.
_TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    httpx2.TimeoutException,
    httpx2.NetworkError,
    httpx2.RemoteProtocolError,
    ConnectionError,
    TimeoutError,
)
#: The HTTP status hf_xet (reqwest) writes into its error messages, e.g. "(503 Service Unavailable)".
_XET_STATUS = re.compile(r"HTTP status (?:client|server) error \((\d{3})\b")
#: hf_xet's wording for a connection that failed, was dropped or timed out.
_XET_CONNECTION = re.compile(r"error sending request|timed out|connection (?:reset|refused|closed)", re.IGNORECASE)
_REDACTED = "<redacted>"


def _is_transient(status: int) -> bool:
    return status in _TRANSIENT_STATUSES or status >= 500


class HfBucket(Bucket):
    """A bucket on the Hugging Face Hub, optionally restricted to a folder (prefix) inside it.

    Args:
        bucket_id (`str`):
            The bucket, as `"namespace/name"`.
        prefix (`str`, *optional*):
            A folder inside the bucket. Keys are stored under `"{prefix}/{key}"` and listed relative to it.
        token (`str`, *optional*):
            A Hugging Face access token. Defaults to `huggingface_hub`'s own lookup (`HF_TOKEN`, then
            the locally saved token).
        api ([`~huggingface_hub.HfApi`], *optional*):
            The client to use. Defaults to a new `HfApi(token=token)`.
        create (`bool`, *optional*, defaults to `False`):
            Create the bucket if it does not exist (one `bucket_info` call; `create_bucket` only when the
            Hub has no such bucket, with the Hub's default visibility). A token that cannot create it
            gets a [`BucketError`] that says how to create it by hand.
        transfer ([`HfTransferConfig`], *optional*):
            Request timeouts, process-wide (see `rlsync.bucket.hf_transport.install`): installed unless
            settings are installed already (by default the defaults).
        meter ([`~rlsync.bucket.budget.RequestMeter`], *optional*):
            Counts this bucket's requests and paces them to the role's share of the Hub's limits.
            Defaults to a meter with `BudgetConfig()`.

    Raises:
        [`BucketError`]: `bucket_id` is not `"namespace/name"`, the prefix is not a valid key, or
            creating the bucket failed.
    """

    def __init__(
        self,
        bucket_id: str,
        *,
        prefix: str = "",
        token: str | None = None,
        api: HfApi | None = None,
        create: bool = False,
        transfer: HfTransferConfig | None = None,
        meter: RequestMeter | None = None,
    ) -> None:
        install(transfer, replace=False)
        self.meter = meter if meter is not None else RequestMeter()
        parts = bucket_id.split("/") if isinstance(bucket_id, str) else []
        if len(parts) != 2 or not all(parts):
            raise BucketError(f"invalid bucket id {bucket_id!r}: expected 'namespace/name'")
        self.bucket_id = bucket_id
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.prefix = prefix
        self._path_prefix = f"{prefix}/" if prefix else ""
        self._token = token
        self._api = api if api is not None else HfApi(token=self._token)
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")
        self._warned_skipped = False
        #: Reads refused because the object is larger than the reader allows.
        self.refused_too_large = 0
        if create:
            self._create_if_missing()

    def _create_if_missing(self) -> None:
        """Create the bucket when the Hub has none of this id (a read-only token never tries to write)."""

        def exists() -> bool:
            try:
                self._api.bucket_info(self.bucket_id, token=self._token)
                return True
            except BucketNotFoundError:
                return False

        if self._call("bucket info", None, exists):
            return
        try:
            self._call("create bucket", None, lambda: self._api.create_bucket(self.bucket_id, exist_ok=True, token=self._token))
        except TransientBucketError:
            raise
        except BucketError as err:
            raise BucketError(
                f"bucket {self.bucket_id!r} does not exist and this token cannot create it ({err}). Create it "
                f"with a token that can write to {self.bucket_id.split('/')[0]!r}: `hf buckets create {self.bucket_id}`, "
                "or `python -m rlsync.spaces.deploy`, or on the Hub's website; then start again"
            ) from None
        logger.info("created bucket %s", self.bucket_id)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "HfBucket":
        """Open a bucket from a `hf://buckets/OWNER/NAME[/PREFIX]` URL.

        Args:
            url (`str`):
                The bucket URL. A Hub web URL (`https://huggingface.co/buckets/OWNER/NAME`) is accepted too.
            **kwargs:
                Passed to [`HfBucket`] (`token`, `api`, `create`).

        Returns:
            [`HfBucket`]: the bucket, with `PREFIX` as its prefix.

        Raises:
            [`BucketError`]: the URL is not a bucket URL.
        """
        try:
            parsed = parse_hf_uri(url)
        except ValueError as err:
            raise BucketError(f"invalid Hugging Face bucket URL {url!r}: {err}") from None
        if not parsed.is_bucket:
            raise BucketError(f"invalid Hugging Face bucket URL {url!r}: expected hf://buckets/OWNER/NAME[/PREFIX]")
        return cls(parsed.id, prefix=parsed.path_in_repo or "", **kwargs)

    # -- key mapping -------------------------------------------------------------------------------

    def _remote(self, key: str) -> str:
        return self._path_prefix + validate_key(key)

    def _local_key(self, remote_path: str) -> str | None:
        if not remote_path.startswith(self._path_prefix):
            return None
        return remote_path[len(self._path_prefix) :]

    # -- error mapping -----------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        for secret in self._secrets():
            text = text.replace(secret, _REDACTED)
        return text

    def _secrets(self) -> list[str]:
        """Every token the client may send: its own, the client's, and the one the library finds itself."""
        try:
            found = get_token()  # HF_TOKEN, else the saved login
        except Exception:  # noqa: BLE001 - an unreadable token file must not hide the real error
            found = None
        candidates = (self._token, getattr(self._api, "token", None), found)
        return [t for i, t in enumerate(candidates) if isinstance(t, str) and t and t not in candidates[:i]]

    def _call(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """Run one `huggingface_hub` call, mapping its errors onto the bucket error types."""
        try:
            with metering(self.meter), single_attempt():
                return fn()
        except BucketError:
            raise
        except Exception as err:
            mapped = self._map_error(op, key, err)
            # Keep the original exception (and its chain) for debugging unless its text carries a token.
            text = "".join(traceback.format_exception(err))
            if not any(secret in text for secret in self._secrets()):
                raise mapped from err
        raise mapped  # outside the except block: not even __context__ keeps the token-bearing original

    def _map_error(self, op: str, key: str | None, err: Exception) -> BucketError:
        what = f"{op} {key!r} in {self.url}" if key is not None else f"{op} {self.url}"
        if isinstance(err, BucketNotFoundError):
            return BucketError(
                self._scrub(
                    f"{what} failed: bucket {self.bucket_id!r} not found, or the token cannot access it "
                    f"(create it first or pass create=True){self._detail(err)}"
                )
            )
        if isinstance(err, BucketBatchError):
            failures = "; ".join(f"{f.get('path')}: {f.get('error')}" for f in err.failures) or "unknown"
            return BucketError(self._scrub(f"{what} failed: the server rejected the operation ({failures})"))
        if (isinstance(err, EntryNotFoundError) and not isinstance(err, HfHubHTTPError)) or isinstance(
            err, XetObjectNotFoundError
        ):
            return ObjectNotFoundError(self._scrub(f"{what} failed: no such object"))
        if isinstance(err, RetryableHttpError):
            return self._status_error(what, op, err.status, err.headers, "", str(err))
        if isinstance(err, HfHubHTTPError) and getattr(err, "response", None) is not None:
            status = err.response.status_code
            detail = self._detail(err)
            if status == 404 and not err.response.headers.get("X-Error-Code"):
                return BucketError(
                    self._scrub(
                        f"{what} failed with HTTP 404 without a Hub error code: {err.response.url.host} does not "
                        f"answer like the Hub (check HF_ENDPOINT and proxies){detail}"
                    )
                )
            return self._status_error(what, op, status, err.response.headers, detail, "")
        if isinstance(err, OfflineModeIsEnabled):
            return BucketError(self._scrub(f"{what} failed: HF_HUB_OFFLINE is set, the Hub cannot be reached"))
        if isinstance(err, XetAuthenticationError):
            return self._status_error(what, op, 401, None, "", f"Xet: {err}")
        if isinstance(err, (RuntimeError, OSError)) and (match := _XET_STATUS.search(str(err))):
            # hf_xet: the Xet token endpoint or Xet storage answered with this status.
            return self._status_error(what, op, int(match[1]), None, "", f"Xet: {err}")
        xet_connection = isinstance(err, RuntimeError) and _XET_CONNECTION.search(str(err)) is not None
        if isinstance(err, _TRANSIENT_EXCEPTIONS) or xet_connection:
            return TransientBucketError(self._scrub(f"{what} failed: connection error ({type(err).__name__}: {err})"))
        return BucketError(self._scrub(f"{what} failed: {type(err).__name__}: {err}"))

    def _status_error(
        self, what: str, op: str, status: int | None, headers: httpx2.Headers | None, detail: str, cause: str
    ) -> BucketError:
        """The bucket error for an HTTP status (None: the connection failed or timed out)."""
        because = f" ({cause})" if cause else ""
        if status is None:
            return TransientBucketError(self._scrub(f"{what} failed: connection error{because}"))
        if status == 404:
            return ObjectNotFoundError(self._scrub(f"{what} failed: no such object (HTTP 404){detail}{because}"))
        if _is_transient(status):
            retry_after = retry_after_seconds(headers) if headers is not None else None
            hint = f", retry after {retry_after:g}s" if retry_after is not None else ""
            return TransientBucketError(
                self._scrub(f"{what} failed with HTTP {status}{hint}{detail}{because}"), retry_after=retry_after
            )
        if status in (401, 403):
            access = "write" if op in ("put", "delete", "create bucket") else "read"
            return BucketError(
                self._scrub(
                    f"{what} failed with HTTP {status}: permission denied; the token (token=, HF_TOKEN or the "
                    f"saved login) needs {access} access to bucket {self.bucket_id!r} (a read-only or revoked "
                    f"token fails like this){detail}{because}"
                )
            )
        return BucketError(self._scrub(f"{what} failed with HTTP {status}{detail}{because}"))

    @staticmethod
    def _detail(err: HfHubHTTPError) -> str:
        parts = []
        if err.server_message:
            parts.append(err.server_message.strip())
        if err.request_id:
            parts.append(f"request id {err.request_id}")
        return (": " + "; ".join(parts)) if parts else ""

    # -- Bucket API --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Upload `data` under `key` (one `batch_bucket_files` call).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        remote = self._remote(key)
        logger.debug("put %s (%d bytes) to %s", remote, len(data), self.bucket_id)
        payload = bytes(data)  # huggingface_hub tells raw content from a path by the `bytes` type
        self._call("put", key, lambda: self._upload(payload, remote))

    def put_file(self, key: str, path: str | Path) -> None:
        """Upload the local file `path` under `key` without reading it into memory.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        remote = self._remote(key)
        local = str(Path(path))
        logger.debug("put_file %s -> %s in %s", local, remote, self.bucket_id)
        self._call("put", key, lambda: self._upload(local, remote))

    def _upload(self, source: bytes | str, remote: str) -> None:
        self._xet_token("write")
        self._api.batch_bucket_files(self.bucket_id, add=[(source, remote)], token=self._token)

    def _xet_token(self, kind: str) -> None:
        """Count and pace the Xet token request hf_xet makes itself (outside the Hub client) for one
        transfer: one API request per upload commit or download group."""
        from .budget import RequestClass

        path = f"/api/buckets/{self.bucket_id}/xet-{kind}-token"
        self.meter.acquire(RequestClass.API)
        self.meter.record("GET", path, None, None)

    def _fetch(self, source: str | BucketFile, dest: Path) -> None:
        self._xet_token("read")
        self._api.download_bucket_files(self.bucket_id, [(source, str(dest))], raise_on_missing_files=True, token=self._token)

    def _download(self, key: str, source: str | BucketFile, dest: Path) -> None:
        self._call("get", key, lambda: self._fetch(source, dest))
        if not dest.is_file():  # the client skipped it: treat as missing rather than return garbage
            raise ObjectNotFoundError(f"get {key!r} in {self.url} failed: no such object")

    def _limited_source(self, key: str, max_bytes: int | None) -> str | BucketFile:
        """What to download for `key`: its path, or, under a limit, the version `paths-info` lists (the
        request the download would make anyway), refused from its listed size before any byte is read.

        Raises:
            [`ObjectTooLargeError`]: the listed size is over `max_bytes` (counted in :attr:`refused_too_large`).
            [`ObjectNotFoundError`]: no object has that key.
        """
        remote = self._remote(key)
        if max_bytes is None:
            return remote
        infos = self._call("get", key, lambda: list(self._api.get_bucket_paths_info(self.bucket_id, [remote], token=self._token)))
        info = next((i for i in infos if isinstance(i, BucketFile) and i.path == remote), None)
        if info is None:
            raise ObjectNotFoundError(f"get {key!r} in {self.url} failed: no such object")
        self._check_size(key, int(info.size), max_bytes)
        return info

    def _check_size(self, key: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            self.refused_too_large += 1
            raise ObjectTooLargeError(f"{key}: {size:,} bytes, more than the {max_bytes:,} allowed")

    def get(self, key: str) -> bytes:
        """Download the object `key` (via a temporary file) and return its bytes.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._read(key, None)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """[`get`], refusing an object larger than `max_bytes` from its listed size, before any byte is downloaded.

        Raises:
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
            [`ObjectNotFoundError`], [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._read(key, max_bytes)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        source = self._limited_source(key, max_bytes)
        logger.debug("get %s from %s", key, self.url)
        with tempfile.TemporaryDirectory(prefix="hfbucket-") as tmp:
            dest = Path(tmp, "object")
            self._download(key, source, dest)
            self._check_size(key, dest.stat().st_size, max_bytes)  # what came is what was listed, or refused
            return dest.read_bytes()

    def get_file(self, key: str, path: str | Path) -> None:
        """Download the object `key` into `path`, streamed to disk by hf_xet through a `.part` file of
        this call's own (`{name}.{random}.part` next to `path`), renamed at the end.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._read_file(key, path, None)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        """[`get_file`], refusing an object larger than `max_bytes` from its listed size, before any byte is downloaded.

        Raises:
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
            [`ObjectNotFoundError`], [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._read_file(key, path, max_bytes)

    def _read_file(self, key: str, path: str | Path, max_bytes: int | None) -> None:
        source = self._limited_source(key, max_bytes)
        target = Path(path)
        tmp = part_path(target)
        logger.debug("get_file %s from %s -> %s", key, self.url, path)
        try:
            self._download(key, source, tmp)
            self._check_size(key, tmp.stat().st_size, max_bytes)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """List objects whose key starts with `prefix` (`list_bucket_tree(..., recursive=True)`).

        Keys are returned relative to this bucket's prefix, sorted. Remote files whose names are not
        valid keys (written by other tools) are skipped with a warning.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._list(prefix, None)[0]

    def list_limited(self, prefix: str, max_keys: int) -> tuple[list[ObjectInfo], bool]:
        """[`list`], fetching no page beyond the one that holds object `max_keys + 1`.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._list(prefix, max_keys)

    def _list(self, prefix: str, max_keys: int | None) -> tuple[list[ObjectInfo], bool]:
        validate_prefix(prefix)
        full = self._path_prefix + prefix

        def fetch() -> tuple[list[BucketFile], bool]:
            # The server matches the prefix lexically; filter again below to be safe.
            tree = self._api.list_bucket_tree(self.bucket_id, prefix=full or None, recursive=True, token=self._token)
            files = []
            for item in tree:  # pages are fetched as the iteration reaches them
                if isinstance(item, BucketFile):
                    if max_keys is not None and len(files) == max_keys:
                        return files, False
                    files.append(item)
            return files, True

        try:
            files, complete = self._call("list", prefix, fetch)
        except ObjectNotFoundError:  # the Hub's EntryNotFound 404 for a folder that does not exist: nothing there
            return [], True
        out = []
        skipped = 0
        for item in files:
            if not item.path.startswith(full):
                continue
            key = self._local_key(item.path)
            try:
                validate_key(key or "")
            except BucketError:
                skipped += 1
                continue
            out.append(ObjectInfo(key, int(item.size), item.xet_hash or None))
        if skipped:
            log = logger.debug if self._warned_skipped else logger.warning
            self._warned_skipped = True
            log("list %s: skipped %d remote files whose names are not valid keys", self.url, skipped)
        return sorted(out, key=lambda o: o.key), complete

    def _existing(self, op: str, keys: list[str]) -> set[str]:
        remotes = [self._remote(key) for key in keys]
        infos = self._call(
            op,
            keys[0] if len(keys) == 1 else f"{len(keys)} keys",
            lambda: list(self._api.get_bucket_paths_info(self.bucket_id, remotes, token=self._token)),
        )
        return {info.path for info in infos}

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the given objects; keys that do not exist are ignored.

        Only the paths that exist (per `get_bucket_paths_info`) are sent to `batch_bucket_files`, so a
        missing key never makes the batch fail.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        keys = [validate_key(key) for key in keys]
        if not keys:
            return
        existing = self._existing("delete", keys)
        remotes = [self._remote(key) for key in keys if self._remote(key) in existing]
        if not remotes:
            return
        logger.debug("delete %d objects from %s", len(remotes), self.url)
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        try:
            self._call(
                "delete",
                what,
                lambda: self._api.batch_bucket_files(self.bucket_id, delete=remotes, token=self._token),
            )
        except BucketError as err:
            if isinstance(err, TransientBucketError):
                raise
            # A concurrent delete may have removed some paths first: fine if none is left.
            left = self._existing("delete", [self._local_key(r) or r for r in remotes])
            if left:
                raise

    def exists(self, key: str) -> bool:
        """Whether an object with this key exists (metadata only, nothing is downloaded).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._remote(key) in self._existing("exists", [key])
