"""A Space's restart loses nothing and needs no click (issue 39): the trainer checkpoints on SIGTERM and after its
first step, a restarted trainer resumes its own run (from its checkpoint, or, before any, from the weights it
published) with the next version, and its Trackio run is the same run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from env_space.environments import get_environment
from rlsync.layout import CHECKPOINTS_PREFIX
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.tiny_model import tiny_model_path
from rlsync.trl import BucketCheckpoints
from tests.trl_feed import ScoreFeeder

ROOT = Path(__file__).resolve().parents[2]
#: The Spaces runtime's variables of a duplicate by another owner than the template's.
SPACE_ENV = {"SYSTEM": "spaces", "SPACE_ID": "bob/rl-sync-trainer", "SPACE_AUTHOR_NAME": "bob", "SPACE_HOST": "bob-rl-sync-trainer.hf.space"}


def test_a_restart_before_the_first_checkpoint_continues_the_run_and_its_trackio_run(bucket, monkeypatch):
    from trainer_space.trainer import Trainer, TrainerConfig

    for name, value in SPACE_ENV.items():
        monkeypatch.setenv(name, value)
    config = TrainerConfig(bucket=str(bucket.root), device="cpu", checkpoint_every=1000)
    first = Trainer(config, bucket)
    first.prepare()
    first.trl._sync_weight()  # the cold sync at train begin: version 0; then the Space restarts, no checkpoint yet
    run_name = first.trl.args.run_name
    first.close()
    published = read_manifest(bucket)
    assert published.step == 0 and published.run_id == run_name and not BucketCheckpoints(bucket).steps()
    again = Trainer(config, bucket)  # no TRAINER_NEW_RUN
    assert again.prepare() is None and again.trl.args.run_name == run_name  # Trackio: the same run, resume="allow"
    assert again.trl.args.trackio_space_id == "bob/rl-sync-trackio" and again.trl.args.report_to == ["trackio"]
    again.trl._sync_weight()
    again.close()
    manifest = read_manifest(bucket)
    assert manifest.run_id == published.run_id and manifest.step == 1 and manifest.deltas[-1].base_step == 0
    assert manifest.state_hash == published.state_hash  # no regression: the weights it published, bit for bit


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout_s: float = 400.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (found := predicate()) is not None:
            return found
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"timed out; log tail:\n{log.read_text()[-4000:]}")


def test_sigterm_after_3_steps_then_a_restart_resumes_from_the_checkpoint_and_publishes_the_next_version(bucket, tmp_path):
    """``python -m trainer_space`` as a duplicate by another owner runs it; SIGTERM after 3 steps (what Spaces send
    before a restart) saves a checkpoint; started again with nothing changed, it resumes and publishes on."""
    settings = dict(batch_size=16, poll_s=0.1, lr=1e-3, anchor_interval=100, report_to="none")  # checkpoint_every: 50
    env = {
        **os.environ, **SPACE_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", **{f"TRAINER_{k.upper()}": str(v) for k, v in settings.items()}, "TRAINER_BUCKET": str(bucket.root),
    }  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path(environments=get_environment)))
    checkpoints = BucketCheckpoints(bucket)
    with ScoreFeeder(bucket, tokenizer):
        log = tmp_path / "first.log"
        first = subprocess.Popen([sys.executable, "-m", "trainer_space"], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: True if (m := read_manifest(bucket)) is not None and m.step >= 3 else None, first, log)
            assert checkpoints.steps() == [1]  # the early checkpoint, after the first step
            first.send_signal(signal.SIGTERM)
            first.wait(300)
        finally:
            first.kill() if first.poll() is None else None
        assert first.returncode == 0, log.read_text()[-4000:]
        stopped = read_manifest(bucket)
        saved = checkpoints.steps()[-1]
        assert saved >= 3 and checkpoints.marker(saved)["published_version"] == stopped.step  # saved at SIGTERM
        log = tmp_path / "second.log"
        second = subprocess.Popen([sys.executable, "-m", "trainer_space"], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: True if read_manifest(bucket).step >= stopped.step + 2 else None, second, log)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(300)
    text = log.read_text()
    assert f"resuming from checkpoint {saved}" in text and "RunExistsError" not in text
    manifest = read_manifest(bucket)
    assert manifest.run_id == stopped.run_id
    resumed = manifest.delta_after(stopped.step)  # the next version follows the last published one ...
    assert resumed is not None and resumed.base_step == stopped.step
    assert resumed.state_hash == stopped.state_hash  # ... holding the checkpoint's weights: no regression
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.run_id == manifest.run_id and sub.state_hash == manifest.state_hash
    assert [o for o in bucket.list(CHECKPOINTS_PREFIX) if o.key.endswith("COMPLETE.json")]


def test_the_trainer_space_left_running_resumes_at_boot_and_its_sigterm_keeps_it_wanted(bucket, tmp_path):
    """The Space's page (``python -m trainer_space.app``, as the runtime starts it): the bucket records the owner's
    Start, so the page starts training at boot with that Start's settings, no click; the runtime's SIGTERM saves a
    checkpoint and leaves it wanted; the next boot resumes from that checkpoint and publishes on."""
    from rlsync.roles import Role
    from rlsync.spaces.desired import Wanted, read_desired, write_desired
    from rlsync.spaces.settings import instance_id
    from tests.helpers import free_port
    from trainer_space.config import TrainerConfig

    started = TrainerConfig(bucket=str(bucket.root), batch_size=16, poll_s=0.1, lr=1e-3, report_to="none", device="cpu")
    write_desired(bucket, Role.TRAINER, Wanted.RUNNING, started, instance=instance_id(SPACE_ENV))
    env = {
        **os.environ, **SPACE_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "TRAINER_BUCKET": str(bucket.root), "GRADIO_SERVER_NAME": "127.0.0.1",
    }  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path(environments=get_environment)))
    checkpoints = BucketCheckpoints(bucket)
    logs = []
    with ScoreFeeder(bucket, tokenizer):
        for boot in range(2):
            logs.append(log := tmp_path / f"boot{boot}.log")
            page = subprocess.Popen(
                [sys.executable, "-m", "trainer_space.app"], cwd=ROOT, env={**env, "PORT": str(free_port())},
                stdout=log.open("w"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                floor = -1 if boot == 0 else stopped.step
                wait_for(lambda: True if (m := read_manifest(bucket)) is not None and m.step >= floor + 2 else None, page, log)
                page.send_signal(signal.SIGTERM)
                page.wait(300)
            finally:
                page.kill() if page.poll() is None else None
            stopped = read_manifest(bucket)
            assert read_desired(bucket, Role.TRAINER, instance_id(SPACE_ENV)).wanted is Wanted.RUNNING
            saved = checkpoints.steps()[-1]
            assert checkpoints.marker(saved)["published_version"] == stopped.step, log.read_text()[-4000:]
    first, second = (log.read_text() for log in logs)
    assert "was running before the restart; resumed" in first and "resumed" in second
    assert "stopping trainer before the restart" in first  # the SIGTERM handler, not a kill
    assert "resuming from checkpoint" in second and "RunExistsError" not in first + second
    assert read_manifest(bucket).run_id == stopped.run_id
