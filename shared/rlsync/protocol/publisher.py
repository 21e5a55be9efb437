"""The publisher: the trainer's side of the bucket protocol.

``publish(step, state)`` writes an anchor or a delta (as the anchor policy
decides), then the pointer, then deletes what retention drops. Data objects are
always complete before the pointer names them, so a crash at any moment leaves
the bucket readable at the previous version.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Mapping, TypeVar

import numpy as np
import torch

from ..aliases import split_aliases
from ..bucket import Bucket
from ..codecs import DEFAULT_CODEC, get_codec
from ..detect import DEFAULT_CHUNK_ELEMENTS, ChangeDetector, PatchedState, serving_copy
from ..errors import BucketError, FormatError, SyncError
from ..format import DEFAULT_MAX_SHARD_BYTES, Change, encode_delta, write_anchor
from ..hashing import StateLanes, changes_lanes
from ..layout import ANCHOR_PREFIX, DELTA_PREFIX, POINTER_KEY, anchor_folder, delta_key
from ..limits import MAX_POINTER_BYTES
from .finite import check_finite_changes
from .lock import DEFAULT_LOCK_TTL_S, RunLock
from .manifest import MAX_CHECKPOINT_PINS, AnchorEntry, CheckpointPin, DeltaEntry, FileEntry, Manifest
from .ownership import RunOwnership
from .policy import AnchorPolicy, FixedInterval
from .retention import DEFAULT_KEEP_ANCHORS, prune, sweep_orphans
from .run import check_writable, new_run_id, read_manifest
from .subscriber import SCRATCH_PREFIX, Subscriber

logger = logging.getLogger(__name__)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _serialized(method: _Method) -> _Method:
    """Run ``method`` under the publisher's lock: a background publish and a checkpoint pin from
    another thread never interleave their reads and writes of the chain."""

    @functools.wraps(method)
    def locked(self: "Publisher", *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


@dataclasses.dataclass
class PublishRecord:
    """What one publish wrote and what it cost."""

    step: int
    kind: str
    nbytes: int
    changed: int
    total: int
    state_hash: str
    encode_s: float
    hash_s: float
    upload_s: float
    catchup_bytes: int
    keys: list[str]
    #: Changed elements per tensor name (deltas; empty for anchors).
    changed_tensors: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


class Publisher:
    """Publishes a trainer's weights to a bucket as anchors and deltas.

    Args:
        bucket: Where to publish.
        policy: When to write anchors; default an anchor every 10 publishes.
            Its settings may be changed while running.
        keep_anchors: Anchors retained (with the deltas after the oldest kept one).
        codec: Delta codec name.
        dtype: Serving dtype for floating-point tensors (``None``: as given).
        max_shard_bytes: Largest anchor shard.
        chunk_elements: Elements compared at once by change detection.
        run_id: Run name stored in the pointer (default: a fresh :func:`new_run_id` when a
            run starts; a resumed run keeps its own).
        owner: Stable id of this trainer for the run lock (a restart with the same
            id takes over at once; another id is refused while the lock is fresh).
            Default: the host name (a Space passes its ``SPACE_ID``, which survives restarts).
            See :class:`~rlsync.protocol.ownership.RunOwnership`.
        lock_ttl_s: Age after which another owner's lock may be taken over.
        allow_non_finite: Publish states that turn finite values into NaN or Inf
            (refused with :class:`NonFiniteError` by default).
        new_run: On a bucket that already holds a run which this publisher does not
            :meth:`resume`, start a new run (:meth:`start_new_run`) at the first publish
            instead of refusing with :class:`RunExistsError`.
        metadata: The chain's metadata, stored in the pointer from the first publish on
            (e.g. an adapter chain's base model, see :mod:`rlsync.adapters`); :meth:`resume`
            refuses a chain whose metadata differs.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        policy: AnchorPolicy | None = None,
        keep_anchors: int = DEFAULT_KEEP_ANCHORS,
        codec: str = DEFAULT_CODEC,
        dtype: torch.dtype | None = torch.bfloat16,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        run_id: str = "",
        owner: str | None = None,
        lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
        allow_non_finite: bool = False,
        new_run: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        get_codec(codec)
        self.metadata = dict(metadata or {})
        self.bucket = bucket
        self.policy = policy or FixedInterval()
        self.keep_anchors = keep_anchors
        self.codec = codec
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.run_id = run_id
        self.detector = ChangeDetector(dtype, chunk_elements)
        self.manifest: Manifest | None = None
        self._lanes: StateLanes | None = None  # the published state's hash, per tensor
        self.allow_non_finite = allow_non_finite
        self.refused: collections.Counter[str] = collections.Counter()  # invalid bucket objects ignored, by key
        self.ownership = RunOwnership(
            bucket, owner=owner or socket.gethostname(), lock_ttl_s=lock_ttl_s,
            new_run=new_run, refused=self.refused,
        )  # fmt: skip
        self._pointer_bytes = 0  # size of the last pointer written
        self._mutex = threading.RLock()  # see _serialized
        #: Tied names of the published state: alias -> published name (see :mod:`rlsync.aliases`).
        self.aliases: dict[str, str] = {}

    @property
    def lock(self) -> RunLock | None:
        """The run lock this publisher holds (``None`` before its first write)."""
        return self.ownership.lock

    @property
    def owner(self) -> str:
        """This trainer's run-lock owner id."""
        return self.ownership.owner

    @property
    def step(self) -> int | None:
        """The last published step, or ``None``."""
        return self.manifest.step if self.manifest else None

    @property
    def replaced_step(self) -> int | None:
        """The newest version of the run this new run replaced (``None``: not a new run over one)."""
        return self.ownership.floor

    @property
    def next_step(self) -> int:
        """The version the next publish should have: after the published one, or after the
        replaced run's newest version for a new run (version numbers never go back)."""
        if self.step is not None:
            return self.step + 1
        return 0 if self.ownership.floor is None else self.ownership.floor + 1

    @_serialized
    def start_new_run(self) -> Manifest | None:
        """Take the run lock and start a new run, replacing the bucket's run (if any) at the next publish.

        The new run gets a new run id (``run_id`` if given and different from the old one) and
        its first publish is an anchor whose version follows the old run's newest, so replicas
        see the run change, log it and re-bootstrap from that anchor. Retention then deletes the
        old run's anchors and deltas.

        Returns:
            The replaced run's pointer, or ``None`` on an empty bucket.

        Raises:
            SyncError: ``run_id`` is the old run's id.
            RunLockedError: another trainer holds the run lock.
        """
        old, self.run_id = self.ownership.start_new_run(self.run_id)
        return old

    @_serialized
    def resume(self) -> dict[str, torch.Tensor] | None:
        """Continue a run already in the bucket.

        Replays the newest chain with a :class:`~rlsync.protocol.Subscriber`,
        verifying every hash, and makes it the published state.

        Returns:
            The last published state (serving dtype), or ``None`` for an empty bucket.
        """
        self.ownership.settled = True
        self.ownership.claim()
        manifest = read_manifest(self.bucket)
        if manifest is None:
            return None
        check_writable(manifest)
        self._check_entries(manifest)
        if self.metadata and dict(manifest.metadata) != self.metadata:
            raise SyncError(
                f"{self.bucket.url} holds a chain with metadata {dict(manifest.metadata)}, not {self.metadata}: "
                "publish to a new bucket (or prefix)"
            )
        sub = Subscriber(self.bucket)
        sub.sync()
        if sub.step != manifest.step:
            manifest = read_manifest(self.bucket)  # a version landed meanwhile; not expected with one trainer
            if manifest is None or sub.step != manifest.step:
                raise SyncError("the bucket changed while resuming; is another trainer publishing?")
        self.detector.published = {n: t.clone() for n, t in sub.state.items()}
        self._lanes = sub.lanes
        self.aliases = dict(sub.aliases)
        self.manifest = manifest
        self._pointer_bytes = len(manifest.to_json())
        self.ownership.adopt(manifest)
        if not self.run_id:
            self.run_id = manifest.run_id
        logger.info("resumed at step %d (hash %s)", manifest.step, manifest.state_hash[:12])
        return {n: t.clone() for n, t in sub.state.items()}

    def _check_entries(self, manifest: Manifest) -> None:
        """Every file the pointer names, not only the newest chain the resume replays, exists with the
        size the pointer gives (retention will act on them): one listing per prefix, and a direct
        check of a key a stale listing may lack.

        Raises:
            FormatError: a named file is missing or of another size.
        """
        listed = {o.key: o.size for prefix in (ANCHOR_PREFIX, DELTA_PREFIX) for o in self.bucket.list(prefix)}
        for f in [f for a in manifest.anchors for f in a.files] + [f for d in manifest.deltas for f in d.files]:
            size = listed.get(f.key)
            if size is None and not self.bucket.exists(f.key):
                raise FormatError(f"the pointer names {f.key}, which is not in the bucket; refusing to take it over")
            if size is not None and size != f.size:
                raise FormatError(f"the pointer gives {f.key} {f.size:,} bytes, the bucket holds {size:,}; refusing to take it over")

    def heartbeat(self) -> None:
        """Refresh the run lock's heartbeat (call while training without publishing for long; it
        touches only the lock object, so it does not wait for a publish in flight)."""
        self.ownership.heartbeat()

    @_serialized
    def pin_checkpoint(self, step: int, weights_hash: str) -> None:
        """Record a training checkpoint's weights hash in the pointer (the newest
        ``MAX_CHECKPOINT_PINS`` are kept), so a restart can tell it from a planted one.

        Raises:
            SyncError: nothing is published yet.
            FencedError, BucketError: as :meth:`publish`.
        """
        if self.manifest is None:
            raise SyncError("pin_checkpoint before the first publish")
        self.ownership.claim()
        self.ownership.check_pointer(self.manifest)
        pins = tuple(p for p in self.manifest.checkpoints if p.step < step) + (CheckpointPin(step, weights_hash),)
        self._commit(dataclasses.replace(self.manifest, checkpoints=pins[-MAX_CHECKPOINT_PINS:]))

    @_serialized
    def publish(
        self, step: int, state: Mapping[str, torch.Tensor], *, release: Callable[[bool], None] | None = None
    ) -> PublishRecord:
        """Publish ``state`` as version ``step``.

        Args:
            step: The new version; must exceed the last published step.
            state: Tensors under Hugging Face names (any dtype; floating-point
                tensors are cast to the serving dtype). A tensor listed under two names
                (tied weights) is published once, under its first name; anchors record
                the other (see :mod:`rlsync.aliases`).
            release: For a staging buffer (contiguous serving-dtype tensors, as
                :class:`~rlsync.protocol.background.BackgroundPublisher` fills): called once the
                publish no longer reads ``state``, with ``True`` when it keeps ``state`` as its
                own (an anchor: the caller must not write those tensors again). A delta
                releases it right after change detection.

        Returns:
            What was written and what it cost.

        Raises:
            SyncError: ``step`` does not advance.
            RunExistsError: the bucket already holds a run this publisher did not
                :meth:`resume`, and ``new_run`` is off.
            RunLockedError: another trainer holds the run lock.
            FencedError: another trainer took the run over since this one started, or the
                pointer names a version this publisher did not write (resume() again).
            BucketError: the bucket failed; the previous version stays published
                and the publish may be retried.
        """
        state, aliases = split_aliases(state)
        anchor = self._prepare(step) or not self.detector.compatible(state) or aliases != self.aliases
        if anchor:
            if release is not None:
                release(True)
            return self._publish_anchor(step, state, owned=release is not None, aliases=aliases)
        return self._publish_delta(step, state, release)

    def _prepare(self, step: int) -> bool:
        """The checks before every publish (run, run lock, pointer, step).

        Returns:
            Whether the policy (or an empty chain) asks for an anchor.
        """
        if self.manifest is None:
            self.run_id = self.ownership.settle(self.run_id)
        self.ownership.claim()
        self.ownership.check_pointer(self.manifest)
        if step < self.next_step:
            raise SyncError(
                f"step {step} does not advance past the published step {self.next_step - 1}"
                + (" of the run this new run replaces (versions never go back; see next_step)" if self.step is None else "")
            )
        return self.manifest is None or self.policy.wants_anchor(self.manifest) or self._pointer_full()

    def _pointer_full(self) -> bool:
        """Whether the pointer passed a quarter of ``MAX_POINTER_BYTES``: then the next publish is an
        anchor (retention then drops the oldest period), whatever the policy, so readers never see a
        pointer over its limit (an adaptive policy with tiny deltas would otherwise never anchor)."""
        return self._pointer_bytes > MAX_POINTER_BYTES // 4

    @_serialized
    def publish_stream(self, step: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishRecord:
        """Publish version ``step`` from ``(name, tensor)`` pairs, comparing each as it arrives.

        For a trainer that yields its parameters one at a time (e.g. gathered from
        shards): each tensor is cast, compared with the shadow copy and hashed, then
        released, so no second copy of the model is built. Memory above the shadow
        is about one tensor plus the changed elements for a delta; an anchor (first
        publish, or as the policy decides) builds the new serving state, one shadow's
        worth. The pairs must name every published tensor once.

        Raises:
            SyncError: as :meth:`publish`; also when the pairs do not name exactly the
                published tensors with their shapes and dtypes.
            RunLockedError, FencedError, BucketError: as :meth:`publish`.
        """
        wants_anchor = self._prepare(step)
        if self.manifest is None or self.detector.published is None:
            return self._publish_anchor(step, {name: serving_copy(t, self.dtype) for name, t in tensors}, owned=True)
        t0 = time.perf_counter()
        changes: dict[str, Change] = {}
        seen: set[str] = set()
        for name, tensor in tensors:
            if name in seen:
                raise SyncError(f"{name!r} was sent twice in one publish")
            seen.add(name)
            change = self.detector.diff_tensor(name, tensor)
            if change is not None:
                changes[name] = change
            del tensor
        missing = self.detector.published.keys() - seen
        if missing:
            raise SyncError(
                f"the publish of step {step} lacks {len(missing)} published tensor(s), e.g. {sorted(missing)[0]!r}"
            )
        if not self.allow_non_finite:
            check_finite_changes(changes)
        if wants_anchor:
            return self._publish_anchor(step, PatchedState(self.detector.published, changes), owned=True)
        total = sum(t.numel() for t in self.detector.published.values())
        t1 = time.perf_counter()
        lanes = self._updated_lanes(changes)
        return self._write_delta(step, changes, lanes, total, encode_s=t1 - t0, hash_s=time.perf_counter() - t1)

    def _updated_lanes(self, changes: Mapping[str, Change]) -> StateLanes:
        """The hash of the published state with ``changes`` applied, from the changed elements alone."""
        assert self._lanes is not None
        return self._lanes.updated(lanes_of_changes(changes))

    def _publish_delta(
        self, step: int, state: Mapping[str, torch.Tensor], release: Callable[[bool], None] | None = None
    ) -> PublishRecord:
        assert self.manifest is not None
        t0 = time.perf_counter()
        changes = self.detector.diff(state)
        total = sum(t.numel() for t in state.values())
        if not self.allow_non_finite:
            check_finite_changes(changes)
        if release is not None:
            release(False)
        t1 = time.perf_counter()
        lanes = self._updated_lanes(changes)
        t2 = time.perf_counter()
        return self._write_delta(step, changes, lanes, total, encode_s=t1 - t0, hash_s=t2 - t1)

    def _write_delta(
        self, step: int, changes: dict[str, Change], lanes: StateLanes, total: int, *, encode_s: float, hash_s: float
    ) -> PublishRecord:
        """Encode and upload a delta whose changes and resulting state hash are known, then the pointer."""
        assert self.manifest is not None
        result_hash = lanes.hexdigest()
        t2 = time.perf_counter()
        data = encode_delta(
            changes,
            step=step,
            base_step=self.manifest.step,
            base_hash=self.manifest.state_hash,
            state_hash=result_hash,
            total=total,
            codec=self.codec,
        )
        t3 = time.perf_counter()
        key = delta_key(step, self.ownership.epoch)
        changed = sum(c.index.size for c in changes.values())
        entry = DeltaEntry(step, self.manifest.step, result_hash, FileEntry(key, len(data)), changed, total)
        manifest = dataclasses.replace(self.manifest, step=step, state_hash=result_hash, deltas=self.manifest.deltas + (entry,))
        self.bucket.put(key, data)
        self._commit(manifest)
        self._lanes = lanes
        self.detector.commit(changes)
        t4 = time.perf_counter()
        logger.debug("published delta %d: %d bytes, %d/%d changed (%.3f%%)", step, len(data), changed, total, 100 * changed / max(total, 1))
        return PublishRecord(
            step, "delta", len(data), changed, total, result_hash,
            encode_s=encode_s + (t3 - t2), hash_s=hash_s, upload_s=t4 - t3,
            catchup_bytes=self.manifest.catchup_bytes(), keys=[key],
            changed_tensors={name: int(c.index.size) for name, c in changes.items()},
        )  # fmt: skip

    def _publish_anchor(
        self, step: int, state: Mapping[str, torch.Tensor], owned: bool = False, aliases: Mapping[str, str] | None = None
    ) -> PublishRecord:
        """Write a full anchor; when the state continues the published one, also a companion
        delta of the same step, so that replicas keeping up never need to download anchors, unless
        that delta is no smaller than the anchor (a dense update, e.g. of a LoRA adapter): then they
        download the anchor instead.
        ``owned``: ``state`` holds contiguous serving-dtype tensors nobody else modifies, kept without a copy.
        ``aliases``: the tied names of ``state`` (``None``: those of the published state)."""
        aliases = self.aliases if aliases is None else dict(aliases)
        t0 = time.perf_counter()
        serving = dict(state) if owned else {n: serving_copy(t, self.dtype) for n, t in state.items()}
        continues = self.manifest is not None and self.detector.compatible(serving)
        changes = self.detector.diff(serving) if continues else {}
        if not self.allow_non_finite:
            check_finite_changes(changes)
        lanes = StateLanes.of(serving)
        result_hash = lanes.hexdigest()
        t1 = time.perf_counter()
        total = sum(t.numel() for t in serving.values())
        companion: tuple[DeltaEntry, ...] = ()
        data = b""
        if continues:
            assert self.manifest is not None
            data = encode_delta(
                changes, step=step, base_step=self.manifest.step, base_hash=self.manifest.state_hash,
                state_hash=result_hash, total=total, codec=self.codec,
            )  # fmt: skip
            changed = sum(c.index.size for c in changes.values())
            key = delta_key(step, self.ownership.epoch)
            companion = (DeltaEntry(step, self.manifest.step, result_hash, FileEntry(key, len(data)), changed, total),)
        folder = anchor_folder(step, self.ownership.epoch)
        with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as tmp:
            files = write_anchor(
                serving, tmp, step=step, state_hash=result_hash, max_shard_bytes=self.max_shard_bytes, aliases=aliases
            )
            t2 = time.perf_counter()
            entries = tuple(FileEntry(f"{folder}/{p.name}", p.stat().st_size) for p in files)
            if companion and len(data) >= sum(e.size for e in entries):
                logger.info("anchor %d: its delta (%d bytes) does not pay, replicas download the anchor", step, len(data))
                companion = ()
            for entry in companion:
                self.bucket.put(entry.file.key, data)
            for path, entry in zip(files, entries):
                self.bucket.put_file(entry.key, path)
        anchor = AnchorEntry(step, result_hash, entries)
        if self.manifest is None:
            self.run_id = self.run_id or new_run_id()
            manifest = Manifest(step, result_hash, (anchor,), (), run_id=self.run_id)
            manifest = Manifest(step, result_hash, (anchor,), (), run_id=self.run_id, metadata=self.metadata)
        else:
            manifest = dataclasses.replace(
                self.manifest, step=step, state_hash=result_hash,
                anchors=self.manifest.anchors + (anchor,), deltas=self.manifest.deltas + companion,
            )  # fmt: skip
        self._commit(manifest)
        t3 = time.perf_counter()
        self._lanes = lanes
        self.detector.published = serving
        self.aliases = aliases
        nbytes = sum(e.size for e in entries)
        logger.debug("published anchor %d: %d bytes in %d file(s)", step, nbytes, len(entries))
        return PublishRecord(
            step, "anchor", nbytes, total, total, result_hash,
            encode_s=t2 - t1, hash_s=t1 - t0, upload_s=t3 - t2,
            catchup_bytes=self.manifest.catchup_bytes() if self.manifest else nbytes,
            keys=[e.key for e in entries] + [c.file.key for c in companion],
        )  # fmt: skip

    def _commit(self, manifest: Manifest) -> None:
        """Write the pointer for ``manifest`` (after retention), then delete what it dropped."""
        pruned, dropped = prune(manifest, self.keep_anchors)
        self.ownership.before_commit(self.manifest, pruned)
        pointer = pruned.to_json()
        self.bucket.put(POINTER_KEY, pointer)
        self.manifest = pruned
        self._pointer_bytes = len(pointer)
        try:
            if dropped:
                self.bucket.delete(dropped)
            if len(pruned.deltas_since(pruned.newest_anchor.step)) == 0:  # after each anchor
                sweep_orphans(self.bucket, pruned)
        except BucketError as exc:  # the pointer no longer names them; the next sweep retries
            logger.warning("retention could not delete old objects: %s", exc)


def lanes_of_changes(changes: Mapping[str, Change]) -> dict[str, np.ndarray]:
    """What each tensor's changes add to its state-hash lanes (:func:`rlsync.hashing.change_lanes`).

    The indices are each change's own (a whole tensor's, or a slice's mapped to the whole tensor by
    the caller)."""
    return changes_lanes({n: (c.new_bits.itemsize, math.prod(c.shape), c.index, c.old_bits, c.new_bits) for n, c in changes.items()})
