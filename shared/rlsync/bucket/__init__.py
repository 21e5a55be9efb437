"""Bucket backends behind one interface, chosen by URL.

>>> bucket = open_bucket("./runs/demo")               # local folder
>>> bucket = open_bucket("hf://buckets/me/rl-sync")   # Hugging Face Bucket
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

from .base import (
    Bucket,
    BucketError,
    BucketWrapper,
    InvalidKeyError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectTooLargeError,
    TransientBucketError,
    validate_key,
)
from .local import LocalBucket
from .prefixed import PrefixedBucket
from .retry import RetryingBucket

__all__ = [
    "Bucket",
    "BucketError",
    "BucketWrapper",
    "HfBucket",
    "InvalidKeyError",
    "LocalBucket",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PrefixedBucket",
    "RetryingBucket",
    "TransientBucketError",
    "open_bucket",
    "register_backend",
    "validate_key",
]

if TYPE_CHECKING:
    from .hf import HfBucket


def __getattr__(name: str):
    # HfBucket is loaded on first use so that importing the package never imports huggingface_hub.
    if name == "HfBucket":
        from .hf import HfBucket

        return HfBucket
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BACKENDS: dict[str, Callable[[str], Bucket]] = {}


def register_backend(scheme: str, factory: Callable[[str], Bucket]) -> None:
    """Register ``factory(url)`` as the backend for URLs starting with ``scheme://`` (a factory with a
    ``create`` parameter is also given :func:`open_bucket`'s ``create``)."""
    _BACKENDS[scheme] = factory


def _open_local(url: str, create: bool = True) -> Bucket:
    from urllib.parse import unquote, urlparse

    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise BucketError(f"file URL with a remote host is not supported: {url}")
        return LocalBucket(unquote(parsed.path), create=create)
    return LocalBucket(url, create=create)


def _open_hf(url: str, create: bool = False) -> Bucket:
    from .hf import HfBucket

    return RetryingBucket(HfBucket.from_url(url, create=create))  # the Hub throttles (429) and has bad moments (5xx)


register_backend("file", _open_local)
register_backend("hf", _open_hf)


def open_bucket(url: str, *, create: bool = True) -> Bucket:
    """Open a bucket from a URL or path.

    Args:
        url: A local path or ``file://`` URL, or ``hf://buckets/OWNER/NAME[/PREFIX]``.
        create: Create a bucket that does not exist yet (a local folder; a Hub bucket when the token
            can write to its namespace, else a :class:`BucketError` says how to create it); ``False``
            for read-only use (a mistyped path then fails instead of creating a folder).

    Returns:
        The bucket backend for that URL.

    Raises:
        BucketError: the URL scheme has no registered backend.
    """
    if "://" not in url or url.startswith("file://"):
        return _open_local(url, create)
    scheme = url.split("://", 1)[0]
    try:
        factory = _BACKENDS[scheme]
    except KeyError:
        raise BucketError(
            f"unsupported bucket URL {url!r}: use a local path, file://PATH or hf://buckets/OWNER/NAME"
        ) from None
    if "create" in inspect.signature(factory).parameters:
        return factory(url, create=create)
    return factory(url)
