"""What a replica reports: the status object it publishes (:class:`~rlsync.spaces.metrics.ReplicaStatus`)
and its log line per interval."""

from __future__ import annotations

import time

from rlsync.spaces.metrics import STATUS_SYNCS, HubCounts, ReplicaStatus, Sync
from rlsync.supervised import crashes


def replica_status(replica) -> ReplicaStatus:
    """The status object `replica` (a :class:`~rollout_space.replica.Replica`) publishes: its weights, syncs,
    work and refusals."""
    last = replica.syncs[-1] if replica.syncs else {}
    deltas = [s for s in replica.syncs if s["kind"] == "delta"]
    applied = replica.subscriber.step
    return ReplicaStatus(
        replica_id=replica.replica_id,
        engine=replica.engine.name,
        applied_step=applied,
        newest_step=replica.newest_step,
        lag=None if applied is None or replica.newest_step is None else replica.newest_step - applied,
        apply_s=last.get("idle_s"),
        idle_per_sync_s=sum(s["idle_s"] for s in deltas) / len(deltas) if deltas else None,
        bytes_downloaded=replica.subscriber.stats.bytes_downloaded,
        reads=replica.subscriber.stats.reads,
        refused=replica.subscriber.stats.refused,
        refused_objects=replica.refusals.total,
        thread_crashes=crashes(replica._threads),
        tokens_per_s=replica.tokens / replica.gen_s if replica.gen_s else 0.0,
        completions=replica.completions,
        skipped_stale=replica.skipped_stale,
        claims_lost=replica.batches.lost,
        state_hash=replica.subscriber.state_hash,
        hub=HubCounts(**replica.meter.snapshot()) if replica.meter is not None else None,
        engine_state_hash=replica.subscriber.stats.verified_hash or None,  # the weights' own, re-hashed
        engine_verified_step=replica.subscriber.stats.verified_step,
        rehashes=replica.subscriber.stats.rehashes,
        rehash_mismatches=replica.subscriber.stats.rehash_mismatches,
        last_rehash_s=replica.subscriber.stats.last_rehash_s,
        recent_syncs=[
            Sync(**{k: s[k] for k in ("step", "kind", "nbytes", "download_s", "idle_s", "time")})
            for s in replica.syncs[-STATUS_SYNCS:]
        ],
        **(replica.adapters.status() if replica.adapters is not None else {}),
        updated_at=time.time(),
    )


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
