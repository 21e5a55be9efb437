"""The TRL plug-ins of the sync library (rlsync.trl): sample mapping, staleness, health,
version continuity across restarts, the final publish, and streaming memory."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from rlsync.detect import CPU_CHUNK_ELEMENTS
from rlsync.errors import StopRequested
from rlsync.hashing import state_hash
from rlsync.layout import score_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest
from rlsync.spaces.exchange import Sample, read_samples, write_samples
from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, group_advantages
from tests.helpers import bf16, master_state, rl_step

ROOT = Path(__file__).resolve().parents[3]


def sample(task: str, reward: float, version: int, prompt=(1, 5, 6), tokens=(7, 8), logprobs=(-0.5, -1.25)) -> Sample:
    return Sample(task, "p", "c", list(prompt), list(tokens), list(logprobs), version, reward=reward)


def drain(worker) -> list:
    out = []
    while not worker.rollout_buffer.empty():
        out.append(worker.rollout_buffer.get_nowait())
    return out


def test_samples_map_onto_trl_rollout_samples(bucket):
    Publisher(bucket).publish(4, bf16(master_state()))
    write_samples(bucket, score_key(0, "r0"), [
        sample("a", 1.0, 4, prompt=(1, 9), tokens=(10, 11, 12), logprobs=(-0.1, -0.2, -0.3)),
        sample("a", 0.0, 4), sample("b", 0.5, 3), sample("b", 0.5, 3), sample("a", 0.0, 4), sample("a", 1.0, 4),
    ])  # fmt: skip
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)
    worker.update_model_version(1)  # TRL's first sync made the trainer's version 1 ...
    worker.align_versions()  # ... and bucket version 4 the live one
    worker.poll()
    got = drain(worker)
    assert len(got) == 6 and worker.counts["queued"] == 6
    first = got[0]
    assert first.input_ids.tolist() == [1, 9, 10, 11, 12]
    assert first.completion_mask.tolist() == [0, 0, 1, 1, 1]
    assert first.old_log_probs.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])
    assert first.input_ids.dtype == np.int64 and first.old_log_probs.dtype == np.float32
    a = [s for s in got if s.group_id == first.group_id]
    b = [s for s in got if s.group_id != first.group_id]
    assert len(a) == 4 and len(b) == 2 and len({s.group_id for s in b}) == 1
    assert [s.advantage for s in a] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-6)  # (r - mean) / std
    assert [s.advantage for s in b] == [0.0, 0.0]  # no signal in a tied group
    assert {s.model_version for s in a} == {1} and {s.model_version for s in b} == {0}  # bucket 4 -> trainer 1
    assert [s.metrics["reward"] for s in a] == [1.0, 0.0, 0.0, 1.0]
    assert group_advantages([2.0, 0.0]).tolist() == pytest.approx([1.0, -1.0])


def test_hostile_samples_are_counted_and_never_queued(bucket):
    """Each hostile sample in its own scores object: refused by the parser (the whole object) or by the
    worker's own checks (ids outside the model's vocabulary, which the parser cannot know); the good
    object's samples are queued."""
    Publisher(bucket).publish(0, bf16(master_state()))
    write_samples(bucket, score_key(0, "good"), [sample("ok", 1.0, 0), sample("ok", 0.0, 0)])
    hostile = {
        "vocab": sample("vocab", 1.0, 0, tokens=(7, 99)), "neg": sample("neg", 1.0, 0, prompt=(-1, 2)),
        "nan": sample("nan", 1.0, 0, logprobs=(math.nan, -1.0)), "pos": sample("pos", 1.0, 0, logprobs=(0.5, -1.0)),
        "inf": sample("inf", math.inf, 0), "empty": sample("empty", 1.0, 0, tokens=(), logprobs=()),
    }  # fmt: skip
    for name, bad in hostile.items():
        write_samples(bucket, score_key(0, name), [bad, sample(name, 0.0, 0)])
    bucket.put(score_key(0, "junk"), b"[" * 10_000)
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_tokens=64)
    worker.poll()
    queued = drain(worker)
    assert sorted(s.metrics["reward"] for s in queued if s.advantage != 0.0) == [0.0, 1.0]  # the good group
    for s in queued:  # nothing hostile got through
        assert 0 <= s.input_ids.min() and s.input_ids.max() < 32 and s.completion_mask.sum() > 0
        assert np.isfinite(s.old_log_probs).all() and (s.old_log_probs <= 0).all() and math.isfinite(s.metrics["reward"])
    assert worker.counts["invalid"] + worker.counts["unreadable"] >= len(hostile) + 1
    assert worker.counts["invalid"] >= 1  # the out-of-vocabulary id passes the parser, not the worker
    assert worker.poll() == 0  # objects are read once


def test_stale_samples_are_dropped_by_trl_at_dequeue(bucket):
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    PartialState(cpu=True)  # TRL logs through accelerate
    Publisher(bucket).publish(10, bf16(master_state()))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)
    worker.update_model_version(1)
    worker.align_versions()  # bucket 10 is trainer version 1
    write_samples(bucket, score_key(0, "r0"), [sample("old", 1.0, 7), sample("old", 0.0, 7), sample("new", 1.0, 10), sample("new", 0.0, 10)])
    worker.poll()
    metrics = defaultdict(list)
    dataset = RolloutQueueDataset(worker.rollout_buffer, lambda: 2, worker.check_health, 60.0, metrics, max_staleness=2, poll_interval_s=0.01)
    it = iter(dataset)
    kept = [next(it), next(it)]  # version 2 now: bucket 7 is trainer -2, four behind; bucket 10 is one behind
    assert [k["metrics"]["reward"] for k in kept] == [1.0, 0.0]
    assert sum(metrics["sample/dropped_stale_total"]) == 2
    assert metrics["sample/staleness_max"] == [1.0, 1.0]
    # the worker can also skip samples already too old when it reads them
    worker.max_staleness = 2
    write_samples(bucket, score_key(1, "r0"), [sample("old", 1.0, 7), sample("new", 1.0, 10), sample("new", 0.0, 10)])
    worker.update_model_version(2)
    assert worker.poll() == 2 and worker.counts["dropped_stale"] == 1


def test_health_tolerates_waiting_keeps_the_lock_fresh_and_reports_stop(bucket):
    beats = []
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, poll_s=0.01, heartbeat=lambda: beats.append(1), heartbeat_s=0.0)
    worker.start()
    try:
        worker.check_health(0.0)  # nothing arrived yet: healthy
        assert beats
        worker.request_stop()
        with pytest.raises(StopRequested):
            worker.check_health(60.0)
    finally:
        worker.stop()
    broken = BucketRolloutWorker(bucket, lambda b, k: 1 / 0, vocab_size=32, poll_s=0.01)
    write_samples(bucket, score_key(0, "r0"), [sample("a", 1.0, 0)])
    broken.start()
    broken._thread.join(5)
    with pytest.raises(RuntimeError, match="failed"):
        broken.check_health(60.0)
    broken.stop()


def test_restarted_transfer_continues_versions_and_stays_bit_exact(bucket):
    master = master_state()
    first = BucketWeightTransfer(publisher=Publisher(bucket, owner="t", policy=FixedInterval(3)))
    for seed in range(4):
        first.send_weights(iter(master.items()))
        first.flush()  # each version published (a send while the last is in flight would coalesce with it)
        rl_step(master, seed)
    assert first.version == 3
    first.close()
    again = BucketWeightTransfer(
        publisher=Publisher(bucket, owner="t", policy=FixedInterval(3)), resume_from_checkpoint="out/checkpoint-3"
    )
    again.init_weight_transfer()
    assert again.version == 3
    for seed in range(4, 7):
        sent_hash = state_hash(bf16(master))
        again.send_weights(iter(master.items()))
        again.flush()
        rl_step(master, seed)
    again.close()
    manifest = read_manifest(bucket)
    assert manifest.step == 6
    steps = sorted({d.step for d in manifest.deltas} | {a.step for a in manifest.anchors})
    assert steps == list(range(steps[0], 7))  # none reused or skipped
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 6 and sub.state_hash == manifest.state_hash == sent_hash
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)
    worker.update_model_version(3)  # a restarted TRL trainer counts from 1 again: 3 syncs since
    worker.align_versions()
    assert worker.trainer_version(6) == 3 and worker.trainer_version(4) == 1


def test_stream_publish_equals_the_dict_publish(tmp_path):
    from rlsync.bucket import LocalBucket

    master = master_state()
    streamed, whole = LocalBucket(tmp_path / "a"), LocalBucket(tmp_path / "b")
    pa, pb = Publisher(streamed, policy=FixedInterval(3)), Publisher(whole, policy=FixedInterval(3))
    for step in range(5):
        ra, rb = pa.publish_stream(step, iter(master.items())), pb.publish(step, master)
        assert (ra.kind, ra.state_hash, ra.changed) == (rb.kind, rb.state_hash, rb.changed)
        assert ra.state_hash == state_hash(bf16(master))
        rl_step(master, step)
    sub = Subscriber(streamed)
    sub.sync()
    assert sub.state_hash == read_manifest(whole).state_hash
    from rlsync.errors import SyncError

    with pytest.raises(SyncError, match="lacks"):
        pa.publish_stream(9, iter(list(master.items())[1:]))
    with pytest.raises(SyncError, match="twice"):
        pa.publish_stream(9, iter(list(master.items()) + list(master.items())[:1]))
    assert read_manifest(streamed).step == 4  # refused sends publish nothing


MEMORY_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from rlsync.bucket import LocalBucket
    from rlsync.protocol import Publisher, FixedInterval
    from rlsync.trl import BucketWeightTransfer

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    def growth(fn):
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
        base = rss("VmRSS:")
        fn()
        return rss("VmHWM:") - base

    torch.manual_seed(0)
    # what a process loads once (the default codec's compiled kernels), before the measured sends
    warm, small = Publisher(LocalBucket(sys.argv[1] + "-warm"), policy=FixedInterval(1000)), {"w": torch.randn(1000)}
    warm.publish(0, small)
    small["w"][::10] += 1.0
    warm.publish(1, small)
    state = {f"layer{i}.weight": torch.randn(2_000_000) for i in range(24)}
    transfer = BucketWeightTransfer(publisher=Publisher(LocalBucket(sys.argv[1]), policy=FixedInterval(1000)), background=False)
    transfer.init_weight_transfer()
    first = growth(lambda: transfer.send_weights(iter(state.items())))
    with torch.no_grad():
        for t in state.values():
            t[::100] += 1.0
    delta = growth(lambda: transfer.send_weights(iter(state.items())))
    print(json.dumps({"first": first, "delta": delta, "kinds": [r.kind for r in transfer.records],
                      "changed": transfer.records[-1].changed}))
''')


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux peak-RSS reset")
def test_streaming_send_memory_is_bounded(tmp_path):
    """Peak RSS growth of a streaming send (``background=False``), measured in a fresh process: at most
    the shadow copy plus the two largest tensors (the first send builds the shadow); a delta send stays
    far below. (A background send also holds its staging buffer: one more serving-dtype copy.)"""
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "bucket")], cwd=ROOT, capture_output=True, text=True,
        env={"PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}", "RLSYNC_THREADS": "2", "PATH": "/usr/bin:/bin"}, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    shadow, largest = 24 * 2_000_000 * 2, 2_000_000 * 4
    print(json.dumps({**got, "shadow": shadow, "largest": largest}))
    assert got["kinds"] == ["anchor", "delta"] and got["changed"] == 24 * 20_000
    assert got["first"] <= shadow + 2 * largest, got
    # a delta send: two tensors in flight, the changes, and the comparison's chunk workspace on each of the
    # 2 worker threads (chunk x (fp32 source + bf16 cast + 1 byte mask), see shared/rlsync/detect.py)
    workspace = 2 * CPU_CHUNK_ELEMENTS * (4 + 2 + 1)
    assert got["delta"] <= 2 * largest + 16 * got["changed"] + workspace, got


def test_trl_layout_estimate_matches_the_trl_codec(bucket):
    """The panel's "TRL layout" size (6 bytes per changed bf16 element plus the header estimate)
    is within 10% of a real delta written with the trl codec (the public design's plain layout)."""
    from rlsync.trl.metrics import trl_layout_bytes

    master = master_state()
    pub = Publisher(bucket, codec="trl", policy=FixedInterval(100))
    pub.publish(0, master)
    rl_step(master, 0)
    rec = pub.publish(1, master)
    estimate = trl_layout_bytes(rec.changed, len(master))
    assert rec.kind == "delta" and rec.changed > 1000
    assert abs(estimate - rec.nbytes) <= 0.1 * rec.nbytes, (estimate, rec.nbytes)


def test_a_sample_spanning_an_update_is_as_stale_as_its_first_version(bucket):
    """A completion generated across an update (a server paused with ``keep``) records its first and last version:
    the worker counts staleness from the first, the oldest, and refuses a last version out of order."""
    Publisher(bucket).publish(10, bf16(master_state()))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_staleness=1)
    worker.update_model_version(3)
    worker.align_versions()  # bucket 10 is trainer version 3
    spanning = [dataclasses.replace(sample("span", r, 8), last_version=10) for r in (1.0, 0.0)]  # 8 -> 10: two behind
    write_samples(bucket, score_key(0, "r0"), [*spanning, sample("fresh", 1.0, 9), sample("fresh", 0.0, 9)])
    assert worker.poll() == 2 and worker.counts["dropped_stale"] == 2
    assert {s.model_version for s in drain(worker)} == {2}  # bucket 9, one behind
    _, [read, *_] = read_samples(bucket, score_key(0, "r0"))
    assert (read.version, read.last_version) == (8, 10)
    for last in (7, 11, "10"):  # before the first, newer than the newest published, not an integer
        bad = [dataclasses.replace(sample("s", r, 8), last_version=last) for r in (1.0, 0.0)]
        write_samples(bucket, score_key(1, f"bad{last}"), bad)
    worker.max_staleness = None
    assert worker.poll() == 0 and worker.counts["invalid"] + worker.counts["unreadable"] >= 3
