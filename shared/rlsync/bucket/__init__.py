"""Bucket backends behind one interface, chosen by URL.

>>> bucket = open_bucket("./runs/demo")               # local folder
>>> bucket = open_bucket("hf://buckets/me/rl-sync")   # Hugging Face Bucket
>>> bucket = open_bucket(url, settings=BucketSettings.from_env(Role.ROLLOUT))  # at an entry point
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

from ..errors import BucketError, InvalidKeyError, ObjectNotFoundError, ObjectTooLargeError, TransientBucketError
from .base import Bucket, BucketWrapper, ObjectInfo, validate_key
from .local import LocalBucket
from .prefixed import PrefixedBucket
from .retry import RetryingBucket

__all__ = [
    "Bucket",
    "BucketError",
    "BucketSettings",
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
    from .settings import BucketSettings


def __getattr__(name: str):
    # HfBucket and BucketSettings are loaded on first use so that importing the package never imports
    # huggingface_hub or its HTTP client.
    if name == "HfBucket":
        from .hf import HfBucket

        return HfBucket
    if name == "BucketSettings":
        from .settings import BucketSettings

        return BucketSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BACKENDS: dict[str, Callable[[str], Bucket]] = {}


def register_backend(scheme: str, factory: Callable[[str], Bucket]) -> None:
    """Register ``factory(url)`` as the backend for URLs starting with ``scheme://`` (a factory with a
    ``create`` or ``settings`` parameter is also given :func:`open_bucket`'s)."""
    _BACKENDS[scheme] = factory


def _open_local(url: str, create: bool = True) -> Bucket:
    from urllib.parse import unquote, urlparse

    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise BucketError(f"file URL with a remote host is not supported: {url}")
        return LocalBucket(unquote(parsed.path), create=create)
    return LocalBucket(url, create=create)


def _open_hf(url: str, create: bool = False, settings: BucketSettings | None = None) -> Bucket:
    from .hf import HfBucket

    options = {} if settings is None else {"transfer": settings.transfer, "meter": settings.meter()}
    hub = HfBucket.from_url(url, create=create, **options)
    return RetryingBucket(hub)  # the Hub throttles (429) and has bad moments (5xx)


register_backend("file", _open_local)
register_backend("hf", _open_hf)


def open_bucket(url: str, *, create: bool = True, settings: BucketSettings | None = None) -> Bucket:
    """Open a bucket from a URL or path.

    Args:
        url: A local path or ``file://`` URL, or ``hf://buckets/OWNER/NAME[/PREFIX]``.
        create: Create a bucket that does not exist yet (a local folder; a Hub bucket when the token
            can write to its namespace, else a :class:`BucketError` says how to create it); ``False``
            for read-only use (a mistyped path then fails instead of creating a folder).
        settings: A Hub bucket's timeouts and request budget (default: ``BucketSettings()``, the
            library defaults; entry points pass :meth:`BucketSettings.from_env`). Local folders have none.

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
    accepted = inspect.signature(factory).parameters
    options = {"create": create, "settings": settings}
    return factory(url, **{name: value for name, value in options.items() if name in accepted})
