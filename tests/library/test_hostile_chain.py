"""Hostile objects against the trainer's side of the chain: the run lock, the pointer it takes
over and the retention it runs, the anchor policy and its control object (issue 26)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from rlsync.errors import ChainError, FencedError, FormatError
from rlsync.hashing import state_hash
from rlsync.layout import CONTROL_KEY, LOCK_KEY, POINTER_KEY
from rlsync.limits import MAX_POINTER_BYTES
from rlsync.protocol import Adaptive, FixedInterval, Publisher, Subscriber, policy_from_json, read_lock, read_manifest
from rlsync.protocol.policies.fixed import MAX_INTERVAL
from rlsync.protocol.verify import verify_bucket
from rlsync.spaces.anchor_policy import ControlledPolicy
from tests.helpers import bf16, master_state, rl_step


def _running(bucket, steps: int = 2):
    master = master_state()
    pub = Publisher(bucket, owner="trainer", policy=FixedInterval(3))
    for step in range(steps):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    return pub, master


@pytest.mark.parametrize("garbage", [b"", b"\x00\xff garbage", b'{"owner": "trainer", "epo', b"[]", b'{"owner": 1}'])
def test_garbage_or_cut_short_lock_does_not_stop_the_running_trainer(bucket, garbage):
    """Taking the lock treats garbage as no lock, so the check before a publish must not call it a takeover."""
    pub, master = _running(bucket)
    epoch = pub.ownership.lock.epoch
    bucket.put(LOCK_KEY, garbage)
    rl_step(master, 2)
    assert pub.publish(2, master).step == 2
    assert pub.refused[LOCK_KEY] == 1
    assert read_lock(bucket).owner == "trainer" and read_lock(bucket).epoch == epoch  # written again, same epoch
    pub.heartbeat()  # a heartbeat with the lock deleted restores it too
    bucket.delete([LOCK_KEY])
    pub.heartbeat()
    assert read_lock(bucket).epoch == epoch and pub.refused[LOCK_KEY] == 2
    assert verify_bucket(bucket).ok


def test_cut_short_upload_of_the_trainers_own_heartbeat_does_not_stop_it(bucket):
    pub, master = _running(bucket)
    own = bucket.get(LOCK_KEY)
    bucket.put(LOCK_KEY, own[: len(own) // 2])
    rl_step(master, 2)
    pub.publish(2, master)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.state_hash == state_hash(bf16(master))


def test_a_real_takeover_still_fences_after_a_garbage_lock(bucket):
    pub, master = _running(bucket)
    bucket.put(LOCK_KEY, b"garbage")
    other = Publisher(bucket, owner="trainer")
    other.resume()  # garbage counts as no lock: the restart takes the run
    rl_step(master, 2)
    with pytest.raises(FencedError):
        pub.publish(2, master)
    assert json.loads(bucket.get(LOCK_KEY))["epoch"] == other.ownership.lock.epoch
    assert read_lock(bucket) == other.ownership.lock
    assert POINTER_KEY and verify_bucket(bucket).ok


def test_a_restart_after_the_lock_was_deleted_takes_an_epoch_no_writer_used(bucket):
    pub, master = _running(bucket)
    bucket.delete([LOCK_KEY])
    other = Publisher(bucket, owner="trainer")
    other.resume()
    assert other.ownership.lock.epoch > pub.ownership.lock.epoch
    rl_step(master, 2)
    with pytest.raises(FencedError):
        pub.publish(2, master)


def _objects(bucket) -> dict[str, bytes]:
    return {o.key: bucket.get(o.key) for o in bucket.list("")}


@pytest.mark.parametrize(
    "victim",
    ["control/publisher.json", "lock.json", "latest.json", "checkpoints/0000000001/COMPLETE.json", "metrics/env.json",
     "scores/000000000001.json", "anchors/000000000005-e0001/model.safetensors", "anchors/000000000000-e0001/other.bin",
     "anchors/00000000000-e0001/model.safetensors", "deltas/000000000000-e00001.safetensors"],
)  # fmt: skip
def test_a_pointer_naming_other_objects_is_refused_and_nothing_is_deleted(bucket, victim):
    """A fake old anchor in the pointer names objects the publisher never wrote: neither the
    trainer taking the run over nor a replica accepts it, and retention deletes none of them."""
    pub, master = _running(bucket, steps=3)
    for key in ("control/publisher.json", "checkpoints/0000000001/COMPLETE.json", "metrics/env.json", "scores/000000000001.json"):
        bucket.put(key, b"{}")
    doc = json.loads(bucket.get(POINTER_KEY))
    fake = dict(doc["anchors"][0], step=0, files=[{"key": victim, "size": 2}])
    doc["anchors"][0]["step"] = 1 if doc["anchors"][0]["step"] == 0 else doc["anchors"][0]["step"]
    doc["anchors"].insert(0, fake)
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    before = _objects(bucket)
    with pytest.raises(FormatError, match="not a key this protocol writes|another step or epoch|not one model file"):
        Publisher(bucket, owner="trainer").resume()
    with pytest.raises(FormatError):
        Subscriber(bucket).sync()
    after = _objects(bucket)
    assert {k: v for k, v in after.items() if k != LOCK_KEY} == {k: v for k, v in before.items() if k != LOCK_KEY}


def test_a_pointer_listing_one_shard_many_times_is_refused_before_any_download(bucket):
    pub, master = _running(bucket)
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["anchors"][0]["files"] = doc["anchors"][0]["files"] * 50_000
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    sub = Subscriber(bucket)
    with pytest.raises(FormatError):
        sub.sync()
    assert sub.stats.reads == 1 and sub.stats.bytes_downloaded == len(bucket.get(POINTER_KEY))  # the pointer alone


def test_the_publishers_sweep_deletes_only_its_own_temporary_files_under_the_runs_prefixes(bucket):
    """High 6: only ``.tmp-<12 hex>`` regular files under anchors/, deltas/ and beside the pointer go."""
    past = time.time() - 7 * 3600
    swept = ["anchors/x/.tmp-0123456789ab", "deltas/.tmp-0123456789ab", ".tmp-0123456789ab"]
    kept = ["tasks/.tmp-0123456789ab", "user/data/.tmp-0123456789ab", "deltas/.tmp-notours", "anchors/.tmp-0123456789abc"]
    for key in swept + kept:
        path = bucket.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (past, past))
    folder = bucket.root / "anchors" / ".tmp-abcdefabcdef"  # a folder of that name is not one of ours either
    (folder / "keep").parent.mkdir(parents=True)
    (folder / "keep").write_bytes(b"x")
    os.utime(folder, (past, past))
    Publisher(bucket, policy=FixedInterval(1)).publish(0, master_state())  # every anchor sweeps
    assert [k for k in swept if (bucket.root / k).exists()] == []
    assert [k for k in kept if not (bucket.root / k).exists()] == [] and (folder / "keep").exists()


@pytest.mark.parametrize("doc", [{"note": "hi"}, {}, {"policy": "fixed"}, {"policy": "adaptive", "interval": 3},
                                 {"policy": "fixed", "interval": 3, "extra": 1}])  # fmt: skip
def test_a_control_object_that_is_no_policy_keeps_the_current_policy(bucket, doc):
    policy = ControlledPolicy(bucket, FixedInterval(3))
    master = master_state()
    pub = Publisher(bucket, owner="trainer", policy=policy)
    pub.publish(0, master)
    bucket.put(CONTROL_KEY, json.dumps(doc).encode())
    rl_step(master, 1)
    pub.publish(1, master)
    assert policy.policy == FixedInterval(3) and policy.refused[CONTROL_KEY] == 1


@pytest.mark.parametrize("doc", [{"policy": "fixed", "interval": 62_000}, {"policy": "adaptive", "max_catchup_ratio": 1e6}])
def test_anchor_interval_and_catchup_ratio_are_bounded(doc):
    with pytest.raises(FormatError):
        policy_from_json(json.dumps(doc).encode())
    assert MAX_INTERVAL * 300 * 8 < MAX_POINTER_BYTES  # 8 retained periods of the largest interval fit the pointer


def test_the_pointer_stays_under_its_limit_whatever_the_policy(bucket, monkeypatch):
    """An adaptive policy with tiny deltas never asks for an anchor: the publisher anchors once the
    pointer passes a quarter of its limit (scaled down here to 4 KiB to keep the test fast)."""
    monkeypatch.setattr("rlsync.protocol.writer.MAX_POINTER_BYTES", 16 * 1024)
    master = {"w": torch.zeros(4, dtype=torch.float32)}
    pub = Publisher(bucket, policy=Adaptive(100.0))
    kinds = []
    for step in range(120):
        master["w"][step % 4] += 1
        kinds.append(pub.publish(step, master).kind)
        assert len(bucket.get(POINTER_KEY)) <= 4 * 1024 + 1024
    assert kinds.count("anchor") >= 3


def test_a_replica_resyncs_at_the_next_verifiable_pointer_after_a_replayed_old_one(bucket):
    """High 1: a replay of an old pointer left replicas ``needs_resync`` until the next anchor."""
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(50))
    sub = Subscriber(bucket)
    for step in range(3):
        rl_step(master, step)
        pub.publish(step, master)
    old = bucket.get(POINTER_KEY)
    rl_step(master, 3)
    pub.publish(3, master)
    sub.sync()
    genuine = bucket.get(POINTER_KEY)
    bucket.put(POINTER_KEY, old)  # replayed for a moment
    with pytest.raises(ChainError, match="went back"):
        sub.fetch()
    assert sub.needs_resync
    bucket.put(POINTER_KEY, genuine)
    assert sub.fetch() is None and not sub.needs_resync  # the genuine pointer names exactly this state
    bucket.put(POINTER_KEY, old)
    with pytest.raises(ChainError):
        sub.fetch()
    rl_step(master, 4)
    pub.publish(4, master)  # the genuine pointer is back with a new delta, no anchor
    applied = sub.sync()
    assert [u.kind for u in applied] == ["delta"] and not sub.needs_resync
    assert sub.step == 4 and sub.state_hash == state_hash(bf16(master))


def test_a_refused_delta_is_not_downloaded_again_until_the_pointer_changes(bucket):
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(50))
    sub = Subscriber(bucket)
    pub.publish(0, master)
    sub.sync()
    rl_step(master, 1)
    pub.publish(1, master)
    key = read_manifest(bucket).deltas[-1].file.key
    bucket.put(key, b"x" * len(bucket.get(key)))
    with pytest.raises(FormatError):
        sub.fetch()
    reads = sub.stats.reads
    assert sub.fetch() is None and sub.fetch() is None
    assert sub.stats.reads == reads + 2  # the pointer only


@pytest.mark.parametrize("damage", ["dotdot", "absolute", "ghosts", "size", "garbage", "metadata"])
def test_a_sharded_anchors_index_is_validated_by_replicas_and_verify(bucket, damage):
    """Medium 1: paths with ``../``, absolute paths, ghost entries, a wrong size or garbage in
    ``model.safetensors.index.json`` were accepted, and ``verify`` printed OK."""
    master = master_state()
    Publisher(bucket, max_shard_bytes=4096).publish(0, master)
    manifest = read_manifest(bucket)
    entry = manifest.anchors[0].files[-1]
    assert entry.key.endswith("model.safetensors.index.json") and len(manifest.anchors[0].files) > 2
    doc = json.loads(bucket.get(entry.key))
    name = next(iter(doc["weight_map"]))
    if damage == "dotdot":
        doc["weight_map"][name] = "../../lock.json"
    elif damage == "absolute":
        doc["weight_map"][name] = "/etc/passwd"
    elif damage == "ghosts":
        doc["weight_map"].update({f"ghost.{i}": "model-00001-of-00002.safetensors" for i in range(100_000)})
    elif damage == "size":
        doc["metadata"]["total_size"] += 1
    elif damage == "metadata":
        doc["metadata"]["step"] = "7"
    data = b"\x00garbage" if damage == "garbage" else json.dumps(doc).encode()
    bucket.put(entry.key, data)
    pointer = json.loads(bucket.get(POINTER_KEY))
    pointer["anchors"][0]["files"][-1]["size"] = len(data)
    bucket.put(POINTER_KEY, json.dumps(pointer).encode())
    sub = Subscriber(bucket)
    with pytest.raises(FormatError, match="index"):
        sub.sync()
    assert sub.step is None
    assert not verify_bucket(bucket).ok


@pytest.mark.parametrize("kind", ["delta", "anchor"])
def test_an_update_larger_than_the_model_can_need_is_refused_before_any_download(bucket, kind):
    """Medium 4: total bytes are capped by the model's size before any download."""
    pub, master = _running(bucket)
    sub = Subscriber(bucket)
    sub.sync()
    rl_step(master, 2)
    pub.publish(2, master)
    doc = json.loads(bucket.get(POINTER_KEY))
    if kind == "delta":
        doc["deltas"][-1]["file"]["size"] = 10 << 30
    else:
        doc["anchors"].append(dict(doc["anchors"][0], step=3, files=[{"key": "anchors/000000000003-e0001/model.safetensors", "size": 10 << 30}]))
        doc["deltas"] = [d for d in doc["deltas"] if d["step"] < 2]
        doc["step"] = 3
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    reads = sub.stats.reads
    with pytest.raises(FormatError, match="more than the model"):
        sub.fetch()
    assert sub.stats.reads == reads + 1 and sub.stats.refused == 1  # the pointer alone


def test_a_restart_validates_every_pointer_entry_not_only_the_chain_it_replays(bucket):
    """Critical 4: a lie in an entry the resume does not replay (an old companion delta) is still refused."""
    pub, master = _running(bucket, steps=5)  # anchors at 0 and 3: delta 1 is off the replayed chain
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["deltas"][0]["file"]["size"] = 10 << 30
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    with pytest.raises(FormatError, match="refusing to take it over"):
        Publisher(bucket, owner="trainer").resume()


@pytest.mark.parametrize(
    "kind", ["lock_garbage", "pointer_entries", "checkpoints", "hostile_positions", "sharded_checkpoints", "hostile_values"]
)
def test_soak_trials_of_the_new_hostile_classes_are_clean(tmp_path, kind):
    """One seeded trial of each soak class added for issues 26 and 41 (a few seconds each)."""
    import random

    from testing.soak.kinds import TRIALS

    result = TRIALS[kind](random.Random(1), tmp_path)
    assert not result.violations and result.lost == 0, result.violations
    assert sum(result.faults.values()) >= 1 and result.checks > 0


@pytest.mark.parametrize("chain", ["weights", "adapter"])
def test_a_joining_subscriber_refuses_an_anchor_larger_than_its_model_before_any_download(bucket, chain):
    """Issue 33 item 4: a subscriber with no state yet (joining, restarting, a LoRA follower's first version)
    took an anchor of any size the pointer claimed (2.0 GiB of RSS for a 0.5 MB model before the hash
    refused it); bounded by the model it serves, it refuses the claim from the pointer alone."""
    from rlsync.adapters import AdapterChain, LoraSpec, adapter_bucket, adapter_publisher, adapter_subscriber

    master = master_state()
    model_bytes = sum(t.numel() * 2 for t in master.values())  # bf16
    if chain == "weights":
        target, pub = bucket, Publisher(bucket, owner="trainer", policy=FixedInterval(3))
        sub = Subscriber(bucket, max_state_bytes=model_bytes)
    else:
        target = adapter_bucket(bucket)
        pub = adapter_publisher(bucket, AdapterChain("tiny", "b" * 64, LoraSpec()), policy=FixedInterval(3))
        sub = adapter_subscriber(bucket, "b" * 64, max_state_bytes=model_bytes)
    pub.publish(0, master)
    doc = json.loads(target.get(POINTER_KEY))
    doc["anchors"][0]["files"][0]["size"] = 2 << 30
    target.put(POINTER_KEY, json.dumps(doc).encode())
    with pytest.raises(FormatError, match="more than the model"):
        sub.fetch()
    assert sub.stats.reads == 1 and sub.stats.bytes_downloaded == len(target.get(POINTER_KEY)) and sub.stats.refused == 1
