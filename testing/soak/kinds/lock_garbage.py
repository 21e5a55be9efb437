"""Trial ``lock_garbage``: garbage, cut-short, oversized or deleted ``lock.json`` objects while a
trainer publishes; it never stops (no fencing without a real takeover) and replicas stay exact."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlsync.bucket import LocalBucket
from rlsync.errors import SyncError
from rlsync.layout import LOCK_KEY
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_lock

from ..bystanders import check_bystanders, plant_bystanders, publish_and_follow
from ..invariants import Ledger, TrialResult, check_verified
from ..toy import SHARD_BYTES, toy_master, toy_step

DEFAULT_TRIALS = 20

GARBAGE = ["empty", "bytes", "cut-short-own", "json-array", "wrong-types", "deep-nesting", "oversized", "deleted",
           "float-epoch"]  # fmt: skip


def _garbage(kind: str, own: bytes, rng: random.Random) -> bytes | None:
    """The hostile lock object of ``kind`` (``None``: delete the lock)."""
    return {
        "empty": b"",
        "bytes": rng.randbytes(rng.randint(1, 300)),
        "cut-short-own": own[: rng.randrange(len(own))],
        "json-array": b"[1, 2, 3]",
        "wrong-types": json.dumps({"owner": 7, "epoch": "1", "heartbeat": None}).encode(),
        "deep-nesting": b"{" + b'"a":{' * 20_000 + b"}" * 20_001,
        "oversized": b" " * (65 * 1024) + b"{}",
        "deleted": None,
        "float-epoch": json.dumps({"owner": "x", "epoch": 1.5, "heartbeat": 1e300}).encode(),
    }[kind]


def trial_lock_garbage(rng: random.Random, workdir: Path) -> TrialResult:
    """Between publishes, write hostile lock objects; every publish and heartbeat still succeeds."""
    result = TrialResult("lock_garbage")
    bucket = LocalBucket(workdir / "bucket")
    before = plant_bystanders(bucket, rng)
    ledger = Ledger(result)
    pub = Publisher(bucket, policy=FixedInterval(rng.randint(2, 5)), max_shard_bytes=SHARD_BYTES, owner="soak")
    follower = Subscriber(bucket)
    master = toy_master(rng.randrange(1000))
    for step in range(rng.randint(12, 20)):
        if step:
            toy_step(master, step)
        if step and rng.random() < 0.7:
            kind = rng.choice(GARBAGE)
            data = _garbage(kind, bucket.get(LOCK_KEY) if bucket.exists(LOCK_KEY) else b"{}", rng)
            if data is None:
                bucket.delete([LOCK_KEY])
            else:
                bucket.put(LOCK_KEY, data)
            result.faults[f"lock {kind}"] += 1
            if rng.random() < 0.3:
                try:
                    pub.heartbeat()
                except SyncError as exc:
                    result.fail(f"a heartbeat after a {kind} lock stopped the trainer: {exc}")
                    return result
        if not publish_and_follow(pub, step, master, ledger, follower):
            return result
    held, lock = read_lock(bucket), pub.ownership.lock
    result.check(held is not None and held.owner == "soak" and held.epoch == lock.epoch, f"lock not restored: {held}")
    result.check(sum(pub.refused.values()) <= sum(result.faults.values()), "more lock refusals counted than planted")
    restarted = Publisher(bucket, owner="soak")
    restarted.resume()
    result.check(restarted.ownership.lock.epoch > lock.epoch, "a restart reused the running trainer's epoch")
    check_verified(bucket, result, "after hostile locks")
    check_bystanders(bucket, before, result)
    return result
