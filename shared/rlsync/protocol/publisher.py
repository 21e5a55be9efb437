"""The publisher: the trainer's side of the bucket protocol.

``publish(step, state)`` writes an anchor or a delta (as the anchor policy
decides), then the pointer, then deletes what retention drops. Data objects are
always complete before the pointer names them, so a crash at any moment leaves
the bucket readable at the previous version. Writing a version is its
:class:`~rlsync.protocol.writer.ChainWriter`'s job; the run's lifecycle (lock,
fencing, new runs, resume, checkpoint pins) its :class:`~rlsync.protocol.ownership.RunOwnership`'s.
Its two bases: :class:`~rlsync.protocol.publisher_run.PublisherRun` holds those two and the checks
before each publish; :class:`~rlsync.protocol.published.PublishedState` the published state, a
version's changes and its hash.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable, Mapping

import torch

from ..aliases import split_aliases
from ..bucket import Bucket
from ..codecs import DEFAULT_CODEC, get_codec
from ..detect import DEFAULT_CHUNK_ELEMENTS, PatchedState, serving_copy
from ..anchor_format import DEFAULT_MAX_SHARD_BYTES
from ..delta_format import Change
from .lock import DEFAULT_LOCK_TTL_S
from .policy import AnchorPolicy
from .published import PublishedState
from .publisher_run import PublisherRun, _serialized
from .retention import DEFAULT_KEEP_ANCHORS

logger = logging.getLogger(__name__)


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


class Publisher(PublisherRun, PublishedState):
    """Publishes a trainer's weights to a bucket as anchors and deltas.

    It decides each version (anchor or delta). Its base :class:`~rlsync.protocol.published.PublishedState`
    finds the version's changes and state hash and keeps the published state; its :attr:`writer`
    (:class:`~rlsync.protocol.writer.ChainWriter`) encodes and uploads the version, then commits the pointer.
    The run lock, fencing, the run's identity, new runs, resume and checkpoint pins are its :attr:`ownership`'s
    (:class:`~rlsync.protocol.ownership.RunOwnership`: ``ownership.lock``, ``ownership.owner``); both are
    built by its base :class:`~rlsync.protocol.publisher_run.PublisherRun`, with the run's calls
    (:meth:`heartbeat`, :meth:`start_new_run`, :meth:`pin_checkpoint`) and the checks before each publish.

    Args:
        bucket: Where to publish.
        policy: When to write anchors; default an anchor every 10 publishes. Its settings may be changed
            while running.
        keep_anchors: Anchors retained (with the deltas after the oldest kept one).
        codec: Delta codec name.
        max_shard_bytes: Largest anchor shard.
        dtype, chunk_elements, allow_non_finite: The serving dtype, change detection's chunk and the refusal of
            non-finite values: see :class:`~rlsync.protocol.published.PublishedState`.
        run_id, owner, lock_ttl_s: The run's name in the pointer, this trainer's stable id for the run
            lock (default: the host name; a Space passes its ``SPACE_ID``, which survives restarts) and
            the lock's takeover age: see :class:`~rlsync.protocol.ownership.RunOwnership`.
        new_run: On a bucket that already holds a run which this publisher does not :meth:`resume`,
            start a new run (:meth:`start_new_run`) at the first publish instead of refusing with
            :class:`RunExistsError`.
        metadata: The chain's metadata, stored in the pointer from the first publish on (e.g. an adapter
            chain's base model, see :mod:`rlsync.adapters`); :meth:`resume` refuses a chain whose
            metadata differs.
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
        PublishedState.__init__(self, dtype=dtype, chunk_elements=chunk_elements, allow_non_finite=allow_non_finite)
        self.metadata = dict(metadata or {})
        PublisherRun.__init__(
            self, bucket, policy=policy, keep_anchors=keep_anchors, codec=codec, max_shard_bytes=max_shard_bytes,
            run_id=run_id, owner=owner, lock_ttl_s=lock_ttl_s, new_run=new_run,
        )  # fmt: skip

    @_serialized
    def resume(self) -> dict[str, torch.Tensor] | None:
        """Continue a run already in the bucket (:meth:`RunOwnership.resume`): its newest chain, replayed
        and verified, becomes the published state.

        Returns:
            The last published state (serving dtype), or ``None`` for an empty bucket.
        """
        resumed = self.ownership.resume(self.metadata)
        if resumed is None:
            return None
        manifest, sub = resumed
        self.writer.adopt(manifest)
        self.take_anchor({n: t.clone() for n, t in sub.state.items()}, sub.lanes, sub.aliases)
        return {n: t.clone() for n, t in sub.state.items()}

    @_serialized
    def publish(
        self, step: int, state: Mapping[str, torch.Tensor], *, release: Callable[[bool], None] | None = None
    ) -> PublishRecord:
        """Publish ``state`` as version ``step``.

        Args:
            step: The new version; must exceed the last published step.
            state: Tensors under Hugging Face names (any dtype; floating-point tensors are cast to the
                serving dtype). A tensor listed under two names (tied weights) is published once, under
                its first name; anchors record the other (see :mod:`rlsync.aliases`).
            release: For a staging buffer (contiguous serving-dtype tensors, as
                :class:`~rlsync.protocol.background.BackgroundPublisher` fills): called once the publish
                no longer reads ``state``, with ``True`` when it keeps ``state`` as its own (an anchor:
                the caller must not write those tensors again). A delta releases it right after change
                detection.

        Returns:
            What was written and what it cost.

        Raises:
            SyncError: ``step`` does not advance.
            RunExistsError: the bucket already holds a run this publisher did not :meth:`resume`, and
                ``new_run`` is off.
            RunLockedError: another trainer holds the run lock.
            FencedError: another trainer took the run over since this one started, or the pointer names
                a version this publisher did not write (resume() again).
            BucketError: the bucket failed; the previous version stays published and the publish may be
                retried.
        """
        state, aliases = split_aliases(state)
        if self._prepare(step) or not self.continued_by(state, aliases):
            if release is not None:
                release(True)
            return self._publish_anchor(step, state, owned=release is not None, aliases=aliases)
        t0 = time.perf_counter()
        changes, total = self.changes(state), sum(t.numel() for t in state.values())
        if release is not None:
            release(False)
        return self._publish_delta(step, changes, total, t0)

    @_serialized
    def publish_stream(self, step: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishRecord:
        """Publish version ``step`` from ``(name, tensor)`` pairs, comparing each as it arrives.

        For a trainer that yields its parameters one at a time (e.g. gathered from shards): each tensor
        is cast, compared with the shadow copy and hashed, then released, so no second copy of the model
        is built. Memory above the shadow is about two tensors plus the changed elements for a delta; an
        anchor (first publish, or as the policy decides) builds the new serving state, one shadow's
        worth. The pairs must name every published tensor once.

        Raises:
            SyncError: as :meth:`publish`; also when the pairs do not name exactly the published tensors
                with their shapes and dtypes.
            RunLockedError, FencedError, BucketError: as :meth:`publish`.
        """
        wants_anchor = self._prepare(step)
        if self.manifest is None or self.detector.published is None:
            return self._publish_anchor(step, {name: serving_copy(t, self.dtype) for name, t in tensors}, owned=True)
        t0 = time.perf_counter()
        changes = self.stream_changes(tensors, what=f"the publish of step {step}")
        if wants_anchor:
            return self._publish_anchor(step, PatchedState(self.detector.published, changes), owned=True)
        return self._publish_delta(step, changes, sum(t.numel() for t in self.detector.published.values()), t0)

    def _publish_delta(self, step: int, changes: dict[str, Change], total: int, t0: float) -> PublishRecord:
        """Hash the delta of ``changes`` (found since ``t0``) and have it written (:meth:`ChainWriter.delta`)."""
        t1 = time.perf_counter()
        lanes = self.delta_lanes(changes)
        t2 = time.perf_counter()
        written = self.writer.delta(step, changes, state_hash=lanes.hexdigest(), total=total)
        self.take_delta(changes, lanes)
        t3 = time.perf_counter()
        [entry] = written.deltas
        return PublishRecord(
            step, "delta", written.nbytes, entry.changed, total, entry.state_hash,
            encode_s=(t1 - t0) + written.encode_s, hash_s=t2 - t1, upload_s=t3 - t2 - written.encode_s,
            catchup_bytes=written.manifest.catchup_bytes(), keys=written.keys,
            changed_tensors={name: int(c.index.size) for name, c in changes.items()},
        )  # fmt: skip

    def _publish_anchor(
        self, step: int, state: Mapping[str, torch.Tensor], owned: bool = False, aliases: Mapping[str, str] | None = None
    ) -> PublishRecord:
        """Hash a full anchor and have it written (:meth:`ChainWriter.anchor`: with a companion delta when the
        state continues the published one); ``owned``: as :meth:`PublishedState.anchor_state`;
        ``aliases``: the tied names of ``state`` (``None``: those of the published state)."""
        aliases = self.aliases if aliases is None else aliases
        t0 = time.perf_counter()
        serving, changes, lanes = self.anchor_state(state, owned=owned, continues=self.manifest is not None)
        result_hash = lanes.hexdigest()
        t1 = time.perf_counter()
        total = sum(t.numel() for t in serving.values())
        written = self.writer.anchor(
            step, serving, changes, state_hash=result_hash, total=total, aliases=aliases, metadata=self.metadata
        )
        t2 = time.perf_counter()
        self.take_anchor(serving, lanes, aliases)
        return PublishRecord(
            step, "anchor", written.nbytes, total, total, result_hash,
            encode_s=written.encode_s, hash_s=t1 - t0, upload_s=t2 - t1 - written.encode_s,
            catchup_bytes=written.manifest.catchup_bytes(), keys=written.keys,
        )  # fmt: skip

