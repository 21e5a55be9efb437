"""Numbers that leave no room (issue 41, finding 2): a lock epoch or a pointer's epoch or step near the
largest a key holds locked every trainer out for good, even a new run. Such an object is refused and
counted like a garbage lock or an unreadable pointer, the trainer takes the lock and starts, and no
role writes a key readers refuse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlsync.errors import SyncError
from rlsync.hashing import state_hash
from rlsync.layout import (
    ANCHOR_FILE,
    DELTA_FILE,
    LOCK_KEY,
    MAX_BASE_EPOCH,
    MAX_BASE_STEP,
    MAX_EPOCH,
    MAX_STEP,
    POINTER_KEY,
    anchor_folder,
    delta_key,
    delta_part_key,
)
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_lock, read_manifest
from rlsync.protocol.manifest import key_epoch
from tests.helpers import bf16, master_state, rl_step


def _run(bucket, versions: int = 3):
    master = master_state()
    pub = Publisher(bucket, owner="trainer", policy=FixedInterval(10), run_id="first-run")
    for step in range(versions):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    return master


def _start_over(bucket) -> tuple[Publisher, dict]:
    """A restarted trainer's new run: it takes the lock and publishes its first two versions."""
    fresh = master_state(seed=7)
    pub = Publisher(bucket, owner="trainer", policy=FixedInterval(10), new_run=True)
    pub.start_new_run()
    pub.publish(pub.next_step, fresh)
    rl_step(fresh, 99)
    pub.publish(pub.next_step, fresh)
    return pub, fresh


@pytest.mark.parametrize("epoch", [MAX_EPOCH, MAX_EPOCH - 1, MAX_BASE_EPOCH + 1])
def test_a_lock_epoch_that_leaves_no_room_is_refused_like_a_garbage_lock(bucket, epoch):
    """(a) ``{"epoch": 2**53-1}`` made a restarted trainer fail with "no run-lock epoch is left"."""
    _run(bucket)
    bucket.put(LOCK_KEY, json.dumps({"owner": "trainer", "epoch": epoch, "heartbeat": 0}).encode())
    pub, _ = _start_over(bucket)
    assert pub.refused[LOCK_KEY] == 1 and read_lock(bucket) == pub.ownership.lock
    assert pub.ownership.lock.epoch <= MAX_BASE_EPOCH + 1
    again, _ = _start_over(bucket)  # and the next restart too
    assert again.ownership.lock.epoch == pub.ownership.lock.epoch + 1 and again.refused[LOCK_KEY] == 0


def test_a_trainer_that_reached_the_base_epoch_restarts_under_the_clock(bucket):
    _run(bucket)
    bucket.put(LOCK_KEY, json.dumps({"owner": "trainer", "epoch": MAX_BASE_EPOCH, "heartbeat": 0}).encode())
    pub, _ = _start_over(bucket)
    assert pub.ownership.lock.epoch == MAX_BASE_EPOCH + 1 and not pub.refused
    again, _ = _start_over(bucket)
    assert 0 < again.ownership.lock.epoch < MAX_BASE_EPOCH and again.refused[LOCK_KEY] == 1


@pytest.mark.parametrize("epoch", ["9999999999999999", str(MAX_EPOCH), str(MAX_BASE_EPOCH + 1)])
@pytest.mark.parametrize("lock", ["deleted", "kept"])
def test_a_pointer_epoch_that_leaves_no_room_is_refused_and_a_new_run_starts(bucket, epoch, lock):
    """(b) A pointer whose anchor key has a 16-digit epoch made a new run fail, with no lock file at all
    (``highest_epoch`` trusted it)."""
    _run(bucket)
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["anchors"][0]["files"][0]["key"] = f"anchors/000000000000-e{epoch}/model.safetensors"
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    if lock == "deleted":
        bucket.delete([LOCK_KEY])
    pub, fresh = _start_over(bucket)
    assert pub.refused[POINTER_KEY] >= 1 and pub.ownership.lock.epoch == 2  # above the chain's own epoch 1
    assert read_manifest(bucket).step == 4 and read_lock(bucket) == pub.ownership.lock


@pytest.mark.parametrize("step", [MAX_STEP, MAX_BASE_STEP + 1])
def test_a_pointer_step_that_leaves_no_room_is_refused_and_the_new_run_follows_the_bucket(bucket, step):
    """(c) A pointer at 10**20-1 then a new run "published" 10**20: 21-digit keys every replica refused, then
    ``FormatError`` at the next publish. The new run now follows the newest version whose keys the bucket
    holds, so a replica at that version follows it bit-exactly."""
    _run(bucket)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 2
    doc = json.loads(bucket.get(POINTER_KEY))
    key = f"anchors/{step:012d}-e0001/model.safetensors"
    doc.update(step=step, deltas=[], anchors=[dict(doc["anchors"][0], step=step, files=[{"key": key, "size": 10}])])
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    bucket.put(key, b"0123456789")  # its key listed too: past the base, it is not followed
    pub, fresh = _start_over(bucket)
    assert pub.refused[POINTER_KEY] == 1
    manifest = read_manifest(bucket)
    assert [a.step for a in manifest.anchors] == [3] and manifest.step == 4  # after the replicas' version 2
    sub.sync()
    assert (sub.step, sub.state_hash) == (4, state_hash(bf16(fresh)))


def test_a_publish_past_the_largest_version_is_refused_before_anything_is_written(bucket):
    master = master_state()
    pub = Publisher(bucket, owner="trainer")
    with pytest.raises(SyncError, match="past the largest"):
        pub.publish(MAX_STEP + 1, master)
    assert read_manifest(bucket) is None and not [o.key for o in bucket.list("anchors/")]


@pytest.mark.parametrize("step, epoch", [(MAX_STEP + 1, 1), (0, MAX_EPOCH + 1), (-1, 1), (1, -1)])
def test_no_key_is_built_that_readers_refuse(step, epoch):
    for build in (anchor_folder, delta_key, lambda s, e: delta_part_key(s, e, 0, 2)):
        with pytest.raises(ValueError, match="past the keys"):
            build(step, epoch)


@given(step=st.integers(0, MAX_STEP), epoch=st.integers(0, MAX_EPOCH))
def test_every_key_a_trainer_writes_is_one_readers_take(step, epoch):
    for key, grammar in ((f"{anchor_folder(step, epoch)}/model.safetensors", ANCHOR_FILE), (delta_key(step, epoch), DELTA_FILE),
                         (delta_part_key(step, epoch, 0, 2), DELTA_FILE)):  # fmt: skip
        match = grammar.fullmatch(key)
        assert match is not None and int(match.group(1)) == step and key_epoch(key) == epoch
