"""A run in the bucket: reading its pointer, its identity, and the checks before publishing over it or
taking it over."""

from __future__ import annotations

import collections
import logging
import secrets
import time
from typing import Mapping

from ..bucket import Bucket
from ..errors import FormatError, ObjectNotFoundError, ObjectTooLargeError, RunExistsError, SyncError
from ..format import FORMAT_VERSION
from ..layout import ANCHOR_FILE, ANCHOR_PREFIX, DELTA_FILE, DELTA_PREFIX, MAX_BASE_EPOCH, MAX_BASE_STEP, POINTER_KEY
from ..limits import MAX_POINTER_BYTES
from .manifest import Manifest

logger = logging.getLogger(__name__)

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


def highest_epoch(bucket: Bucket, refused: collections.Counter[str] | None = None) -> int:
    """The highest run-lock epoch the pointer's files were written under (0 without a readable pointer),
    so that a trainer taking a run whose lock object was deleted never reuses a writer's epoch. Epochs
    above :data:`~rlsync.layout.MAX_BASE_EPOCH` leave no room: they are left out, and the pointer counted
    in ``refused``."""
    try:
        manifest = read_manifest(bucket)
    except FormatError:
        return 0
    epochs = manifest.epochs() if manifest else set()
    roomy = [epoch for epoch in epochs if epoch <= MAX_BASE_EPOCH]
    if len(roomy) < len(epochs):
        _refuse(POINTER_KEY, f"run-lock epoch {max(epochs)} leaves no room (above {MAX_BASE_EPOCH})", refused)
    return max(roomy, default=0)


def base_step(bucket: Bucket, manifest: Manifest, refused: collections.Counter[str] | None = None) -> int | None:
    """The version a new run's versions follow: the replaced run's newest, ``manifest.step``. A step above
    :data:`~rlsync.layout.MAX_BASE_STEP` leaves no room: the pointer is counted in ``refused`` and the
    newest such step the bucket's anchor and delta keys hold is taken instead (the version replicas may
    hold; ``None`` for none)."""
    if manifest.step <= MAX_BASE_STEP:
        return manifest.step
    _refuse(POINTER_KEY, f"version {manifest.step} leaves no room (above {MAX_BASE_STEP})", refused)
    keys = (o.key for prefix in (ANCHOR_PREFIX, DELTA_PREFIX) for o in bucket.list(prefix))
    steps = (int(m.group(1)) for m in (ANCHOR_FILE.fullmatch(k) or DELTA_FILE.fullmatch(k) for k in keys) if m)
    return max((step for step in steps if step <= MAX_BASE_STEP), default=None)


def _refuse(key: str, reason: str, refused: collections.Counter[str] | None) -> None:
    logger.warning("refusing %s: %s", key, reason)
    if refused is not None:
        refused[key] += 1


def check_takeover(bucket: Bucket, manifest: Manifest, metadata: Mapping[str, str]) -> None:
    """Refuse to take over (resume) the run at ``manifest`` unless every file the pointer names, not only
    the newest chain a resume replays, exists with the size the pointer gives (retention will act on them),
    and the chain's metadata is ``metadata`` (when given). One listing per prefix, and a direct check of a
    key a stale listing may lack.

    Raises:
        FormatError: a named file is missing or of another size.
        SyncError: the chain's metadata differs.
    """
    listed = {o.key: o.size for prefix in (ANCHOR_PREFIX, DELTA_PREFIX) for o in bucket.list(prefix)}
    for f in [f for a in manifest.anchors for f in a.files] + [f for d in manifest.deltas for f in d.files]:
        size = listed.get(f.key)
        if size is None and not bucket.exists(f.key):
            raise FormatError(f"the pointer names {f.key}, which is not in the bucket; refusing to take it over")
        if size is not None and size != f.size:
            raise FormatError(f"the pointer gives {f.key} {f.size:,} bytes, the bucket holds {size:,}; refusing to take it over")
    if metadata and dict(manifest.metadata) != dict(metadata):
        raise SyncError(
            f"{bucket.url} holds a chain with metadata {dict(manifest.metadata)}, not {dict(metadata)}: "
            "publish to a new bucket (or prefix)"
        )
