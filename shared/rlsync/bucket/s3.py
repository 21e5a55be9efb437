"""An S3-compatible bucket (``s3://BUCKET[/PREFIX]``: AWS S3, MinIO, Cloudflare R2, moto) as a :class:`Bucket`.

boto3 is optional (``pip install 'rlsync[s3]'``): the library imports this module only when an ``s3://`` bucket is
opened, and opening one without boto3 is a :class:`ConfigurationError` that says what to install.

- A write is one ``PutObject``: S3 makes an object visible whole, so a reader sees the old object or the new one
  (one request holds up to S3's 5 GiB).
- :meth:`S3Bucket.put_if_absent` writes with ``If-None-Match: *``, the ``conditional_writes`` capability.
- A read with a limit is one ranged ``GetObject`` of its first ``max_bytes + 1`` bytes (``size_limited_reads``): an
  answer whose ``Content-Range`` total (or, from a server that ignores ranges, whose length) is over the limit is
  refused and its body closed unread, so at most ``max_bytes + 1`` bytes ever come; S3's 416 ``InvalidRange`` to a
  range on an empty object reads as the empty object.
- Listings are ``ListObjectsV2`` pages; :meth:`S3Bucket.list_limited` fetches no page past the one it needs, and a
  server that hands back a continuation token twice is refused, never followed round in a circle.
- Requests are not ``metered``: S3 has no per-token request window like the Hub's.
- Every request has the settings' timeouts and is made once (botocore's own retries are off): retries are
  :class:`~rlsync.bucket.retry.RetryingBucket`'s, as for the Hub.

What boto3 raises is mapped onto the bucket error types:

- ``NoSuchKey`` or a 404 on an object -> :class:`ObjectNotFoundError`;
- ``NoSuchBucket`` -> :class:`BucketError` (a missing bucket is a configuration error, not an empty bucket);
- 408, 429, 5xx, ``SlowDown``, connection failures, timeouts and cut-off downloads -> :class:`TransientBucketError`,
  with the server's ``Retry-After``;
- 401/403 -> :class:`BucketError` saying the credentials lack access (never their values);
- no credentials at all -> :class:`ConfigurationError` naming the variables;
- anything else -> :class:`BucketError`.

The credentials, and the endpoint and region unless :class:`S3Settings` names them (``S3_ENDPOINT_URL``,
``S3_REGION``), come from boto3's usual chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, ``~/.aws``, an instance role.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..errors import (
    BucketError,
    ConfigurationError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    TransientBucketError,
)
from ..registry import Kind, register
from ..retry import retry_after_seconds
from .base import Bucket, Capability, ObjectInfo, part_path, validate_key, validate_prefix

try:
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError as missing:  # the optional extra: opening a bucket says what to install
    _BOTO_MISSING: ImportError | None = missing
else:
    _BOTO_MISSING = None
    #: Failures without an answer worth retrying: connections refused, dropped or timed out, downloads cut off.
    _TRANSIENT_FAILURES = (
        botocore.exceptions.ConnectionError,
        botocore.exceptions.HTTPClientError,
        botocore.exceptions.IncompleteReadError,
    )

register(
    Kind.BUCKET, "s3", "rlsync.bucket.s3:open_s3", settings="rlsync.bucket.s3:S3Settings", env_prefix="S3",
    capabilities=("size_limited_reads", "conditional_writes"),
    summary="an S3-compatible bucket, s3://BUCKET[/PREFIX] (boto3: pip install 'rlsync[s3]'; S3_ENDPOINT_URL, "
    "S3_REGION; credentials from AWS_* or ~/.aws)",
)  # fmt: skip

__all__ = ["S3Bucket", "S3Settings", "open_s3"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: AWS's bucket names: 3 to 63 lower-case letters, digits, dots and hyphens, a letter or digit at each end.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: Error codes worth retrying whatever the status says.
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "ConditionalRequestConflict"}
)
#: Keys per ``DeleteObjects`` request (S3's limit) and per ``ListObjectsV2`` page.
_PAGE = 1000
#: Bytes per read of a download streamed to a file.
_CHUNK = 8 << 20
#: How much of a server's error message goes into ours.
_MESSAGE_CHARS = 200
#: A ranged answer's ``Content-Range``: first and last byte sent, and the object's size (``*``: not said).
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)")


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """How an S3-compatible bucket is reached (the ``s3`` entry's settings, variables ``S3_<FIELD>``).

    Args:
        endpoint_url: The server, e.g. ``http://127.0.0.1:9000`` for MinIO; ``None``: boto3's
            (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS).
        region: The region; ``None``: boto3's (``AWS_REGION``, ``AWS_DEFAULT_REGION``, ``~/.aws/config``).
        path_style: Address buckets as ``ENDPOINT/BUCKET`` instead of ``BUCKET.ENDPOINT`` (most self-hosted servers).
        connect_timeout: Longest wait to open a connection, in seconds.
        read_timeout: Longest silence while waiting for response bytes, in seconds.

    Raises:
        ConfigurationError: a timeout is not positive.
    """

    endpoint_url: str | None = dataclasses.field(default=None, metadata={"help": "the S3 endpoint (unset: boto3's)"})
    region: str | None = dataclasses.field(default=None, metadata={"help": "the region (unset: boto3's)"})
    path_style: bool = dataclasses.field(default=False, metadata={"help": "path-style bucket addressing"})
    connect_timeout: float = dataclasses.field(default=10.0, metadata={"help": "connect timeout (s)"})
    read_timeout: float = dataclasses.field(default=60.0, metadata={"help": "read timeout (s)"})

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigurationError(f"S3_{name.upper()}={value!r}: a timeout is a positive number of seconds")

    def client(self) -> Any:
        """A new boto3 S3 client with these settings, one attempt per request.

        Raises:
            ConfigurationError: boto3 is not installed.
        """
        if _BOTO_MISSING is not None:
            raise ConfigurationError(
                f"s3:// buckets need boto3 ({_BOTO_MISSING}): pip install boto3, or pip install 'rlsync[s3]'"
            )
        config = botocore.config.Config(
            connect_timeout=self.connect_timeout, read_timeout=self.read_timeout, retries={"total_max_attempts": 1},
            s3={"addressing_style": "path" if self.path_style else "auto"},
            # checksums only where the operation needs one: what S3-compatible servers other than AWS accept
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )  # fmt: skip
        session = boto3.session.Session()
        return session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)


class S3Bucket(Bucket):
    """A bucket of an S3-compatible object store, optionally restricted to a folder (prefix) inside it.

    Args:
        name: The bucket's name.
        prefix: A folder inside the bucket: keys are stored under ``"{prefix}/{key}"`` and listed relative to it.
        settings: The endpoint, region and timeouts (``None``: :class:`S3Settings` defaults).
        create: Create the bucket if it does not exist (one ``HeadBucket``; ``CreateBucket`` only when there is none).
        client: The boto3 S3 client to use (``None``: a new one from ``settings``).

    Raises:
        BucketError: the name is not a bucket name, the prefix not a valid key, or creating the bucket failed.
        ConfigurationError: boto3 is not installed, or there are no credentials to create the bucket with.
    """

    capabilities = Capability.declared("s3")

    def __init__(
        self, name: str, *, prefix: str = "", settings: S3Settings | None = None, create: bool = False, client: Any = None
    ) -> None:
        if not isinstance(name, str) or not _BUCKET_NAME.fullmatch(name):
            raise BucketError(f"invalid S3 bucket name {name!r}: 3 to 63 lower-case letters, digits, '.' and '-'")
        prefix = prefix.strip("/")
        self.name = name
        self.prefix = validate_key(prefix) if prefix else ""
        self._path_prefix = f"{self.prefix}/" if self.prefix else ""
        self.url = f"s3://{name}" + (f"/{self.prefix}" if self.prefix else "")
        self._client = client if client is not None else (settings or S3Settings()).client()
        #: Reads refused because the object is larger than the reader allows.
        self.refused_too_large = 0
        self._warned_skipped = False
        if create:
            _create_if_missing(self)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> "S3Bucket":
        """Open the bucket of an ``s3://BUCKET[/PREFIX]`` URL (``kwargs``: :class:`S3Bucket`'s).

        Raises:
            BucketError: the URL is not an ``s3://`` bucket URL.
        """
        scheme, sep, rest = url.partition("://")
        if scheme != "s3" or not sep:
            raise BucketError(f"invalid S3 bucket URL {url!r}: expected s3://BUCKET[/PREFIX]")
        name, _, prefix = rest.partition("/")
        return cls(name, prefix=prefix, **kwargs)

    # -- one request, its errors mapped ------------------------------------------------------------------

    def _call(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """Run one boto3 request (or body read), mapping what it raises onto the bucket error types."""
        try:
            return fn()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise _mapped(self._what(op, key), self.name, key, err) from err

    def _what(self, op: str, key: str | None) -> str:
        return f"{op} {key!r} in {self.url}" if key is not None else f"{op} {self.url}"

    # -- writes ------------------------------------------------------------------------------------------

    def _remote(self, key: str) -> str:
        return self._path_prefix + validate_key(key)

    def put(self, key: str, data: bytes) -> None:
        remote, payload = self._remote(key), bytes(data)
        self._call("put", key, lambda: self._client.put_object(Bucket=self.name, Key=remote, Body=payload))

    def put_file(self, key: str, path: str | Path) -> None:
        remote = self._remote(key)
        with open(path, "rb") as body:
            self._call("put", key, lambda: self._client.put_object(Bucket=self.name, Key=remote, Body=body))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` only if no object has that key (``If-None-Match: *``), atomically: of two
        writers, one wins. A retry after a failure that did write reads as lost (``False``).

        Returns:
            Whether this call wrote the object (``False``: one was there).

        Raises:
            InvalidKeyError, TransientBucketError, BucketError
        """
        remote, payload = self._remote(key), bytes(data)

        def write() -> bool:
            try:
                self._client.put_object(Bucket=self.name, Key=remote, Body=payload, IfNoneMatch="*")
                return True
            except botocore.exceptions.ClientError as err:
                if _answer(err)[1] == 412:
                    return False
                raise

        return self._call("put", key, write)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        remotes = [self._remote(key) for key in keys]
        for start in range(0, len(remotes), _PAGE):
            batch = {"Objects": [{"Key": remote} for remote in remotes[start : start + _PAGE]], "Quiet": True}
            what = keys[0] if len(keys) == 1 else f"{len(batch['Objects'])} keys"
            answer = self._call("delete", what, lambda: self._client.delete_objects(Bucket=self.name, Delete=batch))
            failed = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                first = failed[0]
                raise BucketError(
                    f"delete in {self.url}: {len(failed)} of {len(batch['Objects'])} objects not deleted"
                    f" (first: {str(first.get('Key'))[:_MESSAGE_CHARS]!r}, {first.get('Code')})"
                )

    # -- reads -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _opened(self, key: str, max_bytes: int | None) -> Iterator[tuple[Any, int]]:
        """``(body, size)`` of ``key``'s ``GetObject``; with ``max_bytes``, one ranged ``GetObject`` of at most
        ``max_bytes + 1`` bytes, refused (its body closed unread) when the object is larger."""
        options = {"Bucket": self.name, "Key": self._remote(key)}
        if max_bytes is not None:
            options["Range"] = f"bytes=0-{max_bytes}"

        def get() -> dict | None:
            try:
                return self._client.get_object(**options)
            except botocore.exceptions.ClientError as err:
                if "Range" in options and _answer(err)[1] == 416:  # no byte 0 to send: the object is empty
                    return None
                raise

        answer = self._call("get", key, get)
        if answer is None:
            yield io.BytesIO(), 0
            return
        body = answer["Body"]
        try:
            size = _size(answer, self._what("get", key))
            if max_bytes is not None:
                self._check_range(key, answer.get("ContentRange"), size, max_bytes)
            yield body, size
        finally:
            body.close()

    def _check_range(self, key: str, content_range: Any, size: int, max_bytes: int) -> None:
        """Refuse a ranged answer of ``size`` bytes over ``max_bytes``: its ``Content-Range`` total (none: a server
        that ignored the range sent the whole object), or its length where the total is not said; or a part that
        stops short of an object within the limit.

        Raises:
            ObjectTooLargeError: the object is larger than ``max_bytes``.
            BucketError: the ``Content-Range`` is not one, or the part sent is not the whole object.
        """
        total = size
        if content_range is not None:
            found = _CONTENT_RANGE.fullmatch(str(content_range))
            if found is None or int(found[1]) != 0 or int(found[2]) != size - 1:
                what = f"{self._what('get', key)}: the server answered {str(content_range)[:80]!r}"
                raise BucketError(f"{what} for {size:,} bytes from byte 0")
            total = size if found[3] == "*" else int(found[3])
        if max(total, size) > max_bytes:
            self.refused_too_large += 1
            raise ObjectTooLargeError(f"{key}: {total:,} bytes in {self.url}, more than the {max_bytes:,} allowed")
        if total != size:
            raise BucketError(f"{self._what('get', key)}: {size:,} of its {total:,} bytes came in a range asking for all")

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        with self._opened(key, max_bytes) as (body, size):
            data = self._call("get", key, lambda: body.read(size))
        if len(data) != size:
            raise TransientBucketError(f"{self._what('get', key)}: {len(data):,} of {size:,} bytes came")
        return data

    def _read_file(self, key: str, path: str | Path, max_bytes: int | None) -> None:
        tmp = part_path(path)
        try:
            with self._opened(key, max_bytes) as (body, size), open(tmp, "wb") as out:
                left = size
                while left:
                    chunk = self._call("get", key, lambda: body.read(min(left, _CHUNK)))
                    if not chunk:
                        raise TransientBucketError(f"{self._what('get', key)}: {left:,} bytes never came")
                    out.write(chunk)
                    left -= len(chunk)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        return self._read(key, None)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        return self._read(key, max_bytes)

    def get_file(self, key: str, path: str | Path) -> None:
        self._read_file(key, path, None)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self._read_file(key, path, max_bytes)

    def exists(self, key: str) -> bool:
        remote = self._remote(key)
        try:
            self._call("exists", key, lambda: self._client.head_object(Bucket=self.name, Key=remote))
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._list(prefix, None)[0]

    def list_limited(self, prefix: str, max_keys: int) -> tuple[list[ObjectInfo], bool]:
        return self._list(prefix, max_keys)

    def _list(self, prefix: str, max_keys: int | None) -> tuple[list[ObjectInfo], bool]:
        """The objects under ``prefix``, sorted (at most ``max_keys``), and whether that is all of them."""
        full = self._path_prefix + validate_prefix(prefix)
        out: list[ObjectInfo] = []
        skipped, tokens, options = 0, set(), {"Bucket": self.name, "Prefix": full, "MaxKeys": _PAGE}
        while True:
            page = self._call("list", prefix, lambda: self._client.list_objects_v2(**options))
            for item in page.get("Contents", []):
                info = _listed(item, full, self._path_prefix)
                if info is None:
                    skipped += 1
                elif max_keys is not None and len(out) == max_keys:
                    self._warn_skipped(skipped)
                    return sorted(out, key=lambda o: o.key), False
                else:
                    out.append(info)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated"):
                break
            if not isinstance(token, str) or not token or token in tokens:
                raise BucketError(f"list {prefix!r} in {self.url}: the listing does not advance (a token came back)")
            tokens.add(token)
            options["ContinuationToken"] = token
        self._warn_skipped(skipped)
        return sorted(out, key=lambda o: o.key), True

    def _warn_skipped(self, skipped: int) -> None:
        if skipped:
            log = logger.debug if self._warned_skipped else logger.warning
            self._warned_skipped = True
            log("list %s: skipped %d objects whose names are not valid keys", self.url, skipped)


def _create_if_missing(bucket: S3Bucket) -> None:
    """Create ``bucket`` where its store has none of its name (one ``HeadBucket``, then ``CreateBucket``)."""
    client, name = bucket._client, bucket.name

    def exists() -> bool:
        try:
            client.head_bucket(Bucket=name)
            return True
        except botocore.exceptions.ClientError as err:
            if _answer(err)[1] == 404:
                return False
            raise

    if bucket._call("open", None, exists):
        return
    region = client.meta.region_name
    where = {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}

    def create() -> None:
        try:
            client.create_bucket(Bucket=name, **where)
        except botocore.exceptions.ClientError as err:
            if _answer(err)[0] != "BucketAlreadyOwnedByYou":  # created by a concurrent open
                raise

    bucket._call("create bucket", None, create)
    logger.info("created bucket %s", bucket.url)


def _mapped(what: str, bucket: str, key: str | None, err: Exception) -> Exception:
    """The bucket error for what boto3 raised doing ``what`` (``key``: the object asked for; ``None``: the bucket)."""
    if isinstance(err, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        return ConfigurationError(
            f"{what}: no AWS credentials ({err}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    if isinstance(err, _TRANSIENT_FAILURES):
        return TransientBucketError(f"{what} failed: {type(err).__name__}: {str(err)[:_MESSAGE_CHARS]}")
    if not isinstance(err, botocore.exceptions.ClientError):
        return BucketError(f"{what} failed: {type(err).__name__}: {str(err)[:_MESSAGE_CHARS]}")
    code, status, headers = _answer(err)
    message = str(err.response.get("Error", {}).get("Message", ""))[:_MESSAGE_CHARS]
    if code == "NoSuchBucket":
        return BucketError(f"{what}: there is no bucket {bucket!r} at this endpoint (open it with create=True)")
    if key is not None and (code in ("NoSuchKey", "NotFound") or status == 404):
        return ObjectNotFoundError(f"{what}: no such object")
    if status in (408, 429) or status >= 500 or code in _TRANSIENT_CODES:
        return TransientBucketError(f"{what} failed: {status} {code} {message}", retry_after_seconds(headers))
    if status in (401, 403):
        return BucketError(f"{what}: access denied ({status} {code}): the AWS credentials may not do this here")
    return BucketError(f"{what} failed: {status} {code} {message}")


def _listed(item: dict, full: str, path_prefix: str) -> ObjectInfo | None:
    """An object of a listing page, or ``None``: outside the prefix, not a valid key, or not a size."""
    remote, size = item.get("Key"), item.get("Size")
    if not isinstance(remote, str) or not remote.startswith(full) or not isinstance(size, int) or size < 0:
        return None
    try:
        key = validate_key(remote[len(path_prefix) :])
    except BucketError:
        return None
    etag = item.get("ETag")
    return ObjectInfo(key, size, etag.strip('"') if isinstance(etag, str) and etag else None)


def _answer(err: Any) -> tuple[str, int, dict]:
    """A ``ClientError``'s error code, HTTP status (0 where none) and headers."""
    response = err.response if isinstance(err.response, dict) else {}
    meta = response.get("ResponseMetadata", {})
    status = meta.get("HTTPStatusCode")
    code = str(response.get("Error", {}).get("Code", ""))
    return code, status if isinstance(status, int) else 0, meta.get("HTTPHeaders", {})


def _size(answer: dict, what: str) -> int:
    """The ``ContentLength`` of a ``HeadObject``/``GetObject`` answer.

    Raises:
        BucketError: it has none, or a negative one.
    """
    size = answer.get("ContentLength")
    if not isinstance(size, int) or size < 0:
        raise BucketError(f"{what}: the server answered no valid size ({size!r})")
    return size


def open_s3(url: str, *, create: bool = False, settings: S3Settings | None = None) -> Bucket:
    """The S3 bucket at ``url`` with ``settings`` (endpoint, region, timeouts), behind retries.

    Raises:
        BucketError: the URL is not ``s3://BUCKET[/PREFIX]``, or the bucket cannot be created.
        ConfigurationError: boto3 is not installed.
    """
    from .retry import RetryingBucket

    return RetryingBucket(S3Bucket.from_url(url, settings=settings, create=create))
