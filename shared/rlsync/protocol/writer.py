"""Writing the chain: each version's data objects (a delta, or an anchor's files and its companion
delta), then the pointer.

The :class:`~rlsync.protocol.Publisher` decides what a version is (anchor or delta) and finds its
changes and its state hash; its :class:`ChainWriter` encodes and uploads the objects, and only once
they are complete writes the pointer naming them (after retention, and after checking that the run
is still this trainer's), so a crash at any moment leaves the bucket readable at the previous
version. Keys carry the run-lock epoch, so a trainer taken over mid-upload cannot overwrite the new
trainer's files.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from typing import Mapping

import torch

from ..bucket import Bucket
from ..anchor_format import write_anchor
from ..delta_format import Change, encode_delta
from ..layout import POINTER_KEY, anchor_folder, delta_key
from ..limits import MAX_POINTER_BYTES
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest
from .ownership import RunOwnership
from .retention import delete_dropped, prune
from .run import new_run_id
from .subscriber import SCRATCH_PREFIX

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Written:
    """One version written: the pointer committed, the version's data objects, and what writing them cost."""

    manifest: Manifest
    #: The delta (or an anchor's companion delta; empty when the anchor has none).
    deltas: tuple[DeltaEntry, ...]
    anchor: AnchorEntry | None
    #: Seconds encoding the delta, or writing the anchor's files (and encoding its companion).
    encode_s: float
    #: Seconds uploading the objects and the pointer (retention's deletes included).
    upload_s: float

    @property
    def nbytes(self) -> int:
        """The version's size: its anchor's files, or its delta's."""
        return self.anchor.nbytes if self.anchor is not None else sum(d.nbytes for d in self.deltas)

    @property
    def keys(self) -> list[str]:
        """Every object written: the anchor's files, then the delta's."""
        anchor_files = self.anchor.files if self.anchor is not None else ()
        return [f.key for f in anchor_files] + [f.key for d in self.deltas for f in d.files]


class ChainWriter:
    """Writes a chain's versions: encodes and uploads their data objects, then commits the pointer.

    Args:
        bucket: Where to write.
        ownership: The run's (the keys carry its lock epoch; it fences every commit).
        codec: Delta codec name.
        max_shard_bytes: Largest anchor shard.
        keep_anchors: Anchors retained (with the deltas after the oldest kept one).
    """

    def __init__(
        self, bucket: Bucket, ownership: RunOwnership, *, codec: str, max_shard_bytes: int, keep_anchors: int
    ) -> None:
        self.bucket = bucket
        self.ownership = ownership
        self.codec = codec
        self.max_shard_bytes = max_shard_bytes
        self.keep_anchors = keep_anchors
        #: The pointer written (or adopted) last; ``None`` before the first.
        self.manifest: Manifest | None = None
        self._pointer_bytes = 0  # its size

    @property
    def pointer_full(self) -> bool:
        """Whether the pointer passed a quarter of ``MAX_POINTER_BYTES``: then the next publish is an
        anchor (retention then drops the oldest period), whatever the policy, so readers never see a
        pointer over its limit (an adaptive policy with tiny deltas would otherwise never anchor)."""
        return self._pointer_bytes > MAX_POINTER_BYTES // 4

    def adopt(self, manifest: Manifest | None) -> None:
        """Continue from ``manifest``, written by this trainer or another (a resume, or another rank's commit)."""
        self.manifest = manifest
        self._pointer_bytes = len(manifest.to_json()) if manifest is not None else 0

    def delta(self, step: int, changes: Mapping[str, Change], *, state_hash: str, total: int) -> Written:
        """Write version ``step`` as the delta of ``changes`` from the published version, then the pointer.

        Args:
            step: The new version.
            changes: Changed tensors by name.
            state_hash: The new version's state hash.
            total: Elements in the whole state.

        Raises:
            FencedError, BucketError: as :meth:`commit`; the previous version stays published.
        """
        t0 = time.perf_counter()
        data, entry = self._encode(step, changes, state_hash=state_hash, total=total)
        t1 = time.perf_counter()
        self.bucket.put(entry.file.key, data)
        manifest = self.commit_version(step, state_hash, None, (entry,))
        changed, share = entry.changed, 100 * entry.changed / max(total, 1)
        logger.debug("published delta %d: %d bytes, %d/%d changed (%.3f%%)", step, len(data), changed, total, share)
        return Written(manifest, (entry,), None, encode_s=t1 - t0, upload_s=time.perf_counter() - t1)

    def anchor(
        self, step: int, serving: Mapping[str, torch.Tensor], changes: Mapping[str, Change] | None,
        *, state_hash: str, total: int, aliases: Mapping[str, str], metadata: Mapping[str, str],
    ) -> Written:  # fmt: skip
        """Write ``serving`` as the anchor of version ``step``, then the pointer.

        With ``changes`` (a state that continues the published version), a companion delta of the same step
        is uploaded first, so that replicas keeping up never need to download anchors, unless that delta is
        no smaller than the anchor (a dense update, e.g. of a LoRA adapter): then they download the anchor.

        Args:
            serving: The whole state, serving dtype.
            changes: Its changes from the published version (``None``: no companion delta).
            aliases: The tied names of ``serving`` (see :mod:`rlsync.aliases`).
            metadata: The chain's metadata, for a run's first pointer.
            step, state_hash, total: As for :meth:`delta`.

        Raises:
            FencedError, BucketError: as :meth:`commit`; the previous version stays published.
        """
        t0 = time.perf_counter()
        companion = None
        if self.manifest is not None and changes is not None:
            companion = self._encode(step, changes, state_hash=state_hash, total=total)
        folder = anchor_folder(step, self.ownership.epoch)
        with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as tmp:
            files = write_anchor(
                serving, tmp, step=step, state_hash=state_hash, max_shard_bytes=self.max_shard_bytes, aliases=aliases
            )
            t1 = time.perf_counter()
            entries = tuple(FileEntry(f"{folder}/{p.name}", p.stat().st_size) for p in files)
            if companion is not None and len(companion[0]) >= sum(e.size for e in entries):
                logger.info("anchor %d: its delta (%d bytes) does not pay, replicas download the anchor", step, len(companion[0]))
                companion = None
            if companion is not None:
                self.bucket.put(companion[1].file.key, companion[0])
            for path, entry in zip(files, entries):
                self.bucket.put_file(entry.key, path)
        deltas = (companion[1],) if companion is not None else ()
        anchor = AnchorEntry(step, state_hash, entries)
        manifest = self.commit_version(step, state_hash, anchor, deltas, metadata=metadata)
        logger.debug("published anchor %d: %d bytes in %d file(s)", step, anchor.nbytes, len(entries))
        return Written(manifest, deltas, anchor, encode_s=t1 - t0, upload_s=time.perf_counter() - t1)

    def _encode(
        self, step: int, changes: Mapping[str, Change], *, state_hash: str, total: int
    ) -> tuple[bytes, DeltaEntry]:
        """The delta from the published version to ``step``, and its pointer entry."""
        base = self.manifest
        assert base is not None
        data = encode_delta(
            changes, step=step, base_step=base.step, base_hash=base.state_hash,
            state_hash=state_hash, total=total, codec=self.codec,
        )  # fmt: skip
        changed = sum(c.index.size for c in changes.values())
        file = FileEntry(delta_key(step, self.ownership.epoch), len(data))
        return data, DeltaEntry(step, base.step, state_hash, file, changed, total)

    def commit_version(
        self, step: int, state_hash: str, anchor: AnchorEntry | None, deltas: tuple[DeltaEntry, ...],
        *, metadata: Mapping[str, str] | None = None,
    ) -> Manifest:  # fmt: skip
        """Commit the pointer naming version ``step`` too, once its objects are uploaded: the published one
        with its anchor (if any) and delta(s) added, or a run's first pointer (an anchor) under the run's id
        and ``metadata``; as :meth:`commit`."""
        if self.manifest is None:
            assert anchor is not None and not deltas
            self.ownership.run_id = self.ownership.run_id or new_run_id()
            run_id = self.ownership.run_id
            return self.commit(Manifest(step, state_hash, (anchor,), (), run_id=run_id, metadata=dict(metadata or {})))
        anchors = self.manifest.anchors + ((anchor,) if anchor is not None else ())
        deltas = self.manifest.deltas + deltas
        manifest = dataclasses.replace(self.manifest, step=step, state_hash=state_hash, anchors=anchors, deltas=deltas)
        return self.commit(manifest)

    def commit(self, manifest: Manifest) -> Manifest:
        """Write the pointer for ``manifest`` after retention, then delete what retention dropped.

        Returns:
            The pointer written (``manifest`` pruned).

        Raises:
            FencedError: the run lock was taken over (see :meth:`RunOwnership.before_commit`).
            BucketError: the pointer could not be written; the previous version stays published.
        """
        pruned, dropped = prune(manifest, self.keep_anchors)
        self.ownership.before_commit(self.manifest, pruned)
        pointer = pruned.to_json()
        self.bucket.put(POINTER_KEY, pointer)
        self.manifest = pruned
        self._pointer_bytes = len(pointer)
        delete_dropped(self.bucket, pruned, dropped)
        return pruned
