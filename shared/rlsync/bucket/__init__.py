"""Bucket backends behind one interface, chosen by URL.

>>> bucket = open_bucket("./runs/demo")               # local folder
>>> bucket = open_bucket("hf://buckets/me/rl-sync")   # Hugging Face Bucket
>>> bucket = open_bucket("s3://my-bucket/run", settings=S3Settings(endpoint_url="http://127.0.0.1:9000"))  # S3, MinIO
>>> bucket = open_bucket(url, settings=BucketSettings.from_env(Role.ROLLOUT))  # at an entry point
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import (
    BucketError,
    InvalidKeyError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    TransientBucketError,
    UnknownNameError,
)
from ..registry import Kind, get, names
from .base import Bucket, BucketWrapper, Capability, ObjectInfo, backend_of, validate_key
from .local import LocalBucket
from .prefixed import PrefixedBucket
from .retry import RetryingBucket

__all__ = [
    "Bucket",
    "BucketError",
    "BucketSettings",
    "BucketWrapper",
    "Capability",
    "HfBucket",
    "InvalidKeyError",
    "LocalBucket",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PrefixedBucket",
    "RetryingBucket",
    "TransientBucketError",
    "backend_of",
    "open_bucket",
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


def open_bucket(url: str, *, create: bool = True, settings: Any = None) -> Bucket:
    """Open a bucket from a URL or path, with the backend registered for its scheme
    (:mod:`rlsync.registry`, ``Kind.BUCKET``; a path without a scheme is a local folder).

    Args:
        url: A local path or ``file://`` URL, ``hf://buckets/OWNER/NAME[/PREFIX]``, ``s3://BUCKET[/PREFIX]``, or
            another registered scheme.
        create: Create a bucket that does not exist yet (a local folder; a Hub bucket when the token
            can write to its namespace, else a :class:`BucketError` says how to create it); ``False``
            for read-only use (a mistyped path then fails instead of creating a folder).
        settings: The backend's settings (its entry's settings class, e.g. the Hub's ``BucketSettings``:
            timeouts and request budget; entry points pass ``from_env``). Given settings of another backend's
            class (an entry point's Hub settings, for an ``s3://`` URL), the backend's own are read from its
            variables instead (``<env_prefix>_<FIELD>``, e.g. ``S3_ENDPOINT_URL``); ``None``: the backend's
            defaults.

    Returns:
        The bucket backend for that URL.

    Raises:
        BucketError: the URL scheme has no registered backend.
    """
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    try:
        entry = get(Kind.BUCKET, scheme)
    except UnknownNameError:
        known = ", ".join(f"{name}://" for name in names(Kind.BUCKET))
        raise BucketError(f"unsupported bucket URL {url!r}: use a local path or one of {known}") from None
    cls = entry.settings_class()
    if cls is None or settings is None:
        own = None
    else:
        own = settings if isinstance(settings, cls) else entry.read_settings()
    return entry.load()(url, create=create, settings=own)
