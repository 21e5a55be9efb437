"""The publisher: the trainer's side of the bucket protocol.

``publish(step, state)`` writes an anchor or a delta (as the anchor policy
decides), then the pointer, then deletes what retention drops. Data objects are
always complete before the pointer names them, so a crash at any moment leaves
the bucket readable at the previous version.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..bucket import Bucket, BucketError, ObjectNotFoundError, ObjectTooLargeError
from ..codecs import DEFAULT_CODEC, get_codec
from ..detect import DEFAULT_CHUNK_ELEMENTS, ChangeDetector, PatchedState, cast_chunk, serving_copy
from ..errors import FormatError, SyncError
from ..dtypes import numpy_to_values
from ..format import DEFAULT_MAX_SHARD_BYTES, FORMAT_VERSION, Change, encode_delta, write_anchor
from ..hashing import combine_digests, tensor_digest
from .lock import DEFAULT_LOCK_TTL_S, FencedError, RunLock, acquire, check_fence, write_lock
from .manifest import (
    CONTROL_KEY,
    MAX_POINTER_BYTES,
    POINTER_KEY,
    AnchorEntry,
    DeltaEntry,
    FileEntry,
    Manifest,
    anchor_folder,
    delta_key,
)
from .policy import MAX_CONTROL_BYTES, AnchorPolicy, FixedInterval, policy_from_json
from .retention import DEFAULT_KEEP_ANCHORS, prune, sweep_orphans
from .subscriber import SCRATCH_PREFIX, Subscriber

logger = logging.getLogger(__name__)


class NonFiniteError(SyncError):
    """A publish would turn finite published values into NaN or Inf (see ``Publisher(allow_non_finite=...)``)."""


def check_finite_changes(changes: Mapping[str, Change]) -> None:
    """Refuse changes that turn a finite published value into NaN or Inf.

    Only the changed elements are looked at, so the cost follows the delta, not the model.

    Raises:
        NonFiniteError: naming the first tensor concerned and how many values.
    """
    for name, change in changes.items():
        if not change.dtype.is_floating_point or change.index.size == 0:
            continue
        new = numpy_to_values(change.new_bits, change.dtype)
        old = numpy_to_values(change.old_bits, change.dtype)
        introduced = int((~torch.isfinite(new) & torch.isfinite(old)).sum())
        if introduced:
            raise NonFiniteError(
                f"{name}: {introduced} finite published values would become NaN or Inf; refusing to publish "
                "(the trainer diverged or was fed bad data)"
            )


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

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


def read_manifest(bucket: Bucket) -> Manifest | None:
    """The bucket's pointer object, or ``None`` before the first publish.

    Raises:
        FormatError: the pointer exists but is invalid.
    """
    try:
        data = bucket.get_limited(POINTER_KEY, MAX_POINTER_BYTES)
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
        follow_control: Read the anchor policy from the bucket's control object at
            every publish, so any panel can change it without a restart.
        chunk_elements: Elements compared at once by change detection.
        run_id: Free-form run name stored in the pointer.
        owner: Stable id of this trainer for the run lock (a restart with the same
            id takes over at once; another id is refused while the lock is fresh).
            Default: ``SPACE_ID`` or the host name.
        lock_ttl_s: Age after which another owner's lock may be taken over.
        allow_non_finite: Publish states that turn finite values into NaN or Inf
            (refused with :class:`NonFiniteError` by default).
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
        follow_control: bool = True,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        run_id: str = "",
        owner: str | None = None,
        lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
        allow_non_finite: bool = False,
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
        self.follow_control = follow_control
        self.run_id = run_id
        self.detector = ChangeDetector(dtype, chunk_elements)
        self.manifest: Manifest | None = None
        self._digests: dict[str, bytes] = {}
        self._resumed = False
        self.owner = owner or os.environ.get("SPACE_ID") or socket.gethostname()
        self.lock_ttl_s = lock_ttl_s
        self.allow_non_finite = allow_non_finite
        self.lock: RunLock | None = None
        self._written: set[tuple[int, str]] = set()  # (step, hash) of pointers this publisher wrote or tried to

    @property
    def step(self) -> int | None:
        """The last published step, or ``None``."""
        return self.manifest.step if self.manifest else None

    def resume(self) -> dict[str, torch.Tensor] | None:
        """Continue a run already in the bucket.

        Replays the newest chain with a :class:`~rlsync.protocol.Subscriber`,
        verifying every hash, and makes it the published state.

        Returns:
            The last published state (serving dtype), or ``None`` for an empty bucket.
        """
        self._resumed = True
        self._lock()
        manifest = read_manifest(self.bucket)
        if manifest is None:
            return None
        check_writable(manifest)
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
        self._digests = {n: tensor_digest(t) for n, t in sub.state.items()}
        self.manifest = manifest
        self._written = {(manifest.step, manifest.state_hash)}
        if not self.run_id:
            self.run_id = manifest.run_id
        logger.info("resumed at step %d (hash %s)", manifest.step, manifest.state_hash[:12])
        return {n: t.clone() for n, t in sub.state.items()}

    def _lock(self) -> None:
        """Take the run lock once, then check at every publish that it is still ours."""
        if self.lock is None:
            self.lock = acquire(self.bucket, self.owner, self.lock_ttl_s)
        else:
            check_fence(self.bucket, self.lock)

    def _check_pointer(self) -> None:
        """Refuse to write when the pointer names a version this publisher did not write.

        A trainer taken over while its publish was in flight can land that pointer
        after the new trainer resumed; publishing on would overwrite the objects it
        names. An unreadable pointer (an upload cut short) is ours to rewrite.

        Raises:
            FencedError: the pointer moved to a version this publisher did not publish.
        """
        if self.manifest is None:
            return
        try:
            current = read_manifest(self.bucket)
        except FormatError:
            return
        if current is None or (current.step, current.state_hash) in self._written:
            return
        raise FencedError(
            f"{self.bucket.url}: the pointer names step {current.step}, which this trainer did not publish "
            f"(its last was {self.manifest.step}); another trainer wrote into the chain; resume() before publishing"
        )

    def heartbeat(self) -> None:
        """Refresh the run lock's heartbeat (call while training without publishing for long)."""
        if self.lock is not None:
            check_fence(self.bucket, self.lock)
            self.lock = dataclasses.replace(self.lock, heartbeat=time.time())
            write_lock(self.bucket, self.lock)

    def _refresh_policy(self) -> None:
        if not self.follow_control:
            return
        try:
            data = self.bucket.get_limited(CONTROL_KEY, MAX_CONTROL_BYTES)
        except ObjectNotFoundError:
            return
        except ObjectTooLargeError as exc:
            logger.warning("ignoring invalid control object: %s", exc)
            return
        try:
            policy = policy_from_json(data)
        except FormatError as exc:
            logger.warning("ignoring invalid control object: %s", exc)
            return
        if policy != self.policy:
            logger.info("anchor policy now %s", policy.settings())
            self.policy = policy

    def publish(self, step: int, state: Mapping[str, torch.Tensor]) -> PublishRecord:
        """Publish ``state`` as version ``step``.

        Args:
            step: The new version; must exceed the last published step.
            state: Tensors under Hugging Face names (any dtype; floating-point
                tensors are cast to the serving dtype).

        Returns:
            What was written and what it cost.

        Raises:
            SyncError: ``step`` does not advance, or the bucket already holds a
                run this publisher did not :meth:`resume`.
            RunLockedError: another trainer holds the run lock.
            FencedError: another trainer took the run over since this one started, or the
                pointer names a version this publisher did not write (resume() again).
            BucketError: the bucket failed; the previous version stays published
                and the publish may be retried.
        """
        anchor = self._prepare(step) or not self.detector.compatible(state)
        return self._publish_anchor(step, state) if anchor else self._publish_delta(step, state)

    def _prepare(self, step: int) -> bool:
        """The checks before every publish (run lock, pointer, step); re-read the anchor policy.

        Returns:
            Whether the policy (or an empty chain) asks for an anchor.
        """
        if self.manifest is None and not self._resumed and read_manifest(self.bucket) is not None:
            raise SyncError(f"{self.bucket.url} already holds a published run; call resume() or use an empty bucket")
        self._lock()
        self._check_pointer()
        if self.step is not None and step <= self.step:
            raise SyncError(f"step {step} does not advance past the published step {self.step}")
        self._refresh_policy()
        return self.manifest is None or self.policy.wants_anchor(self.manifest)

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
        digests: dict[str, bytes] = {}
        encode_s = 0.0
        for name, tensor in tensors:
            if name in digests:
                raise SyncError(f"{name!r} was sent twice in one publish")
            t1 = time.perf_counter()
            change = self.detector.diff_tensor(name, tensor)
            encode_s += time.perf_counter() - t1
            if change is not None:
                changes[name] = change
                digests[name] = self._digest(tensor)
            else:  # same bits, same digest
                digests[name] = self._digests[name]
            del tensor
        missing = self.detector.published.keys() - digests.keys()
        if missing:
            raise SyncError(
                f"the publish of step {step} lacks {len(missing)} published tensor(s), e.g. {sorted(missing)[0]!r}"
            )
        if not self.allow_non_finite:
            check_finite_changes(changes)
        if wants_anchor:
            return self._publish_anchor(step, PatchedState(self.detector.published, changes), owned=True)
        old_digests, self._digests = self._digests, digests
        total = sum(t.numel() for t in self.detector.published.values())
        hash_s = time.perf_counter() - t0 - encode_s
        result_hash = combine_digests(digests)
        return self._write_delta(step, changes, result_hash, total, old_digests, encode_s=encode_s, hash_s=hash_s)

    def _digest(self, tensor: torch.Tensor) -> bytes:
        """The digest of ``tensor`` in the serving dtype (cast without a defensive copy: only the bits are read)."""
        return tensor_digest(cast_chunk(tensor.detach(), self.dtype))

    def _hash(self, state: Mapping[str, torch.Tensor], names) -> str:
        for name in names:
            self._digests[name] = self._digest(state[name])
        return combine_digests(self._digests)

    def _publish_delta(self, step: int, state: Mapping[str, torch.Tensor]) -> PublishRecord:
        assert self.manifest is not None
        t0 = time.perf_counter()
        changes = self.detector.diff(state)
        if not self.allow_non_finite:
            check_finite_changes(changes)
        t1 = time.perf_counter()
        old_digests = dict(self._digests)
        result_hash = self._hash(state, changes)
        t2 = time.perf_counter()
        total = sum(t.numel() for t in state.values())
        return self._write_delta(step, changes, result_hash, total, old_digests, encode_s=t1 - t0, hash_s=t2 - t1)

    def _write_delta(
        self, step: int, changes: dict[str, Change], result_hash: str, total: int, old_digests: dict[str, bytes],
        *, encode_s: float, hash_s: float,
    ) -> PublishRecord:  # fmt: skip
        """Encode and upload a delta whose changes and result hash are known, then the pointer."""
        assert self.manifest is not None
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
        assert self.lock is not None
        key = delta_key(step, self.lock.epoch)
        changed = sum(c.index.size for c in changes.values())
        entry = DeltaEntry(step, self.manifest.step, result_hash, FileEntry(key, len(data)), changed, total)
        manifest = dataclasses.replace(self.manifest, step=step, state_hash=result_hash, deltas=self.manifest.deltas + (entry,))
        try:
            self.bucket.put(key, data)
            self._commit(manifest)
        except BaseException:
            self._digests = old_digests
            raise
        self.detector.commit(changes)
        t4 = time.perf_counter()
        logger.info("published delta %d: %d bytes, %d/%d changed (%.3f%%)", step, len(data), changed, total, 100 * changed / max(total, 1))
        return PublishRecord(
            step, "delta", len(data), changed, total, result_hash,
            encode_s=encode_s + (t3 - t2), hash_s=hash_s, upload_s=t4 - t3,
            catchup_bytes=self.manifest.catchup_bytes(), keys=[key],
        )  # fmt: skip

    def _publish_anchor(self, step: int, state: Mapping[str, torch.Tensor], owned: bool = False) -> PublishRecord:
        """Write a full anchor; when the state continues the published one, also a companion
        delta of the same step, so that replicas keeping up never need to download anchors, unless
        that delta is no smaller than the anchor (a dense update, e.g. of a LoRA adapter): then they
        download the anchor instead.
        ``owned``: ``state`` holds contiguous serving-dtype tensors nobody else modifies, kept without a copy."""
        assert self.lock is not None
        t0 = time.perf_counter()
        serving = dict(state) if owned else {n: serving_copy(t, self.dtype) for n, t in state.items()}
        continues = self.manifest is not None and self.detector.compatible(serving)
        changes = self.detector.diff(serving) if continues else {}
        if not self.allow_non_finite:
            check_finite_changes(changes)
        self._digests = {}
        result_hash = self._hash(serving, serving)
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
            key = delta_key(step, self.lock.epoch)
            companion = (DeltaEntry(step, self.manifest.step, result_hash, FileEntry(key, len(data)), changed, total),)
        folder = anchor_folder(step, self.lock.epoch)
        with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as tmp:
            files = write_anchor(serving, tmp, step=step, state_hash=result_hash, max_shard_bytes=self.max_shard_bytes)
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
            manifest = Manifest(step, result_hash, (anchor,), (), run_id=self.run_id, metadata=self.metadata)
        else:
            manifest = dataclasses.replace(
                self.manifest, step=step, state_hash=result_hash,
                anchors=self.manifest.anchors + (anchor,), deltas=self.manifest.deltas + companion,
            )  # fmt: skip
        self._commit(manifest)
        t3 = time.perf_counter()
        self.detector.published = serving
        nbytes = sum(e.size for e in entries)
        logger.info("published anchor %d: %d bytes in %d file(s)", step, nbytes, len(entries))
        return PublishRecord(
            step, "anchor", nbytes, total, total, result_hash,
            encode_s=t2 - t1, hash_s=t1 - t0, upload_s=t3 - t2,
            catchup_bytes=self.manifest.catchup_bytes() if self.manifest else nbytes,
            keys=[e.key for e in entries] + [c.file.key for c in companion],
        )  # fmt: skip

    def _commit(self, manifest: Manifest) -> None:
        """Write the pointer for ``manifest`` (after retention), then delete what it dropped."""
        pruned, dropped = prune(manifest, self.keep_anchors)
        if self.lock is not None:  # the data may have taken long to upload: still ours?
            check_fence(self.bucket, self.lock)
        self._written = {(self.manifest.step, self.manifest.state_hash)} if self.manifest else set()
        self._written.add((pruned.step, pruned.state_hash))  # a put that failed may still have landed
        self.bucket.put(POINTER_KEY, pruned.to_json())
        self.manifest = pruned
        try:
            if dropped:
                self.bucket.delete(dropped)
            if len(pruned.deltas_since(pruned.newest_anchor.step)) == 0:  # after each anchor
                sweep_orphans(self.bucket, pruned)
        except BucketError as exc:  # the pointer no longer names them; the next sweep retries
            logger.warning("retention could not delete old objects: %s", exc)
