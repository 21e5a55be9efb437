"""A Hugging Face Bucket (``hf://buckets/OWNER/NAME[/PREFIX]``) as a :class:`Bucket`.

Objects are uploaded with :meth:`huggingface_hub.HfApi.batch_bucket_files` (the bytes go to Xet
storage first, then one ``/batch`` call makes them visible, so readers see either the old or the
new object), downloaded through hf_xet after one resolve request (:mod:`rlsync.bucket.hf_reads`), and
listed with :meth:`~huggingface_hub.HfApi.list_bucket_tree`.

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
- errors from hf_xet (Xet storage), which arrive as ``RuntimeError`` or ``ConnectionError`` carrying
  the HTTP status in their message, are classified by that status the same way (a storage 404 is a
  missing object, a 401/403 a permission error once a new Xet token was refused too); the Xet token
  endpoint is asked through the Hub client (:mod:`rlsync.bucket.hf_xet_grants`: one token per bucket
  and kind, reused until shortly before it expires), so its errors are the Hub API's;
- anything else -> :class:`BucketError`.

Every request has a timeout and is made once; retries are :class:`RetryingBucket`'s alone (see
:mod:`rlsync.bucket.hf_transport`). The jobs live in parts: :class:`~rlsync.bucket.hf_errors.HubCalls`
(one metered call and its error mapping), :class:`~rlsync.bucket.hf_reads.HubReader` (downloads and
listings), :class:`~rlsync.bucket.hf_writes.HubWriter` (creating the bucket, uploads, deletes),
:mod:`~rlsync.bucket.hf_xet_grants` (the Xet tokens); :class:`HfBucket` joins them.

The access token comes from the ``token`` argument, else the ``HF_TOKEN`` environment variable,
else ``huggingface_hub``'s own lookup (the saved login). None of these tokens ever appears in an
exception message, ``repr`` or log line raised or written by this module: messages are built from
the status code, the server's message and the request id, and scrubbed of every token in case the
server echoed it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from huggingface_hub import HfApi
from huggingface_hub.utils import parse_hf_uri

from ..errors import BucketError
from ..registry import Kind, register
from .base import Bucket, Capability, ObjectInfo, validate_key
from .budget import RequestMeter
from .hf_errors import HubCalls
from .hf_reads import HubReader
from .hf_transport import HfTransferConfig, install
from .hf_writes import HubWriter

if TYPE_CHECKING:
    from .settings import BucketSettings

__all__ = ["HfBucket", "open_hf"]

register(
    Kind.BUCKET, "hf", "rlsync.bucket.hf:open_hf", settings="rlsync.bucket.settings:BucketSettings", env_prefix="HUB",
    capabilities=("metered", "change_feed", "size_limited_reads"),
    summary="a Hugging Face Bucket, hf://buckets/OWNER/NAME[/PREFIX] (timeouts HF_BUCKET_*, budget and watch HUB_*)",
)  # fmt: skip


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

    capabilities = Capability.declared("hf")

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
        self._hub = HubCalls(api=self._api, token=token, bucket_id=bucket_id, url=self.url, meter=self.meter)
        self._reader = HubReader(self._hub, self._path_prefix)
        self._writer = HubWriter(self._hub, self._reader)
        if create:
            self._writer.create_if_missing()

    def feed_connection(self) -> tuple[str, str | None]:
        """Where its live change feed is followed: ``(Hub endpoint, token or None)``."""
        return self._api.endpoint, self._token or None

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

    @property
    def refused_too_large(self) -> int:
        """Reads refused because the object is larger than the reader allows."""
        return self._reader.refused_too_large

    def local_key(self, remote_path: str) -> str | None:
        """The key of a path in the bucket (``None``: outside this bucket's prefix)."""
        return self._reader.local_key(remote_path)

    def scrub(self, text: str) -> str:
        """``text`` with every token this bucket's client may send replaced (for messages about it)."""
        return self._hub.scrub(text)

    # -- Bucket API --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Upload `data` under `key` (one `batch_bucket_files` call).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._writer.upload(key, bytes(data))  # huggingface_hub tells raw content from a path by the `bytes` type

    def put_file(self, key: str, path: str | Path) -> None:
        """Upload the local file `path` under `key` without reading it into memory.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._writer.upload(key, str(Path(path)))

    def get(self, key: str) -> bytes:
        """Download the object `key` (via a temporary file) and return its bytes.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._reader.read(key, None)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """[`get`], refusing an object larger than `max_bytes` from the size its resolve answer gives, before any
        byte is downloaded.

        Raises:
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
            [`ObjectNotFoundError`], [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._reader.read(key, max_bytes)

    def get_file(self, key: str, path: str | Path) -> None:
        """Download the object `key` into `path`, streamed to disk by hf_xet through a `.part` file of
        this call's own (`{name}.{random}.part` next to `path`), renamed at the end.

        Raises:
            [`ObjectNotFoundError`]: no object has that key.
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._reader.read_file(key, path, None)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        """[`get_file`], refusing an object larger than `max_bytes` from the size its resolve answer gives, before
        any byte is downloaded.

        Raises:
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
            [`ObjectNotFoundError`], [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._reader.read_file(key, path, max_bytes)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """List objects whose key starts with `prefix` (`list_bucket_tree(..., recursive=True)`).

        Keys are returned relative to this bucket's prefix, sorted. Remote files whose names are not
        valid keys (written by other tools) are skipped with a warning.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._reader.list(prefix, None)[0]

    def list_limited(self, prefix: str, max_keys: int) -> tuple[list[ObjectInfo], bool]:
        """[`list`], fetching no page beyond the one that holds object `max_keys + 1`.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._reader.list(prefix, max_keys)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the given objects; keys that do not exist are ignored.

        Only the paths that exist (per `get_bucket_paths_info`) are sent to `batch_bucket_files`, so a
        missing key never makes the batch fail.

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        self._writer.delete(keys)

    def exists(self, key: str) -> bool:
        """Whether an object with this key exists (metadata only, nothing is downloaded).

        Raises:
            [`InvalidKeyError`], [`TransientBucketError`], [`BucketError`]
        """
        return self._reader.remote(key) in self._reader.existing("exists", [key])


def open_hf(url: str, *, create: bool = False, settings: BucketSettings | None = None) -> Bucket:
    """The Hub bucket at ``url`` with ``settings`` (timeouts and request budget), behind retries (the Hub
    throttles with 429 and has bad moments)."""
    from .retry import RetryingBucket

    options = {} if settings is None else {"transfer": settings.transfer, "meter": settings.meter()}
    return RetryingBucket(HfBucket.from_url(url, create=create, **options))
