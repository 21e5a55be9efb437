"""Trial ``hostile_values``: the hostile writers of issue 41 between publishes. Metrics and status objects
with values of the wrong JSON kind in typed fields, status objects past their size or in a flood, a lock
epoch, a pointer epoch or a pointer step that leaves no room, and ``RateLimit`` headers with numbers too
large to use. Every reader goes on (the panels' snapshot, a restarted role's metrics log, the meter), a
snapshot's reads stay bounded, a restarted trainer takes the lock and publishes the next version, and the
follower stays on published weights and reaches the newest."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rlsync.bucket import LocalBucket
from rlsync.bucket.budget import BudgetConfig, RequestClass, RequestMeter
from rlsync.errors import SyncError
from rlsync import layout
from rlsync.layout import LOCK_KEY, POINTER_KEY, metrics_key, status_key
from rlsync.limits import MAX_STATUS_BYTES, MAX_STATUS_OBJECTS
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.retry import retry_after_seconds
from rlsync.spaces.metrics import EnvMetrics, MetricsLog, TrainerMetrics, read_metrics
from rlsync.spaces.snapshots import read_snapshot

from ...faulty import ReadCountingBucket
from ..bystanders import check_bystanders, plant_bystanders, publish_and_follow
from ..invariants import Ledger, TrialResult, check_verified, checked_sync
from ..toy import SHARD_BYTES, toy_master, toy_step

DEFAULT_TRIALS = 6

#: Hostile writes that leave the weights chain alone (several per step) and those that restart the trainer.
READERS = ["metrics-wrong-kind", "status-wrong-kind", "status-oversized", "status-flood", "ratelimit-unusable"]
RESTARTS = ["lock-no-room", "pointer-epoch-no-room", "pointer-step-no-room"]
#: Values of every JSON kind but the one a field wants.
WRONG = [["delta"], {}, [], {"a": 1}, True, None, 1e308, -1, "x" * 2000, [[{}]], 1.5]
#: Snapshot reads besides the status objects: the two metrics objects, the two pointers, the control object.
OTHER_READS = 5


def _wrong(rng: random.Random) -> object:
    return rng.choice(WRONG)


def _metrics(rng: random.Random) -> tuple[str, dict]:
    if rng.random() < 0.5:
        row = {"kind": _wrong(rng), "version": _wrong(rng)} if rng.random() < 0.5 else {"kind": "delta", "version": 1, "nbytes": _wrong(rng)}
        return metrics_key("trainer"), {"format_version": 1, "rows": [row, _wrong(rng)], "version": _wrong(rng),
                                        "flow": {"pacing": _wrong(rng)}, "hub": {"tier": _wrong(rng)}}  # fmt: skip
    return metrics_key("env"), {"format_version": 1, "rows": [{"version": _wrong(rng), "mean_reward": _wrong(rng)}],
                                "pacing": _wrong(rng), "by_type": {"a": {"count": _wrong(rng)}}}  # fmt: skip


def _status(rng: random.Random) -> dict:
    return {"format_version": 1, "replica_id": rng.choice(["r0", _wrong(rng)]), "recent_syncs": [{"step": 1, "kind": _wrong(rng)}],
            "hub": {"tier": "free", "by_kind": _wrong(rng)}, "applied_step": _wrong(rng)}  # fmt: skip


def _reader_fault(kind: str, bucket: LocalBucket, rng: random.Random, result: TrialResult) -> None:
    """Write one hostile object (or answer one header) that only readers meet, and check the readers."""
    if kind == "metrics-wrong-kind":
        key, doc = _metrics(rng)
        bucket.put(key, json.dumps(doc).encode())
    elif kind == "status-wrong-kind":
        bucket.put(status_key(f"w{rng.randrange(8)}"), json.dumps(_status(rng)).encode())
    elif kind == "status-oversized":
        big = json.dumps({"replica_id": "big", "engine": "x" * rng.randint(MAX_STATUS_BYTES, 4 * MAX_STATUS_BYTES)}).encode()
        for i in range(rng.randint(1, 15)):  # one upload, many keys
            bucket.put(status_key(f"big{i}"), big)
    elif kind == "status-flood":
        junk = json.dumps({"replica_id": "a", "engine": "x" * rng.randint(100, MAX_STATUS_BYTES - 100)}).encode()
        for i in range(rng.randint(8, MAX_STATUS_OBJECTS + 16)):  # the keys add up over the trial
            bucket.put(status_key(f"a{i:04d}"), junk)
    else:
        _ratelimit(rng, result)
        return
    try:
        MetricsLog(bucket, rng.choice([TrainerMetrics, EnvMetrics]))  # a restarted role reads its history first
        read_metrics(bucket, TrainerMetrics)
        counting = ReadCountingBucket(bucket)
        read_snapshot(counting)
    except Exception as exc:  # noqa: BLE001 - any exception out of a reader is the violation
        result.fail(f"a reader raised on a {kind} object: {type(exc).__name__}: {exc}")
        return
    bound = OTHER_READS + MAX_STATUS_OBJECTS
    result.check(counting.reads <= bound and counting.bytes <= (2 << 20) + MAX_STATUS_OBJECTS * MAX_STATUS_BYTES,
                 f"a snapshot read {counting.reads} objects, {counting.bytes} bytes after a {kind} object")  # fmt: skip


def _ratelimit(rng: random.Random, result: TrialResult) -> None:
    huge = "9" * rng.choice([30, 400, 5000])
    headers = rng.choice([
        {"RateLimit": f'"api";r=0;t={huge}'},
        {"RateLimit": '"api";r=0;t=5', "RateLimit-Policy": f'"fixed window";"api";q={huge};w=300'},
        {"RateLimit": f'"api";r={huge};t=5', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'},
    ])  # fmt: skip
    clock = [0.0]
    meter = RequestMeter(BudgetConfig(window_s=30.0), clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    try:
        wait = retry_after_seconds(headers)
        meter.record("GET", "/api/buckets/a/b/tree", rng.choice([429, 503]), headers)
        waited = meter.acquire(RequestClass.API)
    except Exception as exc:  # noqa: BLE001 - the request would have failed instead of being retried
        result.fail(f"a RateLimit header {headers} raised {type(exc).__name__}")
        return
    result.check(wait is None and waited <= 1.0, f"a RateLimit header {headers} was used: {wait}, {waited}")


def _restart_fault(kind: str, bucket: LocalBucket, rng: random.Random, result: TrialResult, follower: Subscriber, ledger: Ledger) -> Publisher:
    """Plant a number that leaves no room, then restart the trainer (a new run when the pointer is hostile)."""
    genuine = json.loads(bucket.get(POINTER_KEY))
    if kind == "lock-no-room":
        epoch = rng.choice([layout.MAX_EPOCH, layout.MAX_EPOCH - rng.randrange(1000), layout.MAX_BASE_EPOCH + 1 + rng.randrange(1000)])
        bucket.put(LOCK_KEY, json.dumps({"owner": rng.choice(["soak", "other"]), "epoch": epoch, "heartbeat": 0}).encode())
    elif kind == "pointer-epoch-no-room":
        epoch = rng.choice(["9999999999999999", str(layout.MAX_EPOCH), str(layout.MAX_BASE_EPOCH + 1)])
        for file in genuine["anchors"][0]["files"]:  # every file of a version under one epoch: the pointer still parses
            file["key"] = re.sub(r"-e\d+", f"-e{epoch}", file["key"], count=1)
        bucket.put(POINTER_KEY, json.dumps(genuine).encode())
    else:
        step = rng.choice([layout.MAX_STEP, layout.MAX_BASE_STEP + 1 + rng.randrange(10**6)])
        key = f"anchors/{step:012d}-e0001/model.safetensors"
        genuine.update(step=step, deltas=[], anchors=[dict(genuine["anchors"][0], step=step, files=[{"key": key, "size": 10}])])
        bucket.put(POINTER_KEY, json.dumps(genuine).encode())
        bucket.put(key, b"0123456789")
    if kind != "lock-no-room":
        state = (follower.step, follower.state_hash)
        checked_sync(follower, ledger, f"follower on a {kind} pointer")
        result.check((follower.step, follower.state_hash) == state, f"a {kind} pointer moved the follower")
    pub = _publisher(bucket, rng, new_run=kind != "lock-no-room")
    if kind == "lock-no-room":
        pub.resume()
    else:
        pub.start_new_run()
    result.check(sum(pub.refused.values()) >= 1, f"a {kind} object was not counted")
    return pub


def _publisher(bucket: LocalBucket, rng: random.Random, new_run: bool = False) -> Publisher:
    return Publisher(bucket, policy=FixedInterval(rng.randint(2, 4)), max_shard_bytes=SHARD_BYTES, owner="soak", new_run=new_run)


def trial_hostile_values(rng: random.Random, workdir: Path) -> TrialResult:
    """Between publishes, several hostile values for the readers, and now and then one that restarts the trainer."""
    result, bucket = TrialResult("hostile_values"), LocalBucket(workdir / "bucket")
    before, ledger = plant_bystanders(bucket, rng), Ledger(result)
    pub, follower, master = _publisher(bucket, rng), Subscriber(bucket), toy_master(rng.randrange(1000))
    for step in range(rng.randint(12, 20)):
        if step:
            toy_step(master, step)
        for _ in range(rng.randint(1, 4) if step else 0):
            kind = rng.choice(READERS)
            _reader_fault(kind, bucket, rng, result)
            result.faults[kind] += 1
        if step > 1 and rng.random() < 0.4:
            kind = rng.choice(RESTARTS)
            try:
                pub = _restart_fault(kind, bucket, rng, result, follower, ledger)
            except SyncError as exc:
                result.fail(f"a trainer restarted after a {kind} object did not start: {type(exc).__name__}: {exc}")
                return result
            result.faults[kind] += 1
            result.check(pub.next_step == step, f"after a {kind} object the trainer's next version is {pub.next_step}, not {step}")
        if not publish_and_follow(pub, step, master, ledger, follower):
            return result
    result.check(follower.step == pub.step, f"the follower is stuck at {follower.step}, newest {pub.step}")
    late = Subscriber(bucket)
    checked_sync(late, ledger, "late joiner")
    result.check(late.step == pub.step, f"late joiner at {late.step}, newest {pub.step}")
    ledger.settle()
    check_verified(bucket, result, "after hostile values")
    check_bystanders(bucket, {k: v for k, v in before.items() if not k.startswith("metrics/")}, result)  # the hostile writer's
    return result
