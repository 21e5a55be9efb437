"""A run in the bucket: reading its pointer, its identity, and the refusal to publish over it."""

from __future__ import annotations

import secrets
import time

from ..bucket import Bucket
from ..errors import FormatError, ObjectNotFoundError, ObjectTooLargeError, RunExistsError, SyncError
from ..format import FORMAT_VERSION
from ..layout import POINTER_KEY
from ..limits import MAX_POINTER_BYTES
from .manifest import Manifest

#: How a :class:`Publisher` user goes on from a :class:`RunExistsError`.
PUBLISHER_WAYS_ON = (
    "continue it with resume() (when the trainer restored a checkpoint of that run), "
    "or start a new run explicitly with Publisher(..., new_run=True)"
)


def run_exists_error(bucket: Bucket, manifest: Manifest, ways_on: str = PUBLISHER_WAYS_ON) -> RunExistsError:
    """The refusal to publish over a run without continuing it, naming the ways on.

    Args:
        bucket: The bucket holding the run.
        manifest: Its pointer.
        ways_on: What the caller can do instead (the API it was reached through).
    """
    return RunExistsError(
        f"{bucket.url} already holds run {manifest.run_id or '(unnamed)'!r} at version {manifest.step}, and this "
        f"trainer has no checkpoint of it to continue from: publishing its weights would silently replace the run's. "
        f"Either {ways_on}; replicas then re-bootstrap from the new run's first anchor"
    )


def new_run_id() -> str:
    """A fresh run id: UTC start time and 8 random hex digits."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def read_manifest(bucket: Bucket, *, uncached: bool = False) -> Manifest | None:
    """The bucket's pointer object, or ``None`` before the first publish.

    Args:
        bucket: The bucket.
        uncached: Read the bucket itself, never a watched bucket's cache (the check before a publish).

    Raises:
        FormatError: the pointer exists but is invalid.
    """
    try:
        read = bucket.get_uncached if uncached else bucket.get_limited
        data = read(POINTER_KEY, MAX_POINTER_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectTooLargeError as exc:
        raise FormatError(str(exc)) from None
    return Manifest.from_json(data)


def check_writable(manifest: Manifest) -> None:
    """Refuse to extend a chain written in an older format version (its hashes are another kind).

    Raises:
        SyncError: the pointer's format version is not the current one.
    """
    if manifest.format_version != FORMAT_VERSION:
        raise SyncError(
            f"the bucket holds a format version {manifest.format_version} chain; this publisher writes version "
            f"{FORMAT_VERSION} (another state hash): publish to a new bucket"
        )
