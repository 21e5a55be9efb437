"""Nothing lost, nothing half-applied: a fast subset of ``testing/soak/``, races of two
trainers made deterministic, and hostile objects read from the bucket.

The soak trials run here with fixed seeds and, where a trial kills a process, one test per kill
point (so every point is exercised on every run). Each trial checks its invariants itself (a
replica's recomputed whole-state hash always equals the published hash of its step, no version
reused, skipped or lost, no named object overwritten, ``verify_bucket`` passes) and reports
violations; the tests also assert that the fault really was injected.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch

from rlsync.bucket import LocalBucket
from rlsync.errors import ChainError, FencedError, FormatError
from rlsync.hashing import state_hash
from rlsync.layout import CONTROL_KEY, LOCK_KEY, POINTER_KEY, check_id, replica_of, rollout_key, score_key, task_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket
from rlsync.spaces.anchor_policy import ControlledPolicy
from rlsync.spaces.exchange import Sample, get_json, list_batches, read_samples, write_samples
from testing.soak.invariants import TrialResult
from testing.soak.kinds.apply_interrupt import trial_apply_interrupt
from testing.soak.kinds.bucket_damage import DAMAGE, trial_bucket_damage
from testing.soak.kinds.flaky_storage import trial_flaky_storage
from testing.soak.kinds.publisher_kill import trial_publisher_kill
from testing.soak.kinds.subscriber_kill import trial_subscriber_kill
from testing.soak.kinds.two_trainers import trial_two_trainers
from tests.helpers import bf16, files_under, master_state, rl_step


def assert_clean(result: TrialResult, fault: str | None = None) -> None:
    assert not result.violations, result.violations
    assert result.lost == 0
    assert result.checks > 0
    if fault is not None:
        assert result.faults[fault] >= 1, result.faults


# ---------------------------------------------------------------------------
# the soak trials, a few of each kind


@pytest.mark.parametrize("mode, nth", [("lock", 1), ("mid-delta", 2), ("before-pointer", 3), ("mid-shard", 2),
                                       ("after-shard", 3), ("after-pointer", 4), ("mid-delete", 1)])  # fmt: skip
def test_publisher_killed_inside_publish_resumes_exactly(tmp_path, mode, nth):
    result = trial_publisher_kill(random.Random(nth), tmp_path, kills=[(mode, nth), (mode, nth + 1)])
    assert_clean(result, f"kill -9 {mode}")


def test_publisher_killed_at_random_moments_resumes_exactly(tmp_path):
    result = trial_publisher_kill(random.Random(3), tmp_path, kills=[("random", None), ("before-pointer", 1)])
    assert_clean(result, "kill -9 before-pointer")


@pytest.mark.parametrize("mode, nth", [("mid-download", 2), ("before-apply", 2), ("mid-apply", 11)])
def test_subscriber_killed_mid_sync_comes_back_bit_exact(tmp_path, mode, nth):
    result = trial_subscriber_kill(random.Random(nth), tmp_path, kills=[(mode, nth)])
    assert_clean(result, f"kill -9 {mode}")


@pytest.mark.parametrize("seed", [0, 1])
def test_apply_interrupted_mid_patch_rolls_back_exactly(tmp_path, seed):
    result = trial_apply_interrupt(random.Random(seed), tmp_path)
    assert_clean(result)
    assert sum(result.faults.values()) >= 2


@pytest.mark.parametrize("damage", DAMAGE)
def test_bucket_damage_is_refused_and_healed_by_the_next_anchor(tmp_path, damage):
    result = trial_bucket_damage(random.Random(7), tmp_path, damage=damage)
    assert_clean(result, damage)


def test_flaky_storage_converges_bit_exactly(tmp_path):
    result = trial_flaky_storage(random.Random(11), tmp_path)
    assert_clean(result)
    for kind in ("error", "throttle", "truncate"):
        assert result.faults[f"flaky: {kind}"] > 0, result.faults


def test_two_trainers_refused_then_fenced(tmp_path):
    result = trial_two_trainers(random.Random(5), tmp_path)
    assert_clean(result, "second trainer started")


# ---------------------------------------------------------------------------
# two trainers, with the racy moments made deterministic


class _Armed(LocalBucket):
    """A local bucket that runs a callback once, just before writing the first key with a given prefix."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.armed: tuple[str, object] | None = None

    def arm(self, prefix: str, callback) -> None:
        self.armed = (prefix, callback)

    def put(self, key: str, data: bytes) -> None:
        if self.armed and key.startswith(self.armed[0]):
            callback, self.armed = self.armed[1], None
            callback()
        super().put(key, data)


def _named_objects(bucket: LocalBucket) -> dict[str, bytes]:
    manifest = read_manifest(bucket)
    keys = [f.key for a in manifest.anchors for f in a.files] + [d.file.key for d in manifest.deltas]
    return {k: bucket.get(k) for k in keys}


def _three_versions(bucket, master) -> Publisher:
    pub = Publisher(bucket, owner="trainer", policy=FixedInterval(10))
    for step in range(3):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    return pub


def test_trainer_taken_over_during_its_upload_does_not_write_the_pointer(tmp_path):
    """The fence is checked again after the data upload, right before the pointer."""
    root = tmp_path / "bucket"
    master = master_state()
    old = _three_versions(_Armed(root), master)
    new: list[Publisher] = []
    old.bucket.arm("deltas/", lambda: new.append(Publisher(LocalBucket(root), owner="trainer")) or new[0].resume())
    rl_step(master, 3)
    pointer = old.bucket.get(POINTER_KEY)
    with pytest.raises(FencedError):
        old.publish(3, master)
    assert old.bucket.get(POINTER_KEY) == pointer  # the old trainer's version never became visible
    other = master_state(seed=1)
    assert new[0].publish(3, other).step == 3
    assert verify_bucket(LocalBucket(root)).ok
    sub = Subscriber(LocalBucket(root))
    sub.sync()
    assert sub.step == 3 and sub.state_hash == state_hash(bf16(other))


def test_new_trainer_never_overwrites_a_late_pointer_of_the_old_one(tmp_path):
    """The old trainer's pointer lands after the new one resumed: the new one stops instead of
    writing over objects that pointer names; resumed again, it continues after that version."""
    root = tmp_path / "bucket"
    master = master_state()
    old = _three_versions(_Armed(root), master)
    new: list[Publisher] = []
    old.bucket.arm(POINTER_KEY, lambda: new.append(Publisher(LocalBucket(root), owner="trainer")) or new[0].resume())
    rl_step(master, 3)
    old.publish(3, master)  # its fence check passed just before the takeover
    assert new[0].step == 2
    named = _named_objects(LocalBucket(root))
    with pytest.raises(FencedError, match="did not publish"):
        new[0].publish(3, master_state(seed=1))
    assert _named_objects(LocalBucket(root)) == named
    again = Publisher(LocalBucket(root), owner="trainer")
    assert state_hash(again.resume()) == state_hash(bf16(master))
    rl_step(master, 4)
    again.publish(4, master)
    assert verify_bucket(LocalBucket(root)).ok
    with pytest.raises(FencedError):
        old.publish(5, master)


def test_publisher_rewrites_a_pointer_it_left_cut_short(bucket):
    """An unreadable pointer (an upload cut short after the retries ran out) does not fence its writer."""
    master = master_state()
    pub = _three_versions(bucket, master)
    bucket.put(POINTER_KEY, bucket.get(POINTER_KEY)[:40])
    rl_step(master, 3)
    pub.publish(3, master)
    assert verify_bucket(bucket).ok


def test_subscriber_refuses_a_pointer_naming_its_step_with_another_state(bucket):
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(4))
    sub = Subscriber(bucket)
    for step in range(3):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
        sub.sync()
    held = state_hash(sub.state)
    good = bucket.get(POINTER_KEY)
    doc = json.loads(good)
    doc["state_hash"] = doc["deltas"][-1]["state_hash"] = "0" * 64  # the chain rewritten at the same step
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    with pytest.raises(ChainError, match="another state"):
        sub.fetch()
    assert sub.needs_resync and sub.step == 2 and state_hash(sub.state) == held == sub.state_hash
    bucket.put(POINTER_KEY, good)  # the publisher would refuse to write over a pointer it did not write
    for step in range(3, 6):  # step 4 is an anchor
        rl_step(master, step)
        pub.publish(step, master)
    sub.sync()
    assert sub.step == 5 and sub.state_hash == state_hash(bf16(master)) == state_hash(sub.state)


# ---------------------------------------------------------------------------
# hostile objects in the bucket


def _published(bucket, steps: int = 2, interval: int = 10):
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(interval))
    sub = Subscriber(bucket)
    for step in range(steps):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    sub.sync(max_updates=1)
    return pub, sub, master


def _assert_untouched(sub: Subscriber, step: int | None, digest: str | None) -> None:
    assert sub.step == step and sub.state_hash == digest
    if digest is not None:
        assert state_hash(sub.state) == digest


@pytest.mark.parametrize(
    "key",
    [
        "../x.safetensors",
        "deltas/../../x",
        "/etc/passwd",
        "deltas\\x",
        "deltas//x",
        "C:/x",
        "deltas/%2e%2e",
        "deltas/1\n",
    ],
)
@pytest.mark.parametrize("where", ["delta", "anchor"])
def test_pointer_naming_an_unsafe_key_is_refused(bucket, tmp_path, key, where):
    _, sub, _ = _published(bucket)
    before = (sub.step, sub.state_hash)
    doc = json.loads(bucket.get(POINTER_KEY))
    (doc["deltas"][0]["file"] if where == "delta" else doc["anchors"][0]["files"][0])["key"] = key
    pointer = json.dumps(doc).encode()
    bucket.put(POINTER_KEY, pointer)
    (tmp_path / "x.safetensors").write_bytes(b"outside the bucket")  # what "../x.safetensors" would reach
    (tmp_path / "scratch").mkdir()
    files = files_under(tmp_path)
    for reader in (sub, Subscriber(bucket, workdir=tmp_path / "scratch")):
        downloaded = reader.stats.bytes_downloaded
        with pytest.raises(FormatError, match="invalid object key"):
            reader.fetch()
        assert reader.stats.bytes_downloaded - downloaded == len(pointer)  # refused on the pointer: nothing else read
    assert files_under(tmp_path) == files  # nothing written, inside the bucket, its scratch folder or outside
    _assert_untouched(sub, *before)


def test_pointer_declaring_a_huge_size_is_refused_without_allocating_it(bucket):
    _, sub, _ = _published(bucket)
    before = (sub.step, sub.state_hash)
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["deltas"][0]["file"]["size"] = 2**62
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="promised"):
            sub.fetch()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20
    _assert_untouched(sub, *before)


def test_a_pointer_may_promise_up_to_three_models_plus_headers_and_not_a_byte_more(bucket):
    """The bound on what a pointer may promise, at its edge: three times the held state's bytes (a delta's
    positions and values, or an anchor) plus the headers' allowance; one byte more is refused before any read."""
    from rlsync.limits import MAX_HEADERS_BYTES

    _, sub, _ = _published(bucket)
    model = sum(t.numel() * t.element_size() for t in sub.state.values())
    limit = 3 * model + MAX_HEADERS_BYTES
    sub._fetcher.check_size("delta", 1, limit)
    with pytest.raises(FormatError, match=f"delta 1: the pointer promised {limit + 1:,} bytes"):
        sub._fetcher.check_size("delta", 1, limit + 1)


def test_deeply_nested_pointer_is_a_format_error(bucket):
    _, sub, master = _published(bucket)
    before = (sub.step, sub.state_hash)
    good = bucket.get(POINTER_KEY)
    bucket.put(POINTER_KEY, b"[" * 100_000 + b"]" * 100_000)
    for reader in (sub, Subscriber(bucket)):
        with pytest.raises(FormatError, match="malformed pointer"):
            reader.fetch()
    _assert_untouched(sub, *before)
    bucket.put(POINTER_KEY, good)
    sub.sync()
    assert sub.state_hash == state_hash(bf16(master))


@pytest.mark.parametrize("key", [CONTROL_KEY, LOCK_KEY])
def test_deeply_nested_control_or_lock_object_does_not_stop_the_publisher(bucket, key):
    master = master_state()
    policy = ControlledPolicy(bucket, FixedInterval(3))
    pub = Publisher(bucket, policy=policy)
    pub.publish(0, master)
    bucket.put(key, b"{" + b'"a":{' * 50_000 + b"}" * 50_001)
    if key == LOCK_KEY:  # an unreadable lock counts as absent: a restarted trainer takes the run
        pub = Publisher(bucket, policy=FixedInterval(3))
        pub.resume()
    rl_step(master, 1)
    assert pub.publish(1, master).kind == "delta"
    assert policy.policy == FixedInterval(3)


def test_anchor_of_an_unknown_format_version_is_refused(bucket):
    master = master_state()
    Publisher(bucket).publish(0, master)
    key = read_manifest(bucket).anchors[0].files[0].key
    path = bucket.root / key
    tensors = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as f:
        metadata = dict(f.metadata())
    safetensors.torch.save_file(tensors, path, metadata={**metadata, "format_version": "2"})
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["anchors"][0]["files"][0]["size"] = path.stat().st_size
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    sub = Subscriber(bucket)
    with pytest.raises(FormatError, match="unsupported rlsync file format version '2'"):
        sub.fetch()
    _assert_untouched(sub, None, None)
    assert not sub.state


def _foreign_file(bucket: LocalBucket, key: str, text: str = "{}") -> None:
    """A file another tool put in a mounted bucket folder, under a name our keys never have."""
    path = bucket.root.joinpath(*key.split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


HOSTILE_NAMES = ["a b.json", "ünï.json", "x:y.json"]


def test_local_listing_skips_names_that_are_not_valid_keys(bucket):
    bucket.put("tasks/0000000001.json", b"{}")
    for name in HOSTILE_NAMES:
        _foreign_file(bucket, f"tasks/{name}")
    _foreign_file(bucket, "tasks/²³.json")  # a unicode digit: str.isdigit() but not int()-able
    assert [o.key for o in bucket.list("tasks/")] == ["tasks/0000000001.json"]
    assert list_batches(bucket, "tasks/") == {1: ["tasks/0000000001.json"]}


def test_ids_with_a_trailing_newline_are_refused():
    with pytest.raises(ValueError):
        check_id("r0\n")
    assert replica_of("rollouts/0000000001/r0\n.json") is None


def test_replica_ids_from_keys_are_checked():
    assert replica_of("rollouts/0000000001/r-0.json") == "r-0"
    for key in [
        "rollouts/0000000001/..json",
        "rollouts/0000000001/.json",
        "rollouts/0000000001/a+b.json",
        "rollouts/1/" + "x" * 65 + ".json",
    ]:
        assert replica_of(key) is None, key


def test_deeply_nested_or_non_finite_objects_read_as_absent(bucket):
    bucket.put("status/r.json", b"[" * 100_000 + b"]" * 100_000)
    assert get_json(bucket, "status/r.json") is None
    fields = {
        "task_id": '"t"',
        "prompt": '"p"',
        "completion": '"c"',
        "prompt_ids": "[1]",
        "token_ids": "[2]",
        "logprobs": "[0.0]",
        "version": "0",
    }
    for field, raw in [
        (None, None),
        ("token_ids", "[Infinity]"),
        ("prompt_ids", "[-Infinity]"),
        ("version", "Infinity"),
    ]:
        body = ", ".join(f'"{k}": {raw if k == field else v}' for k, v in fields.items())
        bucket.put("scores/0000000000/r.json", ('{"samples": [{' + body + "}]}").encode())
        read = read_samples(bucket, "scores/0000000000/r.json")
        assert (read is None) == (field is not None), field


def _sample(task_id: str, prompt: str, version: int = 0) -> Sample:
    return Sample(task_id, prompt, "1", [1, 2], [3], [-0.5], version)


def test_env_scores_good_rollouts_next_to_hostile_ones(bucket):
    from env_space.simulator import EnvConfig, EnvSimulator

    env = EnvSimulator(EnvConfig(bucket=str(bucket.root), tasks_per_batch=2), bucket=bucket)
    batch = env.publish_tasks()
    tasks = get_json(bucket, task_key(batch))["tasks"]
    write_samples(bucket, rollout_key(batch, "good"), [_sample(t["task_id"], t["prompt"]) for t in tasks], batch=batch)
    write_samples(
        bucket, f"rollouts/{batch:010d}/..json", [_sample(tasks[0]["task_id"], tasks[0]["prompt"])], batch=batch
    )
    for name in HOSTILE_NAMES:
        _foreign_file(bucket, f"rollouts/{batch:010d}/{name}")
    _foreign_file(bucket, "rollouts/²/x.json")
    # a task batch whose object is not what the env wrote: its rollouts are dropped, not scored
    bucket.put(task_key(batch + 1), b'{"env": "no-such-env", "n": 2, "seed": 1, "tasks": []}')
    write_samples(bucket, rollout_key(batch + 1, "good"), [_sample("x", "y")], batch=batch + 1)
    bucket.put(task_key(batch + 2), b"[1, 2]")
    bucket.put(task_key(batch + 3), b'{"env": "reverse", "n": "2", "seed": 1, "tasks": [{}, {}]}')
    bucket.put(task_key(batch + 4), b'{"env": "reverse", "n": 50, "seed": 1, "tasks": []}')  # n is not what it lists
    for b in (batch + 2, batch + 3, batch + 4):
        write_samples(bucket, rollout_key(b, "good"), [_sample("x", "y")], batch=b)
    assert env.score_rollouts() == len(tasks)
    scored = read_samples(bucket, score_key(batch, "good"))[1]
    assert len(scored) == len(tasks) and all(s.reward is not None for s in scored)
    assert not bucket.exists(f"rollouts/{batch:010d}/..json")  # dropped
    for b in range(batch + 1, batch + 5):  # dropped, never scored
        assert not bucket.exists(rollout_key(b, "good")) and not bucket.exists(score_key(b, "good")), b
    env.step()  # and the loop goes on


def test_trainer_collects_good_scores_next_to_hostile_ones(bucket):
    from rlsync.trl import BucketRolloutWorker

    good = [Sample("t0", "p", "c", [1], [2], [-0.1], 0, reward=r) for r in (1.0, 0.0)]  # a group of one would be degenerate
    write_samples(bucket, score_key(0, "good"), good, batch=0)
    bucket.put(score_key(0, "inf"), b'{"samples": [{"task_id": "t1", "prompt": "p", "completion": "c", "prompt_ids": [1], '
               b'"token_ids": [Infinity], "logprobs": [0.0], "version": 0, "reward": 1.0}]}')  # fmt: skip
    bucket.put(f"scores/{0:010d}/..json", b"[" * 100_000)
    _foreign_file(bucket, "scores/0000000000/a b.json")
    _foreign_file(bucket, "scores/²/x.json")
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)  # what the trainer reads scores with
    assert worker.poll() == 2
    assert [worker.rollout_buffer.get_nowait().input_ids.tolist() for _ in good] == [[1, 2]] * 2 and worker.rollout_buffer.empty()


def test_replica_skips_hostile_task_names_and_refuses_malformed_task_batches(bucket):
    from rollout_space.replica import Replica, ReplicaConfig
    from tests.library.test_secrets import StubEngine

    Publisher(bucket).publish(0, master_state())
    _foreign_file(bucket, "tasks/²³.json")
    _foreign_file(bucket, "tasks/a b.json")
    bucket.put(task_key(4), b'{"tasks": [{"prompt": "no id"}, {"task_id": "t", "prompt": "ok"}, {"task_id": "u"}, 5]}')
    bucket.put(task_key(5), b'{"tasks": [{"task_id": "t", "prompt": "ok"}]}')
    replica = Replica(
        ReplicaConfig(bucket=str(bucket.root), replica_id="r", samples_per_task=1), bucket=bucket, engine=StubEngine()
    )
    replica.subscriber.sync()
    assert replica.batches.next_batch() == 4
    assert replica.answer(4) == 0 and replica.refusals.total == 1  # one parser per object type: malformed is refused whole
    assert replica.batches.next_batch() == 5 and replica.answer(5) == 1
    assert [s.task_id for s in read_samples(bucket, rollout_key(5, "r"))[1]] == ["t"]
