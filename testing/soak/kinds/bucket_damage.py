"""Trial ``bucket_damage``: deleted, flipped, truncated and replayed objects; subscribers refuse and recover at the next anchor."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from rlsync.bucket import LocalBucket
from rlsync.layout import POINTER_KEY
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest

from ..invariants import Ledger, TrialResult, checked_sync
from ..toy import SHARD_BYTES, toy_master, toy_step

DEFAULT_TRIALS = 30

DAMAGE = ["delete-delta", "flip-delta", "truncate-delta", "replay-old-delta", "pointer-missing-delta",
          "delete-anchor-shard", "flip-anchor-shard", "truncate-anchor-shard", "pointer-missing-anchor", "garble-pointer"]  # fmt: skip


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out))
        out[i] ^= rng.randint(1, 255)
    return bytes(out)


def _edit_pointer(bucket: LocalBucket, edit: Callable[[dict], None]) -> None:
    doc = json.loads(bucket.get(POINTER_KEY))
    edit(doc)
    bucket.put(POINTER_KEY, json.dumps(doc).encode())


def trial_bucket_damage(rng: random.Random, workdir: Path, damage: str | None = None) -> TrialResult:
    """Damage one object; followers refuse it, keep their state, and recover at the next anchor."""
    result = TrialResult("bucket_damage")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    interval = rng.randint(3, 6)
    pub = Publisher(
        bucket,
        policy=FixedInterval(interval),
        keep_anchors=3,
        max_shard_bytes=SHARD_BYTES,
        owner="soak",
    )
    master = toy_master(rng.randrange(1000))
    follower = Subscriber(bucket)
    step = 0

    def publish_next() -> None:
        nonlocal step
        if step:
            toy_step(master, step)
        rec = pub.publish(step, master)
        ledger.record(rec.step, rec.state_hash, "publisher")
        step += 1

    for _ in range(rng.randint(2, 2 * interval)):
        publish_next()
        checked_sync(follower, ledger, "follower")
    damage = damage or rng.choice(DAMAGE)
    manifest = read_manifest(bucket)
    assert manifest is not None
    if "delta" in damage:  # make sure a delta exists past the follower
        while manifest.delta_after(follower.step) is None:
            publish_next()
            manifest = read_manifest(bucket)
            if manifest.newest_anchor.step == manifest.step:
                checked_sync(follower, ledger, "follower")
        target = manifest.delta_after(follower.step)
        key = target.file.key
    else:
        publish_next()  # one version the follower has not applied yet
        manifest = read_manifest(bucket)
        shards = manifest.newest_anchor.files
        key = rng.choice(shards).key
    data = bucket.get(key)
    if damage.startswith("delete"):
        bucket.delete([key])
    elif damage.startswith("flip"):
        bucket.put(key, _flip(data, rng))
    elif damage.startswith("truncate"):
        bucket.put(key, data[: rng.randrange(len(data))])
    elif damage == "replay-old-delta":
        older = [d for d in manifest.deltas if d.step < target.step]
        if older:
            old = bucket.get(rng.choice(older).file.key)
        else:  # no older delta retained: replay the newest one over this one instead
            old = (
                bucket.get(manifest.deltas[-1].file.key)
                if manifest.deltas[-1].step != target.step
                else _flip(data, rng)
            )
        bucket.put(key, old)
        _edit_pointer(
            bucket, lambda doc: [d["file"].update(size=len(old)) for d in doc["deltas"] if d["file"]["key"] == key]
        )
    elif damage == "pointer-missing-delta":
        _edit_pointer(
            bucket,
            lambda doc: [
                d["file"].update(key="deltas/999999999999.safetensors")
                for d in doc["deltas"]
                if d["file"]["key"] == key
            ],
        )
    elif damage == "pointer-missing-anchor":
        _edit_pointer(bucket, lambda doc: [f.update(key=f"{f['key'].rsplit('/', 1)[0]}/missing.safetensors")
                                           for a in doc["anchors"] for f in a["files"] if f["key"] == key])  # fmt: skip
    elif damage == "garble-pointer":
        raw = bucket.get(POINTER_KEY)
        bucket.put(POINTER_KEY, rng.choice([raw[: rng.randrange(len(raw))], _flip(raw, rng), b"\x00" * 64]))
    result.faults[damage] += 1
    refused = checked_sync(follower, ledger, "follower after damage")
    newcomer = Subscriber(bucket)
    refused += checked_sync(newcomer, ledger, "newcomer after damage")
    if not refused:  # e.g. flipped padding in a header, or a pointer edit that kept it valid
        result.notes["damage no reader noticed (states still exact)"] += 1
    # the publisher goes on; past the next anchor everyone is bit-exact again
    target_step = step + interval + 1
    while step <= target_step:
        publish_next()
    for sub, name in ((follower, "follower"), (newcomer, "newcomer"), (Subscriber(bucket), "late joiner")):
        checked_sync(sub, ledger, name)
        result.check(sub.step == step - 1, f"{name} ended at {sub.step} after {damage}, newest is {step - 1}")
    return result
