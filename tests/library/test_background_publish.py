"""Publishing in the background (rlsync.protocol.background): a stage returns once the weights are
cast, the worker publishes, coalesces when behind, surfaces its failures, and a trainer killed
mid-publish leaves the bucket at the previous version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest
from rlsync.protocol.background import BackgroundPublisher
from rlsync.trl import BucketWeightTransfer
from tests.helpers import GatedBucket, bf16, master_state, rl_step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gated(tmp_path) -> GatedBucket:
    return GatedBucket(LocalBucket(tmp_path / "bucket"))


def follow(bucket) -> Subscriber:
    sub = Subscriber(bucket)
    sub.sync()
    return sub


def test_a_stage_returns_before_the_publish_and_the_replica_gets_the_staged_bits(gated):
    master = master_state()
    bg = BackgroundPublisher(Publisher(gated, policy=FixedInterval(100)))
    bg.stage(master.items())
    bg.flush()
    rl_step(master, 0)
    staged = state_hash(bf16(master))
    gated.gate.clear()
    step, _ = bg.stage(master.items())  # returns although the delta's upload is held
    rl_step(master, 1)  # the trainer goes on changing its weights: the staged copy is what is published
    assert gated.waiting.wait(30) and bg.busy
    assert read_manifest(gated).step == 0  # the pointer is written last
    gated.gate.set()
    records = bg.close()
    assert [r.step for r in records] == [step] == [1]  # the first flush took the anchor's record
    sub = follow(gated)
    assert sub.step == 1 and sub.state_hash == staged


def test_a_worker_behind_coalesces_and_every_published_version_is_a_valid_delta_chain(gated):
    master = master_state()
    bg = BackgroundPublisher(Publisher(gated, policy=FixedInterval(100)))
    bg.stage(master.items())
    bg.flush()
    hashes = {}
    gated.gate.clear()
    for seed in range(5):  # the first delta is held in flight; the later stages replace each other
        rl_step(master, seed)
        step, _ = bg.stage(master.items())
        hashes[step] = state_hash(bf16(master))
        gated.waiting.wait(30)
    assert bg.coalesced == 3 and bg.version == 5
    gated.gate.set()
    assert [r.step for r in bg.close()] == [1, 5]  # 2, 3 and 4 are in 5's delta, none lost
    manifest = read_manifest(gated)
    assert [(d.base_step, d.step) for d in manifest.deltas] == [(0, 1), (1, 5)]
    sub = follow(gated)  # replays the whole chain from the anchor, every hash checked
    assert sub.step == 5 and sub.state_hash == hashes[5] == manifest.state_hash


def test_a_failed_background_publish_is_raised_by_the_next_stage_and_flush(gated):
    master = master_state()
    bg = BackgroundPublisher(Publisher(gated, policy=FixedInterval(100)))
    bg.stage(master.items())
    bg.flush()
    gated.fail = OSError("upload refused")
    rl_step(master, 0)
    bg.stage(master.items())
    with pytest.raises(OSError, match="upload refused"):
        bg.flush()
    assert bg.errors == 1 and bg.version == 0 and read_manifest(gated).step == 0
    bg.flush()  # raised once
    bg.stage(master.items())  # fails in the worker again
    while bg.busy:  # failed in the worker (a stage before would coalesce with it instead)
        time.sleep(0.01)
    rl_step(master, 1)
    with pytest.raises(OSError, match="upload refused"):
        bg.stage(master.items())  # the next stage raises it, and stages nothing
    assert bg.errors == 2 and not bg.busy
    gated.fail = None
    step, _ = bg.stage(master.items())
    bg.close()
    assert step == 1  # the failed versions are taken back: the next follows the published one
    sub = follow(gated)
    assert sub.step == 1 and sub.state_hash == state_hash(bf16(master))


def test_a_non_finite_background_publish_reaches_on_non_finite_at_the_next_send(gated):
    master = master_state()
    refused = []
    transfer = BucketWeightTransfer(publisher=Publisher(gated, policy=FixedInterval(100)), on_non_finite=refused.append, background=True)
    transfer.send_weights(iter(master.items()))
    transfer.flush()
    master["model.norm.weight"][3] = float("nan")
    transfer.send_weights(iter(master.items()))
    while transfer.background.busy:  # refused in the worker (a send now would coalesce with it instead)
        time.sleep(0.01)
    master["model.norm.weight"][3] = 1.0
    transfer.send_weights(iter(master.items()))  # raises the refusal inside: handed to on_non_finite
    assert len(refused) == 1 and transfer.non_finite_refused == 1
    transfer.close()
    assert read_manifest(gated).step == 0 and transfer.version == 0  # TRL's version is taken back to the bucket's


KILLED_TRAINER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from rlsync.bucket import LocalBucket
    from rlsync.bucket.base import BucketWrapper
    from rlsync.layout import DELTA_PREFIX
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.trl import BucketWeightTransfer
    from tests.helpers import master_state, rl_step

    slow = False

    class Slow(BucketWrapper):
        def put(self, key, data):
            if slow and key.startswith(DELTA_PREFIX):
                Path(sys.argv[2]).write_text(key)  # the delta of version 2 is being uploaded
                time.sleep(600)
            self.inner.put(key, data)

    master = master_state()
    transfer = BucketWeightTransfer(publisher=Publisher(Slow(LocalBucket(sys.argv[1])), owner="t", policy=FixedInterval(100)), background=True)
    transfer.send_weights(iter(master.items()))
    rl_step(master, 0)
    transfer.send_weights(iter(master.items()))
    transfer.flush()  # versions 0 and 1 published (or 0 and 1 coalesced: version 1 either way)
    slow = True
    rl_step(master, 1)
    transfer.send_weights(iter(master.items()))
    time.sleep(600)
''')


def test_a_trainer_killed_during_a_background_publish_leaves_the_previous_version(tmp_path):
    bucket_dir, marker = tmp_path / "bucket", tmp_path / "in-flight"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(bucket_dir), str(marker)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the trainer never started the publish"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)  # mid-publish: the delta's upload has begun, the pointer not
    finally:
        child.kill()
        child.wait()
    bucket = LocalBucket(bucket_dir)
    assert read_manifest(bucket).step == 1
    sub = follow(bucket)
    assert sub.step == 1
    master = master_state()  # the restarted trainer (from its checkpoint) continues the chain
    rl_step(master, 0)
    rl_step(master, 1)
    again = BucketWeightTransfer(publisher=Publisher(bucket, owner="t", policy=FixedInterval(100)), resume_from_checkpoint="ckpt", background=True)
    again.init_weight_transfer()
    assert again.version == 1
    again.send_weights(iter(master.items()))
    again.close()
    sub.sync()
    assert sub.step == 2 and sub.state_hash == state_hash(bf16(master)) == read_manifest(bucket).state_hash


def test_a_checkpoint_pin_during_a_background_publish_waits_and_both_reach_the_pointer(gated):
    master = master_state()
    pub = Publisher(gated, policy=FixedInterval(100))
    bg = BackgroundPublisher(pub)
    bg.stage(master.items())
    bg.flush()
    gated.gate.clear()
    rl_step(master, 0)
    bg.stage(master.items())
    assert gated.waiting.wait(30)  # the delta's upload is held, its pointer not written yet
    pin = threading.Thread(target=pub.pin_checkpoint, args=(7, "ab" * 32))  # the trainer's checkpoint callback
    pin.start()
    pin.join(0.5)
    assert pin.is_alive()  # waits for the publish in flight instead of writing a pointer beside it
    gated.gate.set()
    pin.join(30)
    bg.close()
    manifest = read_manifest(gated)
    assert manifest.step == 1 and [(p.step, p.weights_hash) for p in manifest.checkpoints] == [(7, "ab" * 32)]
