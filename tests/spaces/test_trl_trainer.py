"""The TRL trainer with the bucket plug-ins, end to end on the tiny model without replicas
(synthetic scores): the final publish off the sync grid, and a kill -9 restart that resumes
from the bucket checkpoint with bit-equal optimizer state and continuous versions."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

from env_space.environments import get_environment
from rlsync.hashing import state_hash
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.tiny_model import tiny_model_path
from rlsync.trl import BucketCheckpoints
from tests.trl_feed import ScoreFeeder, off_grid_trainer

ROOT = Path(__file__).resolve().parents[2]


def test_final_weights_are_published_off_the_sync_grid(bucket, tmp_path):
    from rlsync.scores import read_samples
    from rlsync.protocol import Publisher
    from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, FinalWeightSync, apply_cpu_compat

    apply_cpu_compat()
    path = str(tiny_model_path(environments=get_environment))
    tokenizer = AutoTokenizer.from_pretrained(path)
    transfer = BucketWeightTransfer(publisher=Publisher(bucket))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), poll_s=0.1)
    trainer = off_grid_trainer(path, tokenizer, str(tmp_path / "out"), worker, transfer, learning_rate=1e-3)
    trainer.add_callback(FinalWeightSync(trainer))
    with ScoreFeeder(bucket, tokenizer):
        trainer.train()
    transfer.close()
    manifest = read_manifest(bucket)
    assert [r.step for r in transfer.records] == [0, 1, 2] and manifest.step == 2  # train begin, step 2, final step 3
    sub = Subscriber(bucket)
    sub.sync()
    params = dict(trainer.model.named_parameters())
    assert sub.state_hash == manifest.state_hash == state_hash({n: params[n].detach().to(torch.bfloat16) for n in sub.state})


class OptimizerAtStart(TrainerCallback):
    """Copies the optimizer state when training begins (after the Trainer loaded a checkpoint)."""

    def __init__(self) -> None:
        self.state = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.state = copy.deepcopy(optimizer.state_dict())


def test_kill_9_then_restart_resumes_from_the_bucket_checkpoint(bucket, tmp_path):
    from trainer_space.trainer import Trainer, TrainerConfig

    settings = dict(checkpoint_every=2, batch_size=16, trainer_id="t", poll_s=0.1, lr=1e-3, anchor_interval=4)
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        **{f"TRAINER_{k.upper()}": str(v) for k, v in settings.items()}, "TRAINER_BUCKET": str(bucket.root),
    }  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path(environments=get_environment)))
    checkpoints = BucketCheckpoints(bucket)
    log = tmp_path / "first.log"
    with ScoreFeeder(bucket, tokenizer):
        first = subprocess.Popen([sys.executable, "-m", "trainer_space"], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and first.poll() is None:
                steps = checkpoints.steps()
                manifest = read_manifest(bucket)
                if steps and steps[-1] >= 4 and manifest is not None and manifest.step > steps[-1] + 1:
                    break
                time.sleep(0.2)
            first.send_signal(signal.SIGKILL)
        finally:
            first.wait(30)
        assert first.returncode == -signal.SIGKILL, log.read_text()[-3000:]
        killed_at = read_manifest(bucket).step
        # a kill between a checkpoint's marker and its pin leaves it unpinned: restart must skip and count it
        pinned = {p.step for p in read_manifest(bucket).checkpoints}
        saved_step = max(s for s in checkpoints.steps() if s in pinned)
        unpinned = [s for s in checkpoints.steps() if s > saved_step]
        saved = torch.load(checkpoints.download(saved_step, tmp_path / "saved") / "optimizer.pt", weights_only=True)
        trainer = Trainer(TrainerConfig(bucket=str(bucket.root), max_steps=saved_step + 3, **settings), bucket=bucket)
        probe = OptimizerAtStart()
        trainer.trl.add_callback(probe)
        try:
            trainer.run()
        finally:
            trainer.close()
    # the optimizer resumed bit-equal to the checkpoint, which passed every check against the chain and the model
    assert trainer.checkpoints.skipped == len(unpinned) <= 1 and saved_step in {p.step for p in read_manifest(bucket).checkpoints}
    assert probe.state["state"].keys() == saved["state"].keys() and saved["state"]
    for key, entry in saved["state"].items():
        for name, value in entry.items():
            got = probe.state["state"][key][name]
            assert torch.equal(got, value) and got.dtype == value.dtype, (key, name)
    assert trainer.trl.state.global_step == saved_step + 3
    # versions continue after the last one published before the kill: none reused, none skipped
    steps = [r.step for r in trainer.transfer.records]
    assert steps == list(range(killed_at + 1, killed_at + 1 + len(steps))) and len(steps) >= 2
    assert "newer than checkpoint" in trainer.notice
    manifest = read_manifest(bucket)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == manifest.step == steps[-1] and sub.state_hash == manifest.state_hash
    assert checkpoints.steps()[-1] == saved_step + 3 and len(checkpoints.steps()) <= 2  # saved at the end, retention


def test_overview_ratio_frame_compares_deltas_with_the_anchor_and_the_trl_layout():
    from rlsync.spaces.frames import delta_ratio_frame
    from rlsync.spaces.metrics import TrainerMetrics
    from rlsync.spaces.snapshots import Snapshot

    rows = [
        {"kind": "anchor", "version": 0, "nbytes": 1000},
        {"kind": "delta", "version": 1, "nbytes": 50, "trl_nbytes": 200},
        {"kind": "train", "version": 1, "loss": 0.1},
        {"kind": "anchor", "version": 2, "nbytes": 500},
        {"kind": "delta", "version": 3, "nbytes": 25, "trl_nbytes": None},
    ]
    frame = delta_ratio_frame(Snapshot(trainer=TrainerMetrics.from_json({"rows": rows})))
    assert frame.values.tolist() == [[1, 5.0, "vs anchor"], [1, 25.0, "vs TRL layout"], [3, 5.0, "vs anchor"]]
