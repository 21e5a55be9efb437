"""A view of a bucket under a key prefix.

:class:`PrefixedBucket` lets a second chain live in the same bucket as the weights chain
(e.g. a LoRA adapter chain under ``adapters/``) with the unchanged publisher, subscriber,
run lock and retention: every key they use is prefixed, every listed key unprefixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .base import Bucket, BucketWrapper, ObjectInfo, validate_key, validate_prefix

__all__ = ["PrefixedBucket"]


class PrefixedBucket(BucketWrapper):
    """The objects of ``inner`` whose keys start with ``prefix``, addressed without it.

    Args:
        inner: The bucket holding the objects.
        prefix: A valid key ending in ``/`` (e.g. ``"adapters/"``).

    Raises:
        ValueError: ``prefix`` does not end in ``/``.
        InvalidKeyError: ``prefix`` without its ``/`` is not a valid key.
    """

    def __init__(self, inner: Bucket, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"a bucket prefix ends with '/', got {prefix!r}")
        validate_key(prefix[:-1])
        super().__init__(inner)
        self.prefix = prefix
        self.url = f"{inner.url.rstrip('/')}/{prefix[:-1]}"

    def _key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(self._key(key), data)

    def put_file(self, key: str, path: str | Path) -> None:
        self.inner.put_file(self._key(key), path)

    def get(self, key: str) -> bytes:
        return self.inner.get(self._key(key))

    def get_file(self, key: str, path: str | Path) -> None:
        self.inner.get_file(self._key(key), path)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        return self.inner.get_limited(self._key(key), max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self.inner.get_file_limited(self._key(key), path, max_bytes)

    def get_uncached(self, key: str, max_bytes: int) -> bytes:
        return self.inner.get_uncached(self._key(key), max_bytes)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        return [
            ObjectInfo(info.key[len(self.prefix) :], info.size, info.etag)
            for info in self.inner.list(self.prefix + prefix)
            if info.key.startswith(self.prefix)
        ]

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete([self._key(k) for k in keys])

    def sweep_temporary(self, max_age_s: float, prefixes: Iterable[str]) -> int:
        return self.inner.sweep_temporary(max_age_s, [self.prefix + validate_prefix(p) for p in prefixes])

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._key(key))
