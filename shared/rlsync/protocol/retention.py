"""Retention: keep the last K anchors and the deltas after the oldest kept one."""

from __future__ import annotations

import dataclasses
import logging

from ..bucket import Bucket
from ..errors import BucketError
from ..layout import ANCHOR_PREFIX, DELTA_PREFIX, POINTER_KEY
from .manifest import Manifest

logger = logging.getLogger(__name__)

DEFAULT_KEEP_ANCHORS = 2


def prune(manifest: Manifest, keep_anchors: int = DEFAULT_KEEP_ANCHORS) -> tuple[Manifest, list[str]]:
    """Drop versions older than the ``keep_anchors``-th newest anchor.

    Args:
        manifest: The manifest about to be published.
        keep_anchors: Anchors to keep (at least 1).

    Returns:
        The pruned manifest and the object keys that may be deleted once it is published.
    """
    if keep_anchors < 1:
        raise ValueError(f"keep_anchors must be at least 1, got {keep_anchors}")
    kept = manifest.anchors[-keep_anchors:]
    oldest = kept[0].step
    dropped = [f.key for a in manifest.anchors[:-keep_anchors] for f in a.files]
    dropped += [f.key for d in manifest.deltas if d.step <= oldest for f in d.files]
    pruned = dataclasses.replace(
        manifest,
        anchors=tuple(kept),
        deltas=tuple(d for d in manifest.deltas if d.step > oldest),
    )
    return pruned, dropped


def delete_dropped(bucket: Bucket, published: Manifest, dropped: list[str]) -> None:
    """Once the pointer for ``published`` is written: delete the objects its pruning ``dropped`` and, after
    each anchor, sweep orphans. A failure is logged, not raised: the pointer no longer names them, and
    the next sweep retries."""
    try:
        if dropped:
            bucket.delete(dropped)
        if len(published.deltas_since(published.newest_anchor.step)) == 0:  # after each anchor
            sweep_orphans(bucket, published)
    except BucketError as exc:
        logger.warning("retention could not delete old objects: %s", exc)


TMP_MAX_AGE_S = 6 * 3600.0


def sweep_orphans(bucket: Bucket, manifest: Manifest) -> list[str]:
    """Delete anchor and delta objects older than the oldest retained version that
    the manifest does not name (left by failed deletes or crashed publishes), and
    temporary files of killed writers older than ``TMP_MAX_AGE_S`` where the publisher
    writes: under ``anchors/``, ``deltas/`` and beside the pointer and the lock (never
    elsewhere in the bucket).

    Objects newer than the manifest's oldest version are left alone: they may
    belong to a publish in progress.

    Returns:
        The deleted keys.
    """
    named = {f.key for a in manifest.anchors for f in a.files} | {f.key for d in manifest.deltas for f in d.files}
    oldest = manifest.anchors[0].step
    stale = [
        obj.key
        for prefix in (ANCHOR_PREFIX, DELTA_PREFIX)
        for obj in bucket.list(prefix)
        if obj.key not in named and _step_of(obj.key) is not None and _step_of(obj.key) < oldest
    ]
    if stale:
        bucket.delete(stale)
    bucket.sweep_temporary(TMP_MAX_AGE_S, (ANCHOR_PREFIX, DELTA_PREFIX, POINTER_KEY))
    return stale


def _step_of(key: str) -> int | None:
    """The step in ``anchors/<step>-e<epoch>/...`` or ``deltas/<step>-e<epoch>...``; ``None`` for other names."""
    parts = key.split("/")
    name = parts[1].split("-")[0].split(".")[0] if len(parts) > 1 else ""
    return int(name) if name.isdigit() else None
