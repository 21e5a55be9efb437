"""The bucket interface: whole-object put, get, list and delete.

Every backend (local folder, Hugging Face Bucket, fault-injecting wrapper)
implements :class:`Bucket`. The sync protocol never needs partial reads or
appends, so the interface is deliberately small. Keys are ``/``-separated
relative paths; :func:`validate_key` rejects anything that could escape the
bucket (``..``, absolute paths, backslashes, empty segments).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
import uuid
from pathlib import Path
from typing import ClassVar, Iterable

from ..errors import BucketError, InvalidKeyError, ObjectNotFoundError, ObjectTooLargeError, TransientBucketError

__all__ = [
    "Bucket",
    "BucketError",
    "Capability",
    "BucketWrapper",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "TransientBucketError",
    "InvalidKeyError",
    "backend_of",
    "validate_key",
]


class Capability(str, enum.Enum):
    """What a bucket backend can do beyond the interface, declared where it registers (``capabilities=``)."""

    #: Its requests cost (a budget per token and window): it has a ``meter`` counting them, and roles follow it
    #: through a watched listing (:func:`rlsync.bucket.watch.watch`) instead of listing in loops.
    METERED = "metered"
    #: It announces changes live (:mod:`rlsync.bucket.watch_feed` follows them; :meth:`Bucket.local_key`).
    CHANGE_FEED = "change_feed"
    #: :meth:`Bucket.get_limited` refuses an oversized object before reading its bytes.
    SIZE_LIMITED_READS = "size_limited_reads"
    #: The store can write an object only where none exists (S3's ``If-None-Match: *``:
    #: :meth:`rlsync.bucket.s3.S3Bucket.put_if_absent`); the run lock (:mod:`rlsync.protocol.lock`) does not use it
    #: yet, it would take it over its fence where a backend declares it.
    CONDITIONAL_WRITES = "conditional_writes"

    @classmethod
    def declared(cls, scheme: str) -> frozenset["Capability"]:
        """The capabilities the backend registered for ``scheme`` declares (:mod:`rlsync.registry`)."""
        from ..registry import Kind, get

        return frozenset(cls(name) for name in get(Kind.BUCKET, scheme).capabilities)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object in a bucket listing.

    Args:
        key: The object's key.
        size: Its size in bytes.
        etag: A hash of its content when the backend knows one (the Hub's Xet hash), else `None`;
            not part of equality (listings compare by key and size).
    """

    key: str
    size: int
    etag: str | None = dataclasses.field(default=None, compare=False)


_SEGMENT = re.compile(r"^[A-Za-z0-9._=+@-]+$")
MAX_KEY_LENGTH = 1024


def validate_key(key: str) -> str:
    """Check that ``key`` is a safe, relative object key and return it.

    Raises:
        InvalidKeyError: the key is empty, absolute, contains ``..``, ``.``,
            empty segments, backslashes or characters outside ``[A-Za-z0-9._=+@-]``.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid object key {key!r}: must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"invalid object key: longer than {MAX_KEY_LENGTH} characters")
    if key.startswith("/") or "\\" in key or ":" in key:
        raise InvalidKeyError(f"invalid object key {key!r}: must be a relative '/'-separated path")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKeyError(f"invalid object key {key!r}: empty, '.' or '..' segment")
        if not _SEGMENT.fullmatch(segment):  # match() would let a trailing newline through '$'
            raise InvalidKeyError(f"invalid object key {key!r}: unsupported characters")
    return key


def validate_prefix(prefix: str) -> str:
    """Check a listing prefix: empty, or a valid key optionally ending in ``/``."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/"))
    return prefix


def part_path(path: str | Path) -> Path:
    """A download's temporary file beside ``path``, of this call's own (``{name}.{random}.part``), so
    concurrent downloads to the same path never write into one file."""
    target = Path(path)
    return target.with_name(f"{target.name}.{uuid.uuid4().hex[:12]}.part")


class Bucket(abc.ABC):
    """An object store holding whole objects under string keys.

    Implementations must make :meth:`put` atomic from a reader's point of view:
    a concurrent :meth:`get` sees either the old object, the new one, or
    :class:`ObjectNotFoundError`, never a partial object.
    """

    #: The URL this bucket was opened from (``file:///...``, ``hf://buckets/...``).
    url: str
    #: What the backend can do (:meth:`Capability.declared` reads its registration); wrappers have none.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any existing object."""

    def put_file(self, key: str, path: str | Path) -> None:
        """Store the contents of the local file ``path`` under ``key``."""
        self.put(key, Path(path).read_bytes())

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object stored under ``key``.

        Raises:
            ObjectNotFoundError: no object has that key.
        """

    def get_file(self, key: str, path: str | Path) -> None:
        """Download the object ``key`` into the local file ``path``."""
        data = self.get(key)
        tmp = part_path(path)
        tmp.write_bytes(data)
        tmp.replace(path)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """:meth:`get`, refusing an object larger than ``max_bytes``.

        Backends that can learn the size first (local folder, Hugging Face Bucket, S3)
        refuse before reading; this default checks after the download.

        Raises:
            ObjectNotFoundError: no object has that key.
            ObjectTooLargeError: the object holds more than ``max_bytes`` bytes.
        """
        data = self.get(key)
        if len(data) > max_bytes:
            raise ObjectTooLargeError(f"{key}: {len(data):,} bytes, more than the {max_bytes:,} allowed")
        return data

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        """:meth:`get_file`, refusing an object larger than ``max_bytes`` (see :meth:`get_limited`)."""
        self.get_file(key, path)
        size = Path(path).stat().st_size
        if size > max_bytes:
            Path(path).unlink(missing_ok=True)
            raise ObjectTooLargeError(f"{key}: {size:,} bytes, more than the {max_bytes:,} allowed")

    def get_uncached(self, key: str, max_bytes: int) -> bytes:
        """:meth:`get_limited` from the store itself, never from a cache or a view that may be stale:
        what a check that must see the newest object reads (the run lock's fence, the pointer before a
        publish). Only buckets that cache (:class:`~rlsync.bucket.watch.WatchedBucket`) and wrappers
        that map keys override it; the default is :meth:`get_limited`.

        Raises:
            ObjectNotFoundError: no object has that key.
            ObjectTooLargeError: the object holds more than ``max_bytes`` bytes.
        """
        return self.get_limited(key, max_bytes)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """List objects whose key starts with ``prefix``, sorted by key."""

    def list_limited(self, prefix: str, max_keys: int) -> tuple[list[ObjectInfo], bool]:
        """:meth:`list`, stopping after ``max_keys`` objects, so that a prefix flooded with keys costs a
        bounded number of listing requests; backends that list in pages (the Hub) stop fetching pages
        there, the default lists everything and cuts.

        Returns:
            The first ``max_keys`` objects in key order, and whether that is all of them.
        """
        listing = self.list(prefix)
        return listing[:max_keys], len(listing) <= max_keys

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the given objects; keys that do not exist are ignored."""

    def sweep_temporary(self, max_age_s: float, prefixes: Iterable[str]) -> int:
        """Delete temporary files older than ``max_age_s`` that killed writers of this
        backend left behind, only where keys starting with one of ``prefixes`` live: a
        prefix ending in ``/`` covers its folder and those below, any other prefix (a key)
        only its own folder.

        Only backends whose writes go through temporary files have any (the local
        folder); the default does nothing.

        Returns:
            The number of files removed.
        """
        return 0

    def exists(self, key: str) -> bool:
        """Whether an object with this key exists."""
        try:
            self.get(key)
        except ObjectNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Release what the bucket holds (background threads, open sessions); the default holds nothing."""

    def local_key(self, remote_path: str) -> str | None:
        """The key of a path its change feed reports (``None``: not this bucket's); the default: the path."""
        return remote_path

    def scrub(self, text: str) -> str:
        """``text`` safe to log (a backend holding a secret removes it); the default: unchanged."""
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def backend_of(bucket: Bucket) -> Bucket:
    """The backend under ``bucket``'s wrappers (retries, prefixes, a watched listing)."""
    while isinstance(bucket, BucketWrapper):
        bucket = bucket.inner
    return bucket


class BucketWrapper(Bucket):
    """A bucket in front of another: every operation goes to `inner` unchanged unless a subclass
    changes it, so a wrapper (retries, faults, a key prefix, a watched listing) states only what
    it adds, and an operation added to :class:`Bucket` reaches every backend through any wrapper.

    Args:
        inner ([`Bucket`]): The bucket the operations go to.
    """

    def __init__(self, inner: Bucket) -> None:
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def put_file(self, key: str, path: str | Path) -> None:
        self.inner.put_file(key, path)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_file(self, key: str, path: str | Path) -> None:
        self.inner.get_file(key, path)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        return self.inner.get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self.inner.get_file_limited(key, path, max_bytes)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def sweep_temporary(self, max_age_s: float, prefixes: Iterable[str]) -> int:
        return self.inner.sweep_temporary(max_age_s, prefixes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
