"""The flow figures of :class:`~rlsync.trl.rollout_worker.BucketRolloutWorker` (:class:`RolloutFlow`):
cumulative counts of samples read, dropped and expired, the staleness histogram of the samples TRL took in
time, the newest task batch read and the issue-to-read latency, logged as one summary line per interval.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any

__all__ = ["RolloutFlow"]

logger = logging.getLogger(__name__)

_SUMMARY_COUNTS = ("read", "dropped_stale", "expired_unread", "dropped_degenerate", "invalid", "unreadable")


class RolloutFlow:
    """What the rollout worker read, dropped and handed to TRL.

    Args:
        summary_s: Seconds between the summary log lines of reads and drops (``None``: no such line).
    """

    def __init__(self, summary_s: float | None) -> None:
        self.summary_s = summary_s
        self.counts = {
            "read": 0, "queued": 0, "invalid": 0, "dropped_stale": 0, "unreadable": 0,
            "dropped_degenerate": 0, "degenerate_groups": 0, "expired_unread": 0,
        }  # fmt: skip
        self.staleness: collections.Counter[int] = collections.Counter()
        self.newest_batch: int | None = None
        self.latency_s: float | None = None
        self._lock = threading.Lock()
        self._summary_at = time.monotonic()
        self._summary_counts = dict(self.counts)

    def note_header(self, header: dict[str, Any]) -> None:
        """Track the newest task batch read and the issue-to-read latency (headers are untrusted: sanity-checked)."""
        batch, issued = header.get("batch"), header.get("issued_at")
        if type(batch) is int and 0 <= batch < 1 << 40:
            self.newest_batch = batch if self.newest_batch is None else max(self.newest_batch, batch)
        if type(issued) in (int, float) and math.isfinite(issued):
            latency = min(max(time.time() - issued, 0.0), 3600.0)
            self.latency_s = latency if self.latency_s is None else 0.8 * self.latency_s + 0.2 * latency

    def taken(self, staleness: int, max_staleness: int | None) -> None:
        """TRL took a sample ``staleness`` versions old: it trains on it, or drops it as stale (expired unread)."""
        with self._lock:
            if max_staleness is not None and staleness > max_staleness:
                self.counts["expired_unread"] += 1
            else:
                self.staleness[staleness] += 1

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts, the staleness histogram of samples taken in time, newest batch read, latency."""
        with self._lock:
            return {
                **self.counts, "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                "newest_batch": self.newest_batch, "latency_s": self.latency_s,
            }  # fmt: skip

    def log_summary(self, force: bool = False) -> None:
        """One line per ``summary_s`` with the samples read and dropped since the last one."""
        if self.summary_s is None or not force and time.monotonic() - self._summary_at < self.summary_s:
            return
        now = self.snapshot()
        grown = {k: now[k] - self._summary_counts[k] for k in _SUMMARY_COUNTS}
        self._summary_at, self._summary_counts = time.monotonic(), {k: now[k] for k in _SUMMARY_COUNTS}
        if any(grown.values()):
            logger.info("rollouts in the last %gs: %s", self.summary_s, ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in grown.items()))
