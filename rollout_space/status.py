"""What a replica reports: the status object it publishes (:class:`~rlsync.spaces.metrics.ReplicaStatus`,
written by :class:`StatusWriter` to ``status/<replica>.json`` so any panel can show the fleet) and its log
line per interval."""

from __future__ import annotations

import logging
import time
from typing import Callable

from rlsync.bucket import Bucket
from rlsync.bucket.watch import meter_of
from rlsync.errors import BucketError
from rlsync.layout import status_key
from rlsync.spaces.exchange import put_json
from rlsync.spaces.metrics import STATUS_SYNCS, HubCounts, ReplicaStatus
from rlsync.spaces.settings import space_owner
from rlsync.supervised import crashes

logger = logging.getLogger(__name__)


def replica_status(replica) -> ReplicaStatus:
    """The status object `replica` (a :class:`~rollout_space.replica.Replica`) publishes: its weights, syncs,
    work and refusals."""
    syncs, newest, tasks = replica.weights.syncs, replica.weights.newest_step, replica.tasks
    deltas = [s.idle_s for s in syncs if s.kind == "delta" and s.idle_s is not None]
    applied, stats = replica.weights.step, replica.weights.stats
    return ReplicaStatus(
        replica_id=replica.replica_id,
        host=space_owner(),
        engine=replica.engine.name,
        applied_step=applied,
        newest_step=newest,
        lag=None if applied is None or newest is None else newest - applied,
        apply_s=syncs[-1].idle_s if syncs else None,
        idle_per_sync_s=sum(deltas) / len(deltas) if deltas else None,
        bytes_downloaded=stats.bytes_downloaded,
        reads=stats.reads,
        refused=stats.refused,
        refused_objects=tasks.refusals.total,
        thread_crashes=crashes(replica.threads),
        tokens_per_s=tasks.tokens / tasks.gen_s if tasks.gen_s else 0.0,
        completions=tasks.completions,
        skipped_stale=tasks.skipped_stale,
        claims_lost=tasks.batches.lost,
        state_hash=replica.weights.state_hash,
        hub=HubCounts(**replica.meter.snapshot()) if replica.meter is not None else None,
        engine_state_hash=stats.verified_hash or None,  # the weights' own, re-hashed
        engine_verified_step=stats.verified_step,
        rehashes=stats.rehashes,
        rehash_mismatches=stats.rehash_mismatches,
        last_rehash_s=stats.last_rehash_s,
        recent_syncs=syncs[-STATUS_SYNCS:],
        **(replica.adapters.status() if replica.adapters is not None else {}),
        updated_at=time.time(),
    )


class StatusWriter:
    """Writes a replica's status object: on a Hub bucket at most every ``every_s`` seconds, and only when
    something moved; on any other bucket at every call.

    Args:
        bucket: The run's bucket.
        replica_id: The replica's id (the object's key).
        status: Returns the status object to write.
        every_s: Seconds between writes on a Hub bucket.
    """

    def __init__(self, bucket: Bucket, replica_id: str, status: Callable[[], ReplicaStatus], every_s: float) -> None:
        self.bucket = bucket
        self.key = status_key(replica_id)
        self.status = status
        self.every_s = every_s
        self.metered = meter_of(bucket) is not None
        self._at = -float("inf")
        self._progress: tuple | None = None

    def publish(self, force: bool = False) -> None:
        """Write the status object (on a Hub bucket at most every ``every_s`` unless `force`); a bucket error
        is logged, not raised."""
        now = time.monotonic()
        status = self.status()
        progress = (status.applied_step, status.newest_step, status.completions, status.refused)
        if self.metered and not force:
            if now - self._at < self.every_s or progress == self._progress:
                return  # on the Hub: at most every every_s, and only when something moved
        self._at, self._progress = now, progress
        try:
            put_json(self.bucket, self.key, status.to_json())
        except BucketError as exc:
            logger.warning("could not write status: %s", exc)


def summary_line(replica_id: str, counts, latest: dict, seconds: float) -> str:
    """A replica's line per interval: versions applied and the pause, batches answered, skips."""
    parts = []
    if counts["applied"]:
        n = int(counts["applied"])
        parts.append(f"applied {n} versions up to {latest.get('version')} (anchors: {int(counts['anchors'])}), "
                     f"mean pause {counts['idle_s'] / n * 1e3:.1f} ms")  # fmt: skip
    if counts["batches"]:
        parts.append(f"answered {int(counts['batches'])} batches ({int(counts['samples'])} samples, "
                     f"{counts['tokens'] / max(counts['gen_s'], 1e-9):.0f} tokens/s)")  # fmt: skip
    parts += [f"{int(counts[k])} {label}" for k, label in (("claims_lost", "claims lost to another replica"),
              ("skipped_stale", "batches skipped as stale")) if counts[k]]  # fmt: skip
    return f"replica {replica_id} ({seconds:.0f}s): " + ", ".join(parts)
