"""``python app.py --model tiny-moe`` end to end: the combined app trains the tiny MoE with TRL's
``AsyncGRPOTrainer``, publishes it through a local bucket in checkpoint names (one tensor per expert), and
its replica (the transformers engine writing into its fused expert parameters) follows bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from env_space.environments import get_environment
from rlsync.bucket import LocalBucket
from rlsync.layout import STATUS_PREFIX
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.exchange import get_json
from rlsync.spaces.tiny_model import TinyModel, tiny_model_path
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def test_app_with_the_tiny_moe_publishes_it_and_the_replica_follows_bit_exact(tmp_path):
    tiny_model_path(kind=TinyModel.MOE, environments=get_environment)  # built once, before the roles start
    bucket_dir = tmp_path / "bucket"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        "TRAINER_BATCH_SIZE": "16", "TRAINER_SYNC_EVERY": "1", "TRAINER_ANCHOR_INTERVAL": "8", "TRAINER_SEED": "0",
        "TRAINER_POLL_S": "0.2", "ROLLOUT_POLL_S": "0.2", "ENV_POLL_S": "0.2", "ROLLOUT_REHASH_EVERY_S": "0.2",
    }  # fmt: skip
    command = [sys.executable, "app.py", "--model", TinyModel.MOE.value, "--bucket", str(bucket_dir), "--replicas", "1",
               "--max-steps", str(STEPS), "--port", str(free_port())]  # fmt: skip
    log = tmp_path / "app.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    bucket = LocalBucket(bucket_dir)
    status: dict = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            manifest = read_manifest(bucket)
            keys = [o.key for o in bucket.list(STATUS_PREFIX)]
            status = (get_json(bucket, keys[0]) or {}) if keys else {}
            if manifest is not None and manifest.step == STEPS and status.get("applied_step") == STEPS:
                break
            time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)  # the app stops its roles cleanly
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "through TRL AsyncGRPOTrainer" in text, text[-3000:]
    manifest = read_manifest(bucket)
    assert manifest is not None and manifest.step == STEPS, text[-3000:]
    assert status.get("applied_step") == STEPS and status["state_hash"] == manifest.state_hash, (status, text[-3000:])
    assert status["rehash_mismatches"] == 0  # the engine's own (fused) weights, re-hashed in checkpoint names
    late = Subscriber(bucket)  # the chain is in checkpoint names: one tensor per expert and projection
    kinds = [u.kind for u in late.sync()]
    assert "delta" in kinds and late.state_hash == manifest.state_hash
    assert sum(".mlp.experts." in n for n in late.state) == 2 * 8 * 3
