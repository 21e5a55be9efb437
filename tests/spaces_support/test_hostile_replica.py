"""Hostile task objects on the replica side (issue 26): prompts beyond the model's context and batches
whose work would exhaust a replica's memory are dropped or refused, and counted; the rest is generated
in chunks bounded in tokens."""

from __future__ import annotations

import resource

import pytest
from safetensors.torch import load_file

from rlsync.layout import rollout_key, task_key
from rlsync.protocol import FixedInterval, Publisher
from rlsync.spaces.exchange import get_json, put_json, read_samples
from rlsync.spaces.tiny_model import build_tiny_model
from rollout_space.replica import Replica, ReplicaConfig
from rollout_space.token_budget import TokenBudget, plan_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _replica(bucket, model_dir, **config) -> Replica:
    Publisher(bucket, policy=FixedInterval(100)).publish(0, {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()})
    replica = Replica(
        ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="transformers", model=str(model_dir),
                      device="cpu", samples_per_task=2, max_new_tokens=4, **config),
        bucket=bucket,
    )  # fmt: skip
    replica.slot.put(replica.subscriber.fetch())
    assert replica.apply_pending()
    return replica


def _tasks(bucket, batch: int, prompts: list[str]) -> None:
    put_json(bucket, task_key(batch), {"batch": batch, "tasks": [{"task_id": f"t{i}", "prompt": p} for i, p in enumerate(prompts)]})


def test_an_8mb_task_object_costs_a_replica_no_memory_and_is_counted(bucket, model_dir):
    replica = _replica(bucket, model_dir)
    _tasks(bucket, 0, ["reverse " + "1" * 8150 + " ="] * 1024)  # 8.4 MB, within the parser's limits
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert replica.answer(0) == 0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mib < 512  # generating it whole took 8.6 GB
    assert replica.refusals.counts["tasks"] == 1 and "longer than 252 tokens" in replica.refusals.last
    replica.close()


def test_prompts_beyond_the_context_are_dropped_and_the_rest_answered_in_chunks(bucket, model_dir):
    replica = _replica(bucket, model_dir, chunk_tokens=64)
    prompts = ["reverse 123 =", "reverse " + "9" * 400 + " =", "reverse 4567 =", "reverse 89 ="]
    _tasks(bucket, 0, prompts)
    assert replica.answer(0) == 3 * 2
    samples = read_samples(bucket, rollout_key(0, "r"))[1]
    assert {s.task_id for s in samples} == {"t0", "t2", "t3"}
    assert all(len(s.prompt_ids) + len(s.token_ids) <= 256 for s in samples)  # the tiny model's context
    assert replica.refusals.counts["tasks"] == 1
    replica.close()


def test_a_batch_beyond_the_token_budget_is_refused_whole(bucket, model_dir):
    replica = _replica(bucket, model_dir, max_batch_tokens=200)
    _tasks(bucket, 0, ["reverse 123 ="] * 20)
    assert replica.answer(0) == 0
    assert get_json(bucket, rollout_key(0, "r"))["samples"] == []  # answered (empty), so the fleet moves on
    assert "more than 200" in replica.refusals.last
    replica.close()


def test_plan_batch_chunks_keep_the_order_and_the_padded_bound():
    budget = TokenBudget(max_prompt_tokens=100, max_new_tokens=10, n=2, max_batch_tokens=10_000, chunk_tokens=200)
    plan = plan_batch([5, 200, 40, 40, 90, 1], budget)
    assert plan.dropped == [1] and plan.refused is None
    assert [i for chunk in plan.chunks for i in chunk] == [0, 2, 3, 4, 5]
    lengths = [5, 200, 40, 40, 90, 1]
    assert all(2 * len(c) * max(lengths[i] + 10 for i in c) <= 200 or len(c) == 1 for c in plan.chunks)


@pytest.mark.parametrize("configured", [0, 3 << 20])
def test_a_joining_replica_bounds_the_first_anchor_and_adapter_by_its_model(bucket, model_dir, configured):
    """Issue 33 item 4: before its first anchor a replica bounds what it downloads by its engine's model (the
    model's weights files) or the configured ``max_model_bytes``, for the weights and the adapter chain."""
    import json

    from rlsync.errors import FormatError
    from rlsync.layout import POINTER_KEY

    state = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    Publisher(bucket, policy=FixedInterval(100)).publish(0, state)
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["anchors"][0]["files"][0]["size"] = 2 << 30
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    replica = Replica(
        ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="transformers", model=str(model_dir), device="cpu",
                      lora=True, max_model_bytes=configured),
        bucket=bucket,
    )  # fmt: skip
    try:
        expected = configured or sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        assert replica.subscriber.max_state_bytes == replica.adapters.subscriber.max_state_bytes == expected
        with pytest.raises(FormatError, match="more than the model"):
            replica.subscriber.fetch()
        assert replica.subscriber.stats.reads == 1 and replica.subscriber.step is None
    finally:
        replica.close()
