"""A Hugging Face Bucket (``hf://buckets/OWNER/NAME[/PREFIX]``) as a :class:`Bucket`.

Objects are uploaded with :meth:`huggingface_hub.HfApi.batch_bucket_files` (the bytes go to Xet
storage first, then one ``/batch`` call makes them visible, so readers see either the old or the
new object), downloaded with :meth:`~huggingface_hub.HfApi.download_bucket_files`, and listed with
:meth:`~huggingface_hub.HfApi.list_bucket_tree`.

Errors from ``huggingface_hub`` are mapped onto the bucket error types by :class:`~rlsync.bucket.hf_errors.HfErrors`.

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
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from huggingface_hub import BucketFile, HfApi
from huggingface_hub.utils import parse_hf_uri

from ..errors import BucketError, ObjectNotFoundError, ObjectTooLargeError, TransientBucketError
from .base import Bucket, ObjectInfo, part_path, validate_key, validate_prefix
from .budget import RequestMeter
from .hf_errors import HfErrors
from .hf_paths import HfPaths, create_if_missing
from .hf_transport import HfTransferConfig, install, metering, single_attempt

__all__ = ["HfBucket"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

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
        self.paths = HfPaths(prefix)
        self._token = token
        self._api = api if api is not None else HfApi(token=self._token)
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")
        self._errors = HfErrors(bucket_id, self.url, lambda: (self._token, getattr(self._api, "token", None)))
        if create:
            create_if_missing(self._api, bucket_id, self._token, self._call)

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

    def _call(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """Run one `huggingface_hub` call, metered, once, its errors mapped onto the bucket error types."""
        with metering(self.meter), single_attempt():
            return self._errors.call(op, key, fn)

    # -- Bucket API --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Upload `data` under `key` (one `batch_bucket_files` call).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        remote = self.paths.remote(key)
        logger.debug("put %s (%d bytes) to %s", remote, len(data), self.bucket_id)
        payload = bytes(data)  # huggingface_hub tells raw content from a path by the `bytes` type
        self._call("put", key, lambda: self._upload(payload, remote))

    def put_file(self, key: str, path: str | Path) -> None:
        """Upload the local file `path` under `key` without reading it into memory.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        remote = self.paths.remote(key)
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

    def _fetch(self, remote: str, dest: Path) -> None:
        self._xet_token("read")
        self._api.download_bucket_files(self.bucket_id, [(remote, str(dest))], raise_on_missing_files=True, token=self._token)

    def _download(self, key: str, remote: str, dest: Path) -> None:
        self._call(
            "get",
            key,
            lambda: self._fetch(remote, dest),
        )
        if not dest.is_file():  # the client skipped it: treat as missing rather than return garbage
            raise ObjectNotFoundError(f"get {key!r} in {self.url} failed: no such object")

    def get(self, key: str) -> bytes:
        """Download the object `key` (via a temporary file) and return its bytes.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._read(key, None)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """[`get`], refusing an object larger than `max_bytes` before its bytes are read into memory.

        Raises:
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
            [`ObjectNotFoundError`], [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._read(key, max_bytes)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        remote = self.paths.remote(key)
        logger.debug("get %s from %s", remote, self.bucket_id)
        with tempfile.TemporaryDirectory(prefix="hfbucket-") as tmp:
            dest = Path(tmp, "object")
            self._download(key, remote, dest)
            size = dest.stat().st_size
            if max_bytes is not None and size > max_bytes:
                raise ObjectTooLargeError(f"{key}: {size:,} bytes, more than the {max_bytes:,} allowed")
            return dest.read_bytes()

    def get_file(self, key: str, path: str | Path) -> None:
        """Download the object `key` into `path`, streamed to disk by hf_xet through a `.part` file of
        this call's own (`{name}.{random}.part` next to `path`), renamed at the end.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        remote = self.paths.remote(key)
        target = Path(path)
        tmp = part_path(target)
        logger.debug("get_file %s from %s -> %s", remote, self.bucket_id, path)
        try:
            self._download(key, remote, tmp)
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
        validate_prefix(prefix)
        full = self.paths.remote_prefix(prefix)

        def fetch() -> list[BucketFile]:
            # The server matches the prefix lexically; filter again below to be safe.
            tree = self._api.list_bucket_tree(self.bucket_id, prefix=full or None, recursive=True, token=self._token)
            return [item for item in tree if isinstance(item, BucketFile)]

        try:
            files = self._call("list", prefix, fetch)
        except ObjectNotFoundError:  # the Hub's EntryNotFound 404 for a folder that does not exist: nothing there
            return []
        return self.paths.objects(files, full, self.url)

    def _existing(self, op: str, keys: list[str]) -> set[str]:
        remotes = [self.paths.remote(key) for key in keys]
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        infos = self._call(op, what, lambda: list(self._api.get_bucket_paths_info(self.bucket_id, remotes, token=self._token)))
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
        remotes = [self.paths.remote(key) for key in keys if self.paths.remote(key) in existing]
        if not remotes:
            return
        logger.debug("delete %d objects from %s", len(remotes), self.url)
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        try:
            self._call("delete", what, lambda: self._api.batch_bucket_files(self.bucket_id, delete=remotes, token=self._token))
        except BucketError as err:
            if isinstance(err, TransientBucketError):
                raise
            # A concurrent delete may have removed some paths first: fine if none is left.
            left = self._existing("delete", [self.paths.local_key(r) or r for r in remotes])
            if left:
                raise

    def exists(self, key: str) -> bool:
        """Whether an object with this key exists (metadata only, nothing is downloaded).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self.paths.remote(key) in self._existing("exists", [key])
