"""A replica's weights: follow one chain of the bucket into the engine, bit for bit.

:class:`Follower` is what the replica's loops drive, whatever holds the verified state: a background
thread downloads, decodes and verifies the next update (:meth:`~Follower.fetch_loop`) while the engine
keeps generating, and applies it as soon as no batch is being generated (a batch's samples are all of
the version it started with, :meth:`~rollout_space.update_slot.UpdateSlot.holding`), not when the replica's
loop next comes round: between batches a replica also claims, writes and waits for request budget, and a
fleet sharing one token's budget would otherwise fall a version behind per trainer step. Only writing
the update pauses generation, and that pause is measured as "inference idle per sync". Another background thread
(:meth:`~Follower.rehash_loop`) re-hashes the engine's weights in full after every anchor and every
``rehash_every_s`` seconds; a mismatch is counted (``rehash_mismatches``) and the weights re-bootstrap
from the newest anchor.

Two kinds exist. An engine that follows the bucket itself (vLLM's ``bucket`` backend,
:class:`~rollout_space.engine.BucketFollowingEngine`) gets a
:class:`~rollout_space.bucket_follower.BucketFollower`: the subscriber lives where the weights do, and the
replica's process holds no copy of the model. The others get a :class:`WeightFollower`, whose
:class:`~rlsync.protocol.Subscriber` writes a delta's changed elements into the engine's own weights when
the engine exposes them (:meth:`~rollout_space.engine.Engine.weights`: no second copy of the model), and
otherwise keeps the verified state and hands the engine each verified update from it.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from typing import Any

from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, wait_for_change
from rlsync.errors import BucketError, SyncError
from rlsync.fp8 import Chain
from rlsync.protocol import SubscriberStats, Update
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.metrics import Sync

from .config import ReplicaConfig
from .engine import Engine
from .update_slot import UpdateSlot

logger = logging.getLogger(__name__)

#: Syncs kept for the status object (the newest ones).
KEPT_SYNCS = 500


def idle_wait_s(bucket: Bucket, poll_s: float) -> float:
    """How long a replica loop waits for news: ``poll_s`` on an unwatched bucket, else a watch's wait."""
    return poll_s if generation(bucket) is None else IDLE_WAIT_S


class Follower(abc.ABC):
    """Follows one chain's weights into an engine: the loops a replica runs, whatever holds the verified state.

    Args:
        bucket: The run's bucket.
        chain: The chain followed (bf16 weights or the FP8 serving chain).
        config: The replica's settings (``rehash_every_s``: seconds between full re-hashes of the weights, 0:
            only after anchors; ``poll_s``: seconds between pointer reads when up to date on an unwatched bucket).
        name: The replica's id, in log lines.
        summary: The replica's interval log, counting applied versions and pauses.
    """

    def __init__(self, bucket: Bucket, chain: Chain, config: ReplicaConfig, *, name: str, summary: IntervalLog) -> None:
        self.bucket, self.chain, self.config = bucket, chain, config
        self.name = name
        self.summary = summary
        self.slot = UpdateSlot()
        #: One record per applied update (step, kind, nbytes, download_s, idle_s, time), the newest last.
        self.syncs: list[Sync] = []
        #: The newest version the pointer named at the last fetch (``None`` before one).
        self.newest_step: int | None = None
        self._rehash_now = threading.Event()  # set after an anchor: re-hash the weights it wrote
        self._nudge = threading.Event()  # set to end the fetch loop's wait for news (on stop, after a re-bootstrap)

    @property
    @abc.abstractmethod
    def step(self) -> int | None:
        """The version the engine serves, verified (``None`` before the first anchor)."""

    @property
    @abc.abstractmethod
    def state_hash(self) -> str | None:
        """The state hash of that version."""

    @property
    @abc.abstractmethod
    def stats(self) -> SubscriberStats:
        """The counters the replica's status reports (reads, bytes, refusals, re-hashes)."""

    @abc.abstractmethod
    def fetch_next(self, stop: threading.Event) -> Any:
        """Download, decode and verify the next update while generation goes on.

        Returns:
            What :meth:`apply_pending` hands to the apply, or ``None`` (up to date, refused, unavailable).
        """

    @abc.abstractmethod
    def _apply(self, update: Any) -> bool:
        """Write a fetched update into the engine (the pause); returns whether it was applied."""

    @abc.abstractmethod
    def rehash(self, stop: threading.Event) -> None:
        """Re-hash the engine's weights in full against the verified state hash; a mismatch is counted and
        the engine re-bootstraps from the newest anchor."""

    def fetch_loop(self, stop: threading.Event) -> None:
        """Background thread: fetch the next update while generation goes on and apply it once no batch is being
        generated, until ``stop``; up to date, wait for news of the chain's pointer (:func:`idle_wait_s`)."""
        while not stop.is_set():
            self.slot.wait_empty(stop)
            if stop.is_set():
                return
            since = generation(self.bucket)
            update = self.fetch_next(stop)
            if update is None:
                idle_s = idle_wait_s(self.bucket, self.config.poll_s)
                wait_for_change(self.bucket, self._nudge, idle_s, (self.chain.pointer_key,), since)
                self._nudge.clear()
                continue
            self.slot.put(update)
            update = None  # the slot holds it until it is applied: not this loop while it fetches the next one
            self.slot.apply_when_free(self._apply, stop)

    def apply_pending(self) -> bool:
        """Apply a fetched update now (after the batch being generated, if any), pausing generation; returns
        whether one was applied.

        The fetch thread waits until the update is applied before it fetches the next
        one, which is validated against the state this apply produces.
        """
        return self.slot.apply(self._apply)

    def _record(self, update: Any, idle: float) -> None:
        """Count an applied update (its ``step``, ``kind``, ``nbytes``, ``download_s``) and the pause ``idle`` it
        took; after an anchor, wake the re-hash thread."""
        if update.kind == "anchor":
            self._rehash_now.set()
        self.syncs.append(Sync(update.step, update.kind, update.nbytes, update.download_s, idle, time.time()))
        del self.syncs[:-KEPT_SYNCS]
        logger.debug("replica %s: applied %s %d, idle %.3fs", self.name, update.kind, update.step, idle)
        self.summary.add(applied=1, anchors=update.kind == "anchor", idle_s=idle)
        self.summary.note(version=update.step)

    def rehash_loop(self, stop: threading.Event) -> None:
        """Background thread: :meth:`rehash` after every anchor and every ``rehash_every_s`` seconds, until ``stop``."""
        every = self.config.rehash_every_s
        while not stop.is_set():
            self._rehash_now.wait(every if every > 0 else None)
            if stop.is_set():
                return
            self._rehash_now.clear()
            self.rehash(stop)

    def wake(self) -> None:
        """Wake the loops (on stop): the fetch loop waiting for news or for its update to be applied, the re-hash loop."""
        self._rehash_now.set()
        self._nudge.set()
        self.slot.wake()


class WeightFollower(Follower):
    """Follows one chain's weights into an engine through a :class:`~rlsync.protocol.Subscriber` of its own.

    Args:
        bucket: The run's bucket.
        engine: The engine serving the weights.
        chain: The chain followed (bf16 weights or the FP8 serving chain).
        config: The replica's settings (see :class:`Follower`).
        name: The replica's id, in log lines.
        max_state_bytes: The largest first anchor accepted (e.g. the model's size).
        summary: The replica's interval log, counting applied versions and pauses.
    """

    def __init__(
        self, bucket: Bucket, engine: Engine, chain: Chain, config: ReplicaConfig, *, name: str,
        max_state_bytes: int | None, summary: IntervalLog,
    ) -> None:  # fmt: skip
        super().__init__(bucket, chain, config, name=name, summary=summary)
        self.engine = engine
        self._engine_weights = engine.weights()  # None: the engine is fed from the subscriber's copy
        self.subscriber = chain.subscriber(bucket, weights=self._engine_weights, max_state_bytes=max_state_bytes)

    @property
    def step(self) -> int | None:
        """The subscriber's version."""
        return self.subscriber.step

    @property
    def state_hash(self) -> str | None:
        """The subscriber's state hash."""
        return self.subscriber.state_hash

    @property
    def stats(self) -> SubscriberStats:
        """The subscriber's counters."""
        return self.subscriber.stats

    def fetch_next(self, stop: threading.Event) -> Update | None:
        """The subscriber's next update, downloaded and validated (``None``: up to date, refused or unavailable)."""
        try:
            update = self.subscriber.fetch()
        except (SyncError, BucketError) as exc:
            logger.warning("replica %s: update refused or unavailable: %s", self.name, exc)
            update = None
        if self.subscriber.manifest is not None:
            self.newest_step = self.subscriber.manifest.step
        return update

    def _apply(self, update: Update) -> bool:
        t0 = time.perf_counter()
        try:
            self.subscriber.apply(update)
        except SyncError as exc:
            logger.error("replica %s: refused %s %d: %s", self.name, update.kind, update.step, exc)
            return False
        if self._engine_weights is None:  # the engine keeps its own weights: hand it the verified update
            if update.kind == "anchor":
                self.engine.load_state(self.subscriber.state)
            else:
                self.engine.apply_patches(update.patches or {}, self.subscriber.state)
        self._record(update, time.perf_counter() - t0)
        return True

    def rehash(self, stop: threading.Event) -> None:
        """:meth:`~rlsync.protocol.Subscriber.verify_weights` (a mismatch re-bootstraps the subscriber)."""
        if self.subscriber.verify_weights() is False:
            logger.error("replica %s: %s", self.name, self.subscriber.stats.last_error)
