"""End to end, a LoRA run: TRL's AsyncGRPOTrainer with a ``peft_config`` (``TRAINER_LORA_RANK``),
the environment and two replicas (``ROLLOUT_LORA=1``) as separate processes on one local bucket.

The base model is published once to the weights chain; every weight sync publishes an adapter
version to ``adapters/``; both replicas end serving the last published adapter bit-identically
(the engine's own peft adapter state dict, hashed), rollouts carry the adapter version, and the
reward rises. About 2.5 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from env_space.environments import get_environment
from rlsync.adapters import AdapterChain, adapter_bucket, adapter_subscriber
from rlsync.bucket import LocalBucket
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import get_json, metrics_key, status_key
from rlsync.spaces.tiny_model import tiny_model_path
from tests.test_e2e import ROOT, spawn

STEPS = 60


def test_lora_run_learns_and_replicas_serve_the_last_adapter_bit_identically(tmp_path):
    tiny_model_path(environments=get_environment)  # built once, before the processes race for it
    bucket_dir = tmp_path / "bucket"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]),  # this checkout's rlsync, installed or not
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TRAINER_BUCKET": str(bucket_dir), "ROLLOUT_BUCKET": str(bucket_dir), "ENV_BUCKET": str(bucket_dir),
        "TRAINER_MAX_STEPS": str(STEPS), "TRAINER_LORA_RANK": "8", "TRAINER_ANCHOR_INTERVAL": "8",
        "TRAINER_BATCH_SIZE": "32", "TRAINER_SEED": "0", "TRAINER_SYNC_EVERY": "1",
        "ROLLOUT_LORA": "1", "ROLLOUT_VERIFY_ENGINE": "1", "ROLLOUT_POLL_S": "0.2", "ENV_POLL_S": "0.2",
        "TRAINER_POLL_S": "0.2",
    }  # fmt: skip
    procs = {"trainer": spawn("trainer_space", env, tmp_path / "trainer.log", "INFO")}
    procs["env"] = spawn("env_space", env, tmp_path / "env.log")
    for i in range(2):
        procs[f"r{i}"] = spawn("rollout_space", {**env, "ROLLOUT_REPLICA_ID": f"r{i}", "ROLLOUT_SEED": str(i)}, tmp_path / f"r{i}.log")
    bucket = LocalBucket(bucket_dir)
    try:
        procs["trainer"].wait(timeout=420)
        trainer_log = (tmp_path / "trainer.log").read_text()
        assert procs["trainer"].returncode == 0, trainer_log[-3000:]
        assert "(LoRA rank 8 on " in trainer_log, trainer_log[-3000:]
        adapters = read_manifest(adapter_bucket(bucket))
        assert adapters is not None and adapters.step == STEPS
        deadline = time.time() + 60
        while time.time() < deadline:
            statuses = [get_json(bucket, status_key(f"r{i}")) or {} for i in range(2)]
            if all(s.get("adapter_step") == STEPS for s in statuses):
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=60)
    logs = {name: (tmp_path / f"{name}.log").read_text()[-2000:] for name in procs}
    weights = read_manifest(bucket)
    assert weights.step == 0 and len(weights.anchors) == 1  # the base, published once
    chain = AdapterChain.from_manifest(adapters)
    assert chain.base_hash == weights.state_hash and chain.lora.rank == 8
    for s in statuses:
        assert s.get("adapter_step") == STEPS, (statuses, logs)
        assert s["state_hash"] == s["engine_state_hash"] == weights.state_hash, logs  # the base, in the engine
        assert s["adapter_hash"] == adapters.state_hash, logs
        assert s["engine_adapter_hash"] == adapters.state_hash, logs  # the engine's own adapter, hashed
        assert s["adapter_refused"] == 0 and s["completions"] > 0
        assert len(s["adapters_served"]) <= 3  # the window: older versions were dropped
    late = adapter_subscriber(bucket, weights.state_hash)  # a replica joining now gets the same bits
    late.sync()
    assert late.state_hash == adapters.state_hash
    # adapter versions were published as anchors and deltas, deltas smaller than the whole adapter
    rows = get_json(bucket, metrics_key("trainer"))["rows"]
    kinds = {r["version"]: r["kind"] for r in rows if r["kind"] != "train"}
    assert [v for v, k in sorted(kinds.items()) if k == "anchor"] == list(range(0, STEPS + 1, 8))
    assert all(r["nbytes"] < adapters.newest_anchor.nbytes for r in rows if r["kind"] == "delta")
    # rollouts carried the adapter version, and the policy learned
    env_rows = get_json(bucket, metrics_key("env"))["rows"]
    assert len({r["version"] for r in env_rows}) > STEPS // 2 and max(r["version"] for r in env_rows) <= STEPS

    def mean_reward(versions):
        picked = [r for r in env_rows if r["version"] in versions]
        return sum(r["mean_reward"] * r["count"] for r in picked) / sum(r["count"] for r in picked)

    early, late_reward = mean_reward(range(0, 10)), mean_reward(range(STEPS - 10, STEPS + 1))
    print(json.dumps({"reward_first_10_versions": early, "reward_last_10_versions": late_reward}))
    assert late_reward >= early + 0.03, (early, late_reward)
