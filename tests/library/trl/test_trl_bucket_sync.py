"""The TRL integration as one object (rlsync.trl.BucketSync): what it hands the trainer, what it wires
into it, the final publish off the sync grid with a replica bit-exact, and the refusal of a second run."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from env_space.environments import get_environment
from rlsync.errors import RunExistsError
from rlsync.hashing import state_hash
from rlsync.lora import LoraSpec
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.tiny_model import tiny_model_path
from rlsync.trl import BucketSync, CheckpointCallback, FinalWeightSync, NonFiniteStepGuard, VersionGuard
from tests.trl_feed import ScoreFeeder


def build(sync: BucketSync, path: str, out: str):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, max_steps=3, weight_sync_steps=2, per_device_train_batch_size=16,
        token_budget=0, learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return AsyncGRPOTrainer(model=path, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}), **sync.trainer_kwargs())


def test_one_object_trains_publishes_the_final_step_and_refuses_a_second_run(bucket, tmp_path):
    path = str(tiny_model_path(environments=get_environment))
    tokenizer = AutoTokenizer.from_pretrained(path)
    sync = BucketSync(bucket, anchor_every=2, poll_s=0.1)
    kwargs = sync.trainer_kwargs()
    assert kwargs == {"rollout_worker": sync.worker, "weight_transfer": sync.transfer}
    trainer = build(sync, path, str(tmp_path / "out"))
    assert sync.attach(trainer) is sync and sync.checkpoint is None  # an empty bucket: a fresh run
    wired = {type(c) for c in trainer.callback_handler.callbacks}
    assert {NonFiniteStepGuard, VersionGuard, CheckpointCallback, FinalWeightSync} <= wired
    assert sync.worker.vocab_size == len(tokenizer)
    with ScoreFeeder(bucket, tokenizer):
        trainer.train(resume_from_checkpoint=sync.checkpoint)
    sync.close()
    manifest = read_manifest(bucket)
    assert [r.step for r in sync.transfer.records] == [0, 1, 2] == list(range(manifest.step + 1))  # final step 3 published
    assert [r.kind for r in sync.transfer.records] == ["anchor", "delta", "anchor"]  # anchor_every=2
    sub = Subscriber(bucket)
    sub.sync()
    params = dict(trainer.model.named_parameters())
    assert sub.state_hash == manifest.state_hash == state_hash({n: params[n].detach().to(torch.bfloat16) for n in sub.state})
    # the same bucket again, neither resume nor new_run: refused when attached, nothing published
    again = BucketSync(bucket, owner="another")
    with pytest.raises(RunExistsError, match="new_run"):
        again.attach(build(again, path, str(tmp_path / "again")))
    again.close()
    assert read_manifest(bucket) == manifest


def test_lora_is_an_option_and_not_with_sharding(bucket):
    sync = BucketSync(bucket, lora=LoraSpec(4, 8, ("q_proj",)))
    assert sync.adapter_sync is not None and sync.transfer is sync.adapter_sync.transfer
    assert sync.publisher.bucket is not bucket and sync.worker.chain is sync.publisher.bucket  # the adapter chain
    assert "peft_config" in sync.trainer_kwargs()
    sync.close()
    with pytest.raises(ValueError, match="LoRA"):
        BucketSync(bucket, lora=LoraSpec(4, 8, ("q_proj",)), sharded=True)
