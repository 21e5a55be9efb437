"""A LoRA run of TRL's AsyncGRPOTrainer (``peft_config``) publishes its adapter, not merged weights:
the base once to the weights chain, then one adapter version per weight sync to ``adapters/``,
bit-exact with the trainer's adapter; the base weights are never touched (no merge/unmerge);
a bucket holding another base is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

pytest.importorskip("peft")

from env_space.environments import get_environment  # noqa: E402
from rlsync.adapters import AdapterChain, LoraSpec, adapter_bucket, adapter_subscriber  # noqa: E402
from rlsync.lora import base_parameters, peft_config  # noqa: E402
from rlsync.errors import SyncError  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.protocol import Subscriber, read_manifest  # noqa: E402
from rlsync.spaces.tiny_model import tiny_model_path  # noqa: E402
from tests.trl_feed import ScoreFeeder, off_grid_trainer  # noqa: E402

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


def test_peft_run_publishes_adapter_versions_bit_exactly_and_never_merges(bucket, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from rlsync.scores import read_samples
    from rlsync.trl import BucketAdapterSync, BucketRolloutWorker, FinalWeightSync, apply_cpu_compat

    apply_cpu_compat()
    path = str(tiny_model_path(environments=get_environment))
    tokenizer = AutoTokenizer.from_pretrained(path)
    sync = BucketAdapterSync(bucket)
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), poll_s=0.1, chain=adapter_bucket(bucket))
    trainer = off_grid_trainer(
        path, tokenizer, str(tmp_path / "out"), worker, sync.transfer, learning_rate=1e-2, peft_config=peft_config(LORA)
    )
    chain = sync.attach(trainer)
    trainer.add_callback(FinalWeightSync(trainer))
    base_before = {n: p.detach().clone() for n, p in base_parameters(trainer.model)}
    with ScoreFeeder(bucket, tokenizer, chain=adapter_bucket(bucket)):
        trainer.train()
    sync.transfer.close()
    # the base: one anchor of the weights chain, named by the adapter chain, never modified by a sync
    weights = read_manifest(bucket)
    assert weights.step == 0 and chain == AdapterChain.from_manifest(read_manifest(adapter_bucket(bucket)))
    assert chain.base_hash == weights.state_hash and chain.lora == LORA
    base_after = dict(base_parameters(trainer.model))
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)  # bit-equal: never merged
    replica_base = Subscriber(bucket)
    replica_base.sync()
    assert replica_base.state_hash == state_hash({n: t.to(torch.bfloat16) for n, t in base_before.items()})
    # the adapter: train begin, step 2, the final step 3; bit-exact with the trainer's adapter
    assert [r.step for r in sync.transfer.records] == [0, 1, 2] and trainer.model_version == 3
    sub = adapter_subscriber(bucket, replica_base.state_hash)
    sub.sync()
    trained = {n: t.to(torch.bfloat16) for n, t in get_peft_model_state_dict(trainer.model).items()}
    assert sub.step == 2 and sub.state_hash == state_hash(trained) == state_hash(sub.state)
    assert sub.state.keys() == trained.keys() and all("lora_" in n for n in trained)
    assert any(r.kind == "delta" for r in sync.transfer.records)
    # the adapter moved (the run trained), and a trainer with another base is refused
    assert state_hash(trained) != sync.transfer.records[0].state_hash
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "lora_" not in n).add_(1.0)
    refused = BucketAdapterSync(bucket)
    with pytest.raises(SyncError, match="another base model"):
        refused.attach(trainer)
    refused.transfer.close()
