"""Sharded publish: every rank of a ``torch.distributed`` trainer publishes its own slices.

Each rank of an FSDP2 trainer calls :meth:`ShardedPublisher.publish` with its
state dict (DTensor parameters; see :mod:`rlsync.shards`). A publish runs in
four rounds (:func:`~rlsync.protocol.collective.collective_round`); in each, every
rank does its own work and sends a small record to rank 0, which answers with one
broadcast (an error anywhere stops every rank in the same round, so no rank waits
forever on a failed peer):

1. *plan*: each rank takes its slices; rank 0 checks the run lock and the
   pointer and decides anchor or delta;
2. *detect*: each rank compares its slices with its own shadow (the last
   published bits of its slices only); rank 0 unites the changed tensors' names;
3. *hash*: each rank sends rank 0 what its slices add to each tensor's state-hash
   lanes (:mod:`rlsync.hashing`: 16 bytes per tensor): at a delta, what its changed
   elements add (old and new bits); at an anchor, the sum over its slices. The lanes
   are sums, so rank 0 adds the ranks' parts and gets the state hash, identical to a
   single-process publisher's whatever the sharding;
4. *write and commit*: each rank encodes and uploads its own delta part
   (positions in the full tensors' flat coordinates) and reports its key and
   size; once every part is confirmed, rank 0 writes the pointer naming all
   parts, then every rank updates its shadow.

An anchor is a Hugging Face-style sharded checkpoint of whole tensors, written
without gathering: each tensor has one owner rank (:func:`rlsync.shards.assign_owners`,
balanced by bytes), every rank sends its slices straight to their owners
(point-to-point, :func:`~rlsync.protocol.collective.gather_owned`), each owner
writes ``model-0000k-of-0000n.safetensors`` with the whole tensors it owns, and
once every file is confirmed rank 0 uploads
``model.safetensors.index.json`` and the pointer. Replicas read it as any
sharded anchor (:func:`rlsync.anchor_format.load_anchor`).

A sharded trainer's process group is destroyed at interpreter exit, if its script has not done
so (:func:`destroy_process_group_at_exit`): a gloo group still alive when the interpreter tears
down aborts the process ("terminate called without an active exception", SIGABRT) when its
worker threads release work holding Python objects.

No rank ever holds more than its own slices and, during an anchor, the tensors
it owns. A rank that dies mid-publish makes the others' collectives fail
before the pointer is written, so the bucket stays at the previous version.
Files carry the run-lock epoch in their keys, so a trainer taken over
mid-upload cannot overwrite the new trainer's files.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..detect import cast_chunk, serving_copy, serving_dtype_of
from ..anchor_format import INDEX_FILE, anchor_index, anchor_metadata, shard_names, write_anchor_shard
from ..delta_format import Change, encode_delta
from ..hashing import StateLanes, add_lanes, slice_lanes, structure_digest
from ..layout import anchor_folder, delta_part_key
from ..shards import LocalSlice, local_slices
from .collective import collective_round, gather_owned
from .finite import check_finite_changes
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest
from .published import lanes_of_changes
from .publisher import Publisher, PublishRecord
from .publisher_run import _serialized
from .subscriber import SCRATCH_PREFIX

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Plan:
    kind: str
    epoch: int
    companion: bool  # an anchor that continues the published state also gets a delta


class ShardedPublisher(Publisher):
    """The :class:`Publisher` of a sharded trainer: call it on every rank with the same arguments.

    Args:
        bucket: Where to publish (every rank needs write access).
        group: The process group of the trainer (default: the world).
        **kwargs: As for :class:`Publisher`; ``max_shard_bytes`` is not used
            (each owner rank writes one anchor file).
    """

    def __init__(self, bucket, *, group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(bucket, **kwargs)
        destroy_process_group_at_exit()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._shadow_valid = False
        self._next_lanes: StateLanes | None = None  # rank 0: the state hash of the publish in flight

    # -- resume -------------------------------------------------------------

    def resume(self) -> None:  # type: ignore[override]
        """Continue a run already in the bucket without replaying it.

        Rank 0 takes the run lock and adopts the pointer (:meth:`RunOwnership.open_run`); no rank
        rebuilds its shadow, so the next publish writes an anchor (which needs none).
        """
        self.ownership.settled = True

        def adopt(_: list[Any]) -> bytes | None:
            opened = self.ownership.open_run()
            return opened.to_json() if opened else None

        data = collective_round(self.group, lambda: None, adopt)
        manifest = Manifest.from_json(data) if data else None
        self.writer.adopt(manifest)
        self._shadow_valid = False
        self.detector.published = None
        self.ownership.adopt(manifest)

    # -- publish ------------------------------------------------------------

    @_serialized  # a checkpoint pin from the trainer's thread waits for a background publish
    def publish(self, step: int, state: Mapping[str, torch.Tensor]) -> PublishRecord:
        """Publish this rank's slices of ``state`` as part of version ``step`` (collective).

        Args:
            step: The new version, the same on every rank.
            state: This rank's state dict: DTensors (e.g. FSDP2 parameters, ``Shard(0)``
                or ``Replicate``) or plain tensors (taken from rank 0).

        Returns:
            What was written (whole-publish sizes; this rank's timings).

        Raises:
            As :meth:`Publisher.publish`, on every rank; :class:`ShardedPublishError`
            when another rank failed.
        """
        return self._publish_slices(step, state)

    def _publish_slices(self, step: int, state: Mapping[str, torch.Tensor]) -> PublishRecord:
        # Every step that can fail runs inside a round, so a failing rank never leaves the others waiting.
        t0 = time.perf_counter()
        shapes = {name: tuple(t.shape) for name, t in state.items()}
        total = sum(torch.Size(s).numel() for s in shapes.values())
        slices: dict[str, LocalSlice] = {}
        changes: dict[str, Change] = {}

        def take_slices() -> bool:
            slices.update(local_slices(state, self.rank))
            return self._shadow_valid and self.detector.compatible({n: s.data for n, s in slices.items()})

        plan: _Plan = collective_round(self.group, take_slices, lambda flags: self._plan(step, all(flags)))

        def detect() -> list[str]:
            if plan.kind == "delta" or plan.companion:
                changes.update(self.detector.diff({n: s.data for n, s in slices.items()}))
            check_finite_changes(changes, allowed=self.allow_non_finite)  # inside the round: every rank refuses together
            return sorted(changes)

        # every rank detects (and refuses) together
        collective_round(self.group, detect, lambda names: set().union(*names))
        t1 = time.perf_counter()
        result_hash = self._hash_slices(slices, changes, plan.kind, state)
        owners: dict[str, int] = {}
        owned: dict[str, torch.Tensor] = {}
        if plan.kind == "anchor":
            owners, owned = gather_owned(self.group, slices, state, self.dtype)
        t2 = time.perf_counter()
        write = lambda: self._write_part(step, plan, slices, changes, owners, owned, result_hash, total)  # noqa: E731
        commit = lambda parts: self._commit_parts(step, plan, parts, owners, result_hash, total)  # noqa: E731
        manifest_json = collective_round(self.group, write, commit)
        owned.clear()
        self.writer.adopt(Manifest.from_json(manifest_json))
        self._lanes, self._next_lanes = self._next_lanes, None  # rank 0's; None elsewhere
        if plan.kind == "anchor":
            self.detector.published = {n: serving_copy(s.data, self.dtype) for n, s in slices.items()}
            self._shadow_valid = True
        else:
            self.detector.commit(changes)
        t3 = time.perf_counter()
        manifest = self.manifest
        assert manifest is not None
        entry = manifest.deltas[-1] if plan.kind == "delta" else manifest.anchors[-1]
        changed = entry.changed if isinstance(entry, DeltaEntry) else total
        keys = [f.key for f in entry.files]
        logger.info("rank %d: published %s %d (%d parts)", self.rank, plan.kind, step, len(keys))
        return PublishRecord(
            step, plan.kind, entry.nbytes, changed, total, result_hash,
            encode_s=t1 - t0, hash_s=t2 - t1, upload_s=t3 - t2,
            catchup_bytes=manifest.catchup_bytes(), keys=keys,
        )  # fmt: skip

    def _plan(self, step: int, all_compatible: bool) -> _Plan:
        """Rank 0: the checks of :meth:`Publisher.publish`, then anchor or delta."""
        anchor = self._prepare(step) or not all_compatible
        return _Plan("anchor" if anchor else "delta", self.ownership.epoch, anchor and self.manifest is not None and all_compatible)

    def _hash_slices(
        self, slices: Mapping[str, LocalSlice], changes: Mapping[str, Change], kind: str, state: Mapping[str, torch.Tensor]
    ) -> str:
        """The new state hash, on every rank. Each rank sends rank 0 what its slices add to each
        tensor's lanes (an anchor: all their elements; a delta: its changed elements' new minus old
        bits); rank 0 adds the parts (to the published lanes, for a delta) and keeps the result for
        after the commit."""

        def parts() -> dict[str, Any]:
            if kind == "anchor":
                return {n: slice_lanes(n, cast_chunk(s.data, self.dtype), s.offset, s.numel) for n, s in slices.items()}
            return lanes_of_changes({n: _to_global(c, slices[n]) for n, c in changes.items()})

        def combine(ranks: list[dict[str, Any]]) -> str:
            names = sorted({n for part in ranks for n in part})
            summed = {n: add_lanes(part[n] for part in ranks if n in part) for n in names}
            if kind == "anchor":
                schema = {n: (serving_dtype_of(t, self.dtype), tuple(t.shape)) for n, t in state.items()}
                self._next_lanes = StateLanes(structure_digest(schema), summed)
            else:
                assert self._lanes is not None
                self._next_lanes = self._lanes.updated(summed)
            return self._next_lanes.hexdigest()

        return collective_round(self.group, parts, combine)

    def _write_part(
        self, step: int, plan: _Plan, slices: Mapping[str, LocalSlice], changes: Mapping[str, Change],
        owners: Mapping[str, int], owned: Mapping[str, torch.Tensor], result_hash: str, total: int,
    ) -> dict[str, Any]:  # fmt: skip
        """Encode and upload this rank's delta part (positions in global coordinates) and, at an anchor,
        its anchor file (the whole tensors it owns); return their keys and sizes."""
        report: dict[str, Any] = {"changed": sum(c.index.size for c in changes.values())}
        if plan.kind == "delta" or plan.companion:
            assert self.manifest is not None
            data = encode_delta(
                {n: _to_global(c, slices[n]) for n, c in changes.items()}, step=step, base_step=self.manifest.step, base_hash=self.manifest.state_hash,
                state_hash=result_hash, total=total, codec=self.writer.codec,
                extra_metadata={"part": str(self.rank), "parts": str(self.world)},
            )  # fmt: skip
            key = delta_part_key(step, plan.epoch, self.rank, self.world)
            self.bucket.put(key, data)
            report["delta"] = FileEntry(key, len(data))
        if owned:
            name = _anchor_file_names(owners)[self.rank]
            key = f"{anchor_folder(step, plan.epoch)}/{name}"
            metadata = anchor_metadata(step=step, state_hash=result_hash, total=total)
            with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as tmp:
                path = write_anchor_shard(owned, Path(tmp) / name, metadata=metadata)
                self.bucket.put_file(key, path)
                report["anchor"] = FileEntry(key, path.stat().st_size)
        return report

    def _commit_parts(
        self, step: int, plan: _Plan, parts: list[dict[str, Any]], owners: Mapping[str, int], result_hash: str,
        total: int,
    ) -> bytes:  # fmt: skip
        """Rank 0: every part is confirmed; write the anchor's index (if sharded), then the pointer naming them all."""
        changed = sum(p["changed"] for p in parts)
        deltas: tuple[DeltaEntry, ...] = ()
        if "delta" in parts[0]:
            assert self.manifest is not None
            files = [p["delta"] for p in parts]
            deltas = (DeltaEntry(step, self.manifest.step, result_hash, files[0], changed, total, tuple(files[1:])),)
        if plan.kind == "anchor":
            files = [p["anchor"] for p in parts if "anchor" in p]  # in rank order: the shard files' order
            if len(files) > 1:
                names = _anchor_file_names(owners)
                metadata = anchor_metadata(step=step, state_hash=result_hash, total=total)
                weight_map = {n: names[r] for n, r in owners.items()}
                index = anchor_index(weight_map, metadata, total_size=sum(f.size for f in files))
                key = f"{anchor_folder(step, plan.epoch)}/{INDEX_FILE}"
                self.bucket.put(key, index)
                files.append(FileEntry(key, len(index)))
            anchor: AnchorEntry | None = AnchorEntry(step, result_hash, tuple(files))
        else:
            anchor = None
        return self.writer.commit_version(step, result_hash, anchor, deltas, metadata=self.metadata).to_json()


@functools.lru_cache(maxsize=1)
def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit unless the script did (registered once).

    ``atexit`` handlers run while the interpreter is whole (after non-daemon threads are joined,
    before modules are torn down); a gloo group left alive until then aborts the process when its
    worker threads free work that holds Python objects (pytorch/pytorch#190489), as a rank of a
    sharded TRL run did under load. Destroying it there needs no other rank.
    """
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _anchor_file_names(owners: Mapping[str, int]) -> dict[int, str]:
    """Owner rank -> its anchor file's name: the ranks that own tensors, in order, named as Hugging Face shards."""
    writers = sorted(set(owners.values()))
    return dict(zip(writers, shard_names(len(writers))))


def _to_global(change: Change, s: LocalSlice) -> Change:
    """A change found in a local slice, in the full tensor's flat coordinates.

    Without its base: a context codec's coding order derives from the whole old tensor, which a rank
    does not hold, so a part is coded in flat order (``classrice`` then codes one class of all elements).
    """
    return dataclasses.replace(change, index=change.index + s.offset, shape=s.shape, base=None)
