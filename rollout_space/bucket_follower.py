"""A replica whose engine follows the bucket itself: the replica's process holds no copy of the model.

An engine such as vLLM with the ``bucket`` weight-transfer backend
(:class:`~rollout_space.engine.BucketFollowingEngine`, :mod:`rlsync.vllm.transfer`) runs the
:class:`~rlsync.protocol.Subscriber` inside its workers, on the served weights (their own tensors where
they are plain views: every module on a GPU; the smallest copy only for the modules that cannot be
written element-wise, such as CPU's prepacked kernels). :class:`BucketFollower` tells it when, in the
sequence of :class:`~rlsync.vllm.client.BucketSyncClient`:

1. the fetch thread has the workers prepare the next update in their background (download, decode, the
   O(changed) hash check against the published hash) while the engine generates, polling their status
   with a backoff; a refused update (corrupt, hostile, a hash mismatch) stops there, before any pause,
   counted, and the engine keeps serving its last verified version; up to date, the thread waits for news
   of the chain's pointer like the :class:`~rollout_space.weights.WeightFollower`;
2. the pause (between batches) is the prepared apply alone: no bucket read, no decode; then the prefix
   cache is reset. It is measured as ``idle_s``;
3. the re-hash thread has the workers re-hash the served weights in their background; a mismatch is
   counted and the engine follows the bucket again, from its newest anchor.

The replica's process keeps only where the engine stands (its step and state hash, as the workers
report them) and the counters of its status.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from rlsync.bucket import Bucket
from rlsync.fp8 import Chain
from rlsync.protocol import SubscriberStats
from rlsync.spaces.interval_log import IntervalLog
from rlsync.vllm.status import Prepared, TransferStatus

from .config import ReplicaConfig
from .engine import BucketFollowingEngine
from .weights import Follower

__all__ = ["BucketFollower"]

logger = logging.getLogger(__name__)

#: First and longest wait between two reads of the workers' status while they prepare or re-hash.
POLL_MIN_S, POLL_MAX_S = 0.02, 1.0
#: The workers' counters the status reports, summed over their subscribers (one per follow_bucket).
WORKER_COUNTERS = ("reads", "bytes_downloaded", "refused")


class BucketFollower(Follower):
    """Has an engine that follows the bucket itself apply one chain's versions (see the module docstring).

    Args:
        bucket: The run's bucket (the engine's workers open its URL themselves).
        engine: The engine, started able to follow the bucket (``engine.follows_bucket``).
        chain: The chain followed (bf16 weights or the FP8 serving chain).
        config: The replica's settings (see :class:`~rollout_space.weights.Follower`).
        name: The replica's id, in log lines.
        summary: The replica's interval log, counting applied versions and pauses.
    """

    def __init__(
        self, bucket: Bucket, engine: BucketFollowingEngine, chain: Chain, config: ReplicaConfig, *, name: str,
        summary: IntervalLog,
    ) -> None:  # fmt: skip
        super().__init__(bucket, chain, config, name=name, summary=summary)
        self.engine = engine
        self._stats = SubscriberStats()
        self._step: int | None = None
        self._state_hash: str | None = None
        self._seen: dict[str, int] = {}  # the workers' counters at the last status (their subscriber's)
        # held across each call to the engine and the reading of the status it returns, so that a thread's
        # older status never overwrites a newer one (a version the workers no longer serve)
        self._lock = threading.RLock()
        self._follow()

    @property
    def step(self) -> int | None:
        """The version the engine's workers serve, verified (``None`` before the first anchor)."""
        return self._step

    @property
    def state_hash(self) -> str | None:
        """Its state hash, as the workers verified it."""
        return self._state_hash

    @property
    def stats(self) -> SubscriberStats:
        """The counters: the workers' reads, bytes and refusals (over every subscriber they had), the updates
        applied here and the re-hashes."""
        return self._stats

    def _follow(self) -> None:
        """Have the engine follow the chain from its newest anchor (again after a re-hash mismatch)."""
        with self._lock:
            self._seen = {}  # a new subscriber in the workers: its counters start at 0
            self._call(lambda: self.engine.follow_bucket(self.bucket.url, self.chain.value))

    def _call(self, call: Callable[[], TransferStatus]) -> TransferStatus:
        """Call the engine and take where it stands and its counters from the status it returns."""
        with self._lock:
            status = call()
            self._step, self._state_hash = status.step, status.state_hash
            if status.newest_step is not None:
                self.newest_step = status.newest_step
            for key in WORKER_COUNTERS:
                now = int(getattr(status, key))
                setattr(self._stats, key, getattr(self._stats, key) + max(0, now - self._seen.get(key, 0)))
                self._seen[key] = now
        return status

    def _wait(self, stop: threading.Event, busy: str, call: Callable[[], TransferStatus]) -> TransferStatus:
        """``call`` the engine, then read the workers' status until they are no longer ``busy`` (``preparing``,
        ``rehashing``) or ``stop``, waiting longer between reads the longer the work takes."""
        status, delay = self._call(call), POLL_MIN_S
        while getattr(status, busy) and not stop.is_set():
            stop.wait(delay)
            delay = min(2 * delay, POLL_MAX_S)
            status = self._call(self.engine.transfer_status)
        return status

    def fetch_next(self, stop: threading.Event) -> Prepared | None:
        """Have the workers prepare the next update, while the engine generates.

        Returns:
            The prepared update, or ``None``: up to date, refused (counted by the workers; the engine keeps
            its version), the bucket unavailable, or ``stop``.
        """
        status = self._wait(stop, "preparing", self.engine.prepare_update)
        if status.error:
            with self._lock:
                self._stats.last_error = status.error
            logger.warning("replica %s: update refused or unavailable: %s", self.name, status.error)
            return None
        return None if status.preparing else status.prepared

    def _apply(self, update: Prepared) -> bool:
        """The pause: the workers write the prepared update (and the prefix cache is reset)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                self.engine.apply_prepared(update.step)
            except Exception as exc:  # noqa: BLE001 - vLLM reports a worker's error as a bare Exception; the workers reload at the next update
                logger.error("replica %s: could not apply %s %d: %s", self.name, update.kind, update.step, exc)
                return False
            idle = time.perf_counter() - t0
            self._call(self.engine.transfer_status)
            if (self._step, self._state_hash) != (update.step, update.state_hash):
                logger.info("replica %s: the prepared %s %d was dropped: the bucket moved on", self.name, update.kind, update.step)
                return False
            if update.kind == "anchor":
                self._stats.anchors_applied += 1
            else:
                self._stats.deltas_applied += 1
            self._stats.last_apply_s = idle
        self._record(update, idle)
        return True

    def rehash(self, stop: threading.Event) -> None:
        """Have the workers re-hash the served weights in their background and compare them with the verified
        hash; a mismatch is counted (``rehash_mismatches``, ``refused``) and the engine follows the bucket again
        from its newest anchor (the fetch thread is woken to prepare it)."""
        if self._step is None:
            return
        t0 = time.perf_counter()
        status = self._wait(stop, "rehashing", self.engine.verify_served)
        rehash = status.rehash
        if status.rehashing:
            return
        if status.rehash_error or rehash is None:
            why = status.rehash_error or "no result"
            logger.warning("replica %s: could not re-hash the weights: %s", self.name, why)
            return
        if not rehash.mismatch:
            with self._lock:
                self._stats.rehashes += 1
                self._stats.last_rehash_s = time.perf_counter() - t0
                self._stats.verified_step, self._stats.verified_hash = rehash.step, rehash.served
            return
        error = f"the served weights of step {rehash.step} do not hash equal to its verified state"
        with self._lock:
            self._stats.rehash_mismatches += 1
            self._stats.refused += 1
            self._stats.last_error = error
        logger.error("replica %s: %s: following the bucket again from its newest anchor", self.name, error)
        self._follow()
        self._nudge.set()
