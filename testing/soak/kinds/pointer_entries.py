"""Trial ``pointer_entries``: pointers whose entries name objects the publisher never wrote
(other roles' objects, the lock, the pointer, other steps' or epochs' keys), list one shard many
times or promise huge sizes. Replicas refuse them, a restarting trainer refuses to take them over,
the running trainer rewrites the pointer, and retention deletes nothing outside its own keys."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rlsync.bucket import LocalBucket
from rlsync.errors import SyncError
from rlsync.layout import POINTER_KEY
from rlsync.protocol import FixedInterval, Publisher, Subscriber

from ..bystanders import BYSTANDER_KEYS, check_bystanders, plant_bystanders, publish_and_follow
from ..invariants import Ledger, TrialResult, check_verified, checked_sync
from ..toy import SHARD_BYTES, toy_master, toy_step

DEFAULT_TRIALS = 20

EDITS = ["fake-anchor-bystander", "fake-anchor-lock", "fake-anchor-pointer", "fake-delta-other-step",
         "delta-other-epoch", "duplicate-shard", "huge-size", "anchor-other-folder", "dotted-key"]  # fmt: skip


def _edit(doc: dict, kind: str, rng: random.Random) -> None:
    """Make ``doc`` (a pointer) hostile in the way ``kind`` names."""
    first = doc["anchors"][0]
    fake_step = max(0, first["step"] - 1)
    victim = rng.choice([*BYSTANDER_KEYS[:5], "lock.json", "latest.json"])
    if kind.startswith("fake-anchor"):
        key = {"fake-anchor-lock": "lock.json", "fake-anchor-pointer": "latest.json"}.get(kind, victim)
        if first["step"] == 0:
            first["step"] = 1  # make room for the fake older anchor
        doc["anchors"].insert(0, {"step": fake_step, "state_hash": first["state_hash"], "files": [{"key": key, "size": 2}]})
    elif kind == "fake-delta-other-step" and doc["deltas"]:
        doc["deltas"][-1]["file"]["key"] = "deltas/000000999999-e0001.safetensors"
    elif kind == "delta-other-epoch" and doc["deltas"]:
        doc["deltas"][-1]["file"]["key"] = re.sub(r"-e\d+", "-e9999", doc["deltas"][-1]["file"]["key"])
    elif kind == "duplicate-shard":
        doc["anchors"][-1]["files"] = doc["anchors"][-1]["files"][:1] * rng.randint(2, 5000)
    elif kind == "huge-size":
        (doc["deltas"][-1]["file"] if doc["deltas"] else doc["anchors"][-1]["files"][0])["size"] = 10 << 30
    elif kind == "anchor-other-folder":
        files = doc["anchors"][-1]["files"]
        files[0]["key"] = files[0]["key"].replace(f"{doc['anchors'][-1]['step']:012d}", f"{doc['anchors'][-1]['step'] + 1:012d}")
    else:  # dotted-key
        doc["anchors"][-1]["files"][0]["key"] = f"anchors/{victim}"


def trial_pointer_entries(rng: random.Random, workdir: Path) -> TrialResult:
    """Plant hostile pointers between publishes; check every reader's refusal and the bystanders."""
    result = TrialResult("pointer_entries")
    bucket = LocalBucket(workdir / "bucket")
    before = plant_bystanders(bucket, rng)
    ledger = Ledger(result)
    interval = rng.randint(2, 4)
    pub = Publisher(bucket, policy=FixedInterval(interval), keep_anchors=2, max_shard_bytes=SHARD_BYTES, owner="soak")
    follower = Subscriber(bucket)
    master = toy_master(rng.randrange(1000))
    for step in range(rng.randint(3 * interval, 5 * interval)):
        if step:
            toy_step(master, step)
        if step > 1 and rng.random() < 0.6:
            kind = rng.choice(EDITS)
            genuine = bucket.get(POINTER_KEY)
            doc = json.loads(genuine)
            _edit(doc, kind, rng)
            hostile = json.dumps(doc).encode()
            if hostile == genuine:
                continue
            bucket.put(POINTER_KEY, hostile)
            result.faults[f"pointer {kind}"] += 1
            state = (follower.step, follower.state_hash)
            checked_sync(follower, ledger, f"follower on a {kind} pointer")
            result.check((follower.step, follower.state_hash) == state, f"a {kind} pointer moved the follower")
            try:
                Publisher(bucket, owner="soak").resume()  # a restart of the same trainer
                result.fail(f"a restarting trainer took over a {kind} pointer")
            except SyncError as exc:  # malformed (FormatError), or names an object that is not there (ChainError)
                result.notes[f"restart refused: {type(exc).__name__}"] += 1
            bucket.put(POINTER_KEY, genuine)  # the refused restart took the lock; the next restart takes it over
            pub = Publisher(bucket, policy=FixedInterval(interval), keep_anchors=2, max_shard_bytes=SHARD_BYTES, owner="soak")
            pub.resume()
            if rng.random() < 0.5:  # the running trainer meets the hostile pointer itself, and rewrites it
                bucket.put(POINTER_KEY, hostile)
        if not publish_and_follow(pub, step, master, ledger, follower):
            return result
    late = Subscriber(bucket)
    checked_sync(late, ledger, "late joiner")
    result.check(late.step == pub.step, f"late joiner at {late.step}, newest {pub.step}")
    check_verified(bucket, result, "after hostile pointers")
    check_bystanders(bucket, before, result)
    return result
