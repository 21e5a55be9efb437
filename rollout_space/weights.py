"""A replica's weights: follow one chain of the bucket into the engine, bit for bit.

:class:`WeightFollower` downloads, decodes and verifies the next update in a background thread
(:meth:`~WeightFollower.fetch_loop`) while the engine keeps generating; only writing it pauses
generation (:meth:`~WeightFollower.apply_pending`, between batches): for a delta, the scatter of the
changed elements into the engine's own weights when the engine exposes them
(:meth:`~rollout_space.engine.Engine.weights`, then the subscriber's state: no second copy of the
model). That pause is measured as "inference idle per sync".

Another background thread (:meth:`~WeightFollower.rehash_loop`) re-hashes the engine's weights in
full after every anchor and every ``rehash_every_s`` seconds; a mismatch is counted
(``rehash_mismatches``) and the subscriber re-bootstraps from the newest anchor.
"""

from __future__ import annotations

import logging
import threading
import time

from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, wait_for_change
from rlsync.errors import BucketError, SyncError
from rlsync.fp8 import Chain
from rlsync.protocol import Update
from rlsync.spaces.interval_log import IntervalLog

from .config import ReplicaConfig
from .engine import Engine
from .update_slot import UpdateSlot

logger = logging.getLogger(__name__)

#: Syncs kept for the status object (the newest ones).
KEPT_SYNCS = 500


def idle_wait_s(bucket: Bucket, poll_s: float) -> float:
    """How long a replica loop waits for news: ``poll_s`` on an unwatched bucket, else a watch's wait."""
    return poll_s if generation(bucket) is None else IDLE_WAIT_S


class WeightFollower:
    """Follows one chain's weights into an engine.

    Args:
        bucket: The run's bucket.
        engine: The engine serving the weights.
        chain: The chain followed (bf16 weights or the FP8 serving chain).
        config: The replica's settings (``rehash_every_s``: seconds between full re-hashes of the weights, 0:
            only after anchors; ``poll_s``: seconds between pointer reads when up to date on an unwatched bucket).
        name: The replica's id, in log lines.
        max_state_bytes: The largest first anchor accepted (e.g. the model's size).
        summary: The replica's interval log, counting applied versions and pauses.
    """

    def __init__(
        self, bucket: Bucket, engine: Engine, chain: Chain, config: ReplicaConfig, *, name: str,
        max_state_bytes: int | None, summary: IntervalLog,
    ) -> None:  # fmt: skip
        self.bucket, self.engine, self.chain, self.config = bucket, engine, chain, config
        self.name = name
        self.summary = summary
        self._engine_weights = engine.weights()  # None: the engine is fed from the subscriber's copy
        self.subscriber = chain.subscriber(bucket, weights=self._engine_weights, max_state_bytes=max_state_bytes)
        self.slot = UpdateSlot()
        #: One dict per applied update (step, kind, nbytes, download_s, decode_s, idle_s, time), the newest last.
        self.syncs: list[dict] = []
        #: The newest version the pointer named at the last fetch (``None`` before one).
        self.newest_step: int | None = None
        self._rehash_now = threading.Event()  # set after an anchor: re-hash the weights it wrote

    def fetch_loop(self, stop: threading.Event) -> None:
        """Background thread: download and validate the next update while generation goes on, until ``stop``."""
        while not stop.is_set():
            self.slot.wait_empty(stop)
            if stop.is_set():
                return
            since = generation(self.bucket)
            try:
                update = self.subscriber.fetch()
            except (SyncError, BucketError) as exc:
                logger.warning("replica %s: update refused or unavailable: %s", self.name, exc)
                update = None
            if self.subscriber.manifest is not None:
                self.newest_step = self.subscriber.manifest.step
            if update is None:
                idle_s = idle_wait_s(self.bucket, self.config.poll_s)
                wait_for_change(self.bucket, stop, idle_s, (self.chain.pointer_key,), since)
                continue
            self.slot.put(update)
            update = None  # the slot holds it until it is applied: not this loop while it fetches the next one

    def apply_pending(self) -> bool:
        """Apply a downloaded update, pausing generation; returns whether one was applied.

        The fetch thread waits until this returns before it fetches the next
        update, which is validated against the state this apply produces.
        """
        return self.slot.apply(self._apply)

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
        idle = time.perf_counter() - t0
        if update.kind == "anchor":
            self._rehash_now.set()
        self.syncs.append({
            "step": update.step, "kind": update.kind, "nbytes": update.nbytes, "download_s": update.download_s,
            "decode_s": update.decode_s, "idle_s": idle, "time": time.time(),
        })  # fmt: skip
        del self.syncs[:-KEPT_SYNCS]
        logger.debug("replica %s: applied %s %d, idle %.3fs", self.name, update.kind, update.step, idle)
        self.summary.add(applied=1, anchors=update.kind == "anchor", idle_s=idle)
        self.summary.note(version=update.step)
        return True

    def rehash_loop(self, stop: threading.Event) -> None:
        """Background thread: re-hash the weights in full after every anchor and every ``rehash_every_s``
        seconds (:meth:`~rlsync.protocol.Subscriber.verify_weights`; a mismatch re-bootstraps), until ``stop``."""
        every = self.config.rehash_every_s
        while not stop.is_set():
            self._rehash_now.wait(every if every > 0 else None)
            if stop.is_set():
                return
            self._rehash_now.clear()
            if self.subscriber.verify_weights() is False:
                logger.error("replica %s: %s", self.name, self.subscriber.stats.last_error)

    def wake(self) -> None:
        """Wake both loops (on stop): the fetch loop waiting for its update to be applied, the re-hash loop."""
        self._rehash_now.set()
        self.slot.wake()
