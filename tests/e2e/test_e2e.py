"""End to end: the TRL trainer (AsyncGRPOTrainer with the bucket plug-ins), two replicas
and the environment as separate processes on one local bucket. Rewards flow, deltas are
published, every replica ends bit-identical to the trainer's last published state, and
the policy learns the reverse task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from env_space.environments import get_environment
from rlsync.bucket import LocalBucket
from rlsync.layout import metrics_key, status_key
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.exchange import get_json
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60


def spawn(module: str, env: dict, log: Path, level: str = "WARNING") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--log-level", level],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def role_env(bucket_dir: Path, steps: int, **settings: str) -> dict:
    """The three roles' environment variables for a short CPU run on ``bucket_dir`` (``settings`` added)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TRAINER_BUCKET": str(bucket_dir), "ROLLOUT_BUCKET": str(bucket_dir), "ENV_BUCKET": str(bucket_dir),
        "TRAINER_MAX_STEPS": str(steps), "TRAINER_ANCHOR_INTERVAL": "8",
        "TRAINER_BATCH_SIZE": "32", "TRAINER_SEED": "0", "TRAINER_SYNC_EVERY": "1",
        "ROLLOUT_REHASH_EVERY_S": "0.2", "ROLLOUT_POLL_S": "0.2", "ENV_POLL_S": "0.2", "TRAINER_POLL_S": "0.2",
        **settings,
    }  # fmt: skip


def run_roles(tmp_path: Path, env: dict, done: str, steps: int, replicas: int = 2) -> tuple[list[dict], dict[str, str]]:
    """Run the trainer until its ``max_steps``, the environment and ``replicas`` replicas as processes, then wait
    up to 60 s for every replica's status field ``done`` to reach ``steps``, and stop them all.

    Returns:
        The replicas' last status objects and each role's log tail (``"trainer"``: its whole log).
    """
    procs = {"trainer": spawn("trainer_space", env, tmp_path / "trainer.log", "INFO")}
    procs["env"] = spawn("env_space", env, tmp_path / "env.log")
    for i in range(replicas):
        procs[f"r{i}"] = spawn("rollout_space", {**env, "ROLLOUT_REPLICA_ID": f"r{i}", "ROLLOUT_SEED": str(i)}, tmp_path / f"r{i}.log")
    bucket = LocalBucket(env["TRAINER_BUCKET"])
    statuses: list[dict] = []
    try:
        procs["trainer"].wait(timeout=420)
        trainer_log = (tmp_path / "trainer.log").read_text()
        assert procs["trainer"].returncode == 0, trainer_log[-3000:]
        deadline = time.time() + 60
        while time.time() < deadline:
            statuses = [get_json(bucket, status_key(f"r{i}")) or {} for i in range(replicas)]
            if all(s.get(done) == steps for s in statuses):
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=60)
    logs = {name: (tmp_path / f"{name}.log").read_text()[-2000:] for name in procs}
    logs["trainer"] = (tmp_path / "trainer.log").read_text()
    return statuses, logs


def reward_rise(env_rows: list[dict], steps: int) -> tuple[float, float]:
    """The environment's mean reward of samples from the first 10 and the last 10 versions (printed)."""

    def mean_reward(versions):
        picked = [r for r in env_rows if r["version"] in versions]
        return sum(r["mean_reward"] * r["count"] for r in picked) / sum(r["count"] for r in picked)

    early, late = mean_reward(range(0, 10)), mean_reward(range(steps - 10, steps + 1))
    print(json.dumps({"reward_first_10_versions": early, "reward_last_10_versions": late}))
    return early, late


def test_three_roles_learn_and_replicas_end_bit_identical(tmp_path):
    tiny_model_path(environments=get_environment)  # built once, before the processes race for it
    bucket_dir = tmp_path / "bucket"
    statuses, logs = run_roles(tmp_path, role_env(bucket_dir, STEPS, TRAINER_LR="5e-4"), "applied_step", STEPS)
    assert "through TRL AsyncGRPOTrainer" in logs["trainer"], logs["trainer"][-3000:]
    bucket = LocalBucket(bucket_dir)
    manifest = read_manifest(bucket)
    assert manifest is not None and manifest.step == STEPS
    for s in statuses:
        assert s.get("applied_step") == STEPS, (statuses, logs)
        assert s["state_hash"] == manifest.state_hash, logs
        assert s["rehashes"] > 0 and s["rehash_mismatches"] == 0, logs  # the engine's own weights, re-hashed
        if s["engine_verified_step"] == STEPS:
            assert s["engine_state_hash"] == manifest.state_hash, logs
        assert s["completions"] > 0 and s["idle_per_sync_s"] is not None
    # an independent replica that joins now gets the same bits
    late = Subscriber(bucket)
    late.sync()
    assert late.state_hash == manifest.state_hash
    # deltas were published, and anchors at the configured interval
    rows = get_json(bucket, metrics_key("trainer"))["rows"]
    kinds = {r["version"]: r["kind"] for r in rows if r["kind"] != "train"}
    assert [v for v, k in sorted(kinds.items()) if k == "anchor"] == list(range(0, STEPS + 1, 8))
    assert sum(1 for k in kinds.values() if k == "delta") == STEPS - STEPS // 8
    assert all(r["nbytes"] < 0.5 * manifest.newest_anchor.nbytes for r in rows if r["kind"] == "delta")
    # rewards flowed from the env to the trainer
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == STEPS and all(0.0 <= r["mean_reward"] <= 1.0 for r in train)
    env_rows = get_json(bucket, metrics_key("env"))["rows"]
    assert len({r["version"] for r in env_rows}) > STEPS // 2
    # the policy learned: mean reward of samples from the last versions beats the first ones
    early, late_reward = reward_rise(env_rows, STEPS)
    assert late_reward >= early + 0.05, (early, late_reward)
