"""MoE models end to end on the transformers side: the tiny Qwen3-MoE built offline, its fused expert
parameters published in checkpoint names (one tensor per expert), a TRL ``AsyncGRPOTrainer`` run
publishing through the bucket, and a transformers replica writing each delta into the fused experts
in place, bit-exact with the trainer after several deltas."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from env_space.environments import get_environment
from rlsync.bucket import LocalBucket
from rlsync.checkpoint_layout import CheckpointLayout
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.spaces.tiny_model import TINY_MOE_CONFIG, TinyModel, build_tiny_model, tiny_model_path
from tests.helpers import sparse_rl_step


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "m", seed=0, kind=TinyModel.MOE)


def test_the_tiny_moe_is_built_offline_deterministically(moe_path, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0, kind=TinyModel.MOE)
    assert (again / "model.safetensors").read_bytes() == (moe_path / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(moe_path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == TINY_MOE_CONFIG["num_experts"] and model.config.num_experts_per_tok == 2
    names = load_file(str(moe_path / "model.safetensors"))
    experts = {n for n in names if ".mlp.experts." in n}
    assert len(experts) == 3 * model.config.num_experts * model.config.num_hidden_layers  # gate, up, down per expert


def test_checkpoint_layout_is_the_checkpoint_as_views_of_the_fused_experts(moe_path):
    model = AutoModelForCausalLM.from_pretrained(moe_path)
    layout = CheckpointLayout.of_model(model)
    assert layout.parts and all(".mlp.experts." in n for n in layout.parts)  # only the fused experts are converted
    state = layout.checkpoint_state(model.state_dict())
    saved = load_file(str(moe_path / "model.safetensors"))
    assert state.keys() == saved.keys() and all(torch.equal(state[n], saved[n]) for n in saved)
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    gate = state["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert gate.data_ptr() == fused[1].data_ptr()  # a view: nothing copied, writes land in the model
    assert CheckpointLayout.from_pretrained(moe_path).parts == layout.parts  # also found on the meta device


def test_transformers_replica_applies_deltas_to_the_fused_experts_bit_exact(moe_path, tmp_path):
    from rollout_space.engines.transformers_engine import TransformersEngine

    master = {n: t.float() for n, t in load_file(str(moe_path / "model.safetensors")).items()}
    bucket = LocalBucket(tmp_path)
    pub = Publisher(bucket, policy=FixedInterval(100))
    sub = Subscriber(bucket)
    engine = TransformersEngine(moe_path)
    assert sorted(engine.checkpoint_names()) == sorted(master)
    for step in range(4):
        if step:
            sparse_rl_step(master, 70 + step)
        pub.publish(step, master)
        update = sub.fetch()
        sub.apply(update)
        engine.load_state(sub.state) if update.kind == "anchor" else engine.apply_patches(update.patches)
        assert state_hash(engine.state_dict()) == sub.state_hash == state_hash({n: t.to(torch.bfloat16) for n, t in master.items()})
    fused = dict(engine.model.named_parameters())["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(fused[2], master["model.layers.1.mlp.experts.2.down_proj.weight"].to(torch.bfloat16))


def test_trl_run_publishes_the_moe_and_a_replica_follows_bit_exact(tmp_path):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rollout_space.engines.transformers_engine import TransformersEngine
    from rlsync.spaces.exchange import read_samples
    from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, FinalWeightSync, apply_cpu_compat
    from tests.trl_feed import ScoreFeeder

    apply_cpu_compat()
    path = str(tiny_model_path(kind=TinyModel.MOE, environments=get_environment))
    tokenizer = AutoTokenizer.from_pretrained(path)
    bucket = LocalBucket(tmp_path / "bucket")
    transfer = BucketWeightTransfer(
        publisher=Publisher(bucket, policy=FixedInterval(100)), layout=CheckpointLayout.from_pretrained(path)
    )
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), poll_s=0.1)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=4, weight_sync_steps=1,
        per_device_train_batch_size=16, token_budget=0, learning_rate=1e-3, report_to=[], save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=path, args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["x"]}),
        rollout_worker=worker, weight_transfer=transfer,
    )  # fmt: skip
    trainer.add_callback(FinalWeightSync(trainer))
    engine = TransformersEngine(path)
    replica = Subscriber(bucket)
    with ScoreFeeder(bucket, tokenizer):
        trainer.train()
    transfer.close()
    kinds, patched = [], set()
    while (update := replica.fetch()) is not None:  # the replica follows every version, delta by delta
        replica.apply(update)
        patched.update(update.patches or ())
        engine.load_state(replica.state) if update.kind == "anchor" else engine.apply_patches(update.patches)
        assert state_hash(engine.state_dict()) == update.state_hash
        kinds.append(update.kind)
    assert kinds[0] == "anchor" and kinds.count("delta") >= 3
    trained = CheckpointLayout.of_model(trainer.model).checkpoint_state(
        {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.state_dict().items()}
    )
    assert replica.state_hash == state_hash(trained) == state_hash(engine.state_dict())
    assert any(".mlp.experts." in n for n in patched)  # deltas reached the fused experts
    assert replica.state_hash != transfer.records[0].state_hash  # it trained


def test_a_model_setting_of_tiny_moe_trains_and_serves_the_tiny_moe():
    from rlsync.spaces.tiny_model import is_tiny_model, model_or_default
    from trainer_space.config import TINY_MODEL_LR, TrainerConfig

    path = model_or_default(TinyModel.MOE.value, "cuda", get_environment)  # named: even where a GPU default exists
    assert path == str(tiny_model_path(kind=TinyModel.MOE, environments=get_environment))
    assert is_tiny_model("tiny-moe", "cuda") and not is_tiny_model("Qwen/Qwen3-30B-A3B", "cpu")
    assert TrainerConfig(model="tiny-moe").with_model_defaults("cuda").lr == TINY_MODEL_LR  # the tiny demo's settings
    assert CheckpointLayout.from_pretrained(path).parts  # what the trainer Space gives its transfer


def test_per_expert_change_rates_reach_the_panel(moe_path, tmp_path):
    from rlsync.checkpoint_layout import expert_changed_pct, expert_of
    from rlsync.spaces.frames import expert_change_frame
    from rlsync.spaces.metrics import TrainerMetrics
    from rlsync.spaces.snapshots import Snapshot

    state = {n: t.float() for n, t in load_file(str(moe_path / "model.safetensors")).items()}
    pub = Publisher(LocalBucket(tmp_path), policy=FixedInterval(100))
    pub.publish(0, state)
    touched = "model.layers.1.mlp.experts.3.up_proj.weight"
    state[touched].view(-1)[:1638] += 1.0  # 10 % of one of expert 1.3's three tensors, nothing else
    record = pub.publish(1, state)
    assert record.changed_tensors == {touched: 1638}
    assert expert_of(touched) == "1.3" and expert_of("model.layers.1.mlp.gate.weight") is None
    rates = expert_changed_pct(record.changed_tensors, pub.detector.published)
    assert len(rates) == 2 * TINY_MOE_CONFIG["num_experts"] and list(rates)[:2] == ["0.0", "0.1"]
    assert rates["1.3"] == pytest.approx(100 * 1638 / (3 * 128 * 128)) and sum(rates.values()) == rates["1.3"]
    rows = [{"kind": "anchor", "version": 0}, {"kind": "delta", "version": 1, "experts_changed_pct": rates}]
    frame = expert_change_frame(Snapshot(trainer=TrainerMetrics.from_json({"rows": rows})))
    assert len(frame) == len(rates) and frame.set_index("expert").loc["1.3", "changed_pct"] == rates["1.3"]
    assert expert_change_frame(Snapshot(trainer=TrainerMetrics.from_json({"rows": rows[:1]}))).empty  # a dense model: an empty plot
