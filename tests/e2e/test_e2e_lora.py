"""End to end, a LoRA run: TRL's AsyncGRPOTrainer with a ``peft_config`` (``TRAINER_LORA_RANK``),
the environment and two replicas (``ROLLOUT_LORA=1``) as separate processes on one local bucket.

The base model is published once to the weights chain; every weight sync publishes an adapter
version to ``adapters/``; both replicas end serving the last published adapter bit-identically
(the engine's own peft adapter state dict, hashed), rollouts carry the adapter version, and the
reward rises. About 2.5 minutes on 2 cores."""

from __future__ import annotations

from env_space.environments import get_environment
from rlsync.adapters import AdapterChain, adapter_bucket, adapter_subscriber
from rlsync.bucket import LocalBucket
from rlsync.layout import metrics_key
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import get_json
from rlsync.spaces.tiny_model import tiny_model_path
from tests.e2e.test_e2e import reward_rise, role_env, run_roles

STEPS = 60


def test_lora_run_learns_and_replicas_serve_the_last_adapter_bit_identically(tmp_path):
    tiny_model_path(environments=get_environment)  # built once, before the processes race for it
    bucket_dir = tmp_path / "bucket"
    env = role_env(bucket_dir, STEPS, TRAINER_LORA_RANK="8", ROLLOUT_LORA="1")
    statuses, logs = run_roles(tmp_path, env, "adapter_step", STEPS)
    assert "(LoRA rank 8 on " in logs["trainer"], logs["trainer"][-3000:]
    bucket = LocalBucket(bucket_dir)
    adapters = read_manifest(adapter_bucket(bucket))
    assert adapters is not None and adapters.step == STEPS
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
    early, late_reward = reward_rise(env_rows, STEPS)
    assert late_reward >= early + 0.03, (early, late_reward)
