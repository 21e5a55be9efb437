"""One rank of a TRL ``AsyncGRPOTrainer`` run with FSDP2 on gloo (CPU), for tests/test_trl_sharded.py.

Launched by ``torchrun --nproc-per-node N tests/trl_sharded_run.py OPTIONS_JSON``. FSDP2 comes
from accelerate (``fsdp_config={"version": 2}``, :func:`rlsync.trl.allow_cpu_fsdp`), the weight
sync from :class:`rlsync.trl.ShardedWeightTransfer` (``mode="sharded"``) or TRL's own
gathering iterator into :class:`rlsync.trl.BucketWeightTransfer` (``mode="gathered"``).

Every rank counts the gathers (``DTensor.full_tensor``/``redistribute`` and all-gather
collectives) made while TRL syncs weights. With ``reference`` set, after every sync (outside
the counted window) the ranks gather the weights once more through TRL's iterator and rank 0
publishes them single-process into the reference bucket: the chain the gathered path would
have written for the same weights. Rank 0 writes a JSON report to ``report``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

GATHERS = {"count": 0, "on": False}


def _count(owner, name):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        if GATHERS["on"]:
            GATHERS["count"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def main(options: dict) -> None:
    import torch.distributed._functional_collectives as funcol
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from env_space.environments import get_environment
    from rlsync.bucket import LocalBucket
    from rlsync.hashing import state_hash
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.protocol.sharded import ShardedPublisher
    from rlsync.spaces.exchange import read_samples
    from rlsync.spaces.tiny_model import tiny_model_path
    from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, FinalWeightSync, ShardedWeightTransfer
    from rlsync.trl import allow_cpu_fsdp, apply_cpu_compat
    from tests.trl_feed import ScoreFeeder

    torch.set_num_threads(1)
    for owner, name in [(DTensor, "full_tensor"), (DTensor, "redistribute"), (dist, "all_gather_into_tensor"),
                        (dist, "all_gather"), (funcol, "all_gather_tensor")]:  # fmt: skip
        _count(owner, name)
    apply_cpu_compat()
    allow_cpu_fsdp()
    path = str(tiny_model_path(environments=get_environment))
    tokenizer = AutoTokenizer.from_pretrained(path)
    bucket = LocalBucket(options["bucket"])
    policy = FixedInterval(options.get("anchor_every", 3))
    args = AsyncGRPOConfig(
        output_dir=options["out"], use_cpu=True, bf16=False, max_steps=options["max_steps"],
        weight_sync_steps=options.get("weight_sync_steps", 1), per_device_train_batch_size=8, token_budget=0,
        learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]},
    )  # fmt: skip
    sharded = options.get("mode", "sharded") == "sharded"
    if sharded:
        transfer = ShardedWeightTransfer(publisher=ShardedPublisher(bucket, policy=policy, owner="trainer"))
    else:
        transfer = BucketWeightTransfer(publisher=Publisher(bucket, policy=policy, owner="trainer"))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), poll_s=0.1)
    trainer = AsyncGRPOTrainer(
        model=path, args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["x"]}),
        rollout_worker=worker, weight_transfer=transfer,
    )  # fmt: skip
    if sharded:
        transfer.attach(trainer)
    trainer.add_callback(FinalWeightSync(trainer))
    rank = dist.get_rank()
    gathering_iter = AsyncGRPOTrainer._streaming_iter.__get__(trainer)  # TRL's own, gathering
    reference = BucketWeightTransfer(publisher=Publisher(LocalBucket(options["reference"]), policy=policy)) if options.get("reference") else None
    report = {"gathers": [], "reference": [], "reference_gathers": []}
    original = AsyncGRPOTrainer._sync_weight_merged

    def counted_sync(self, t0):
        GATHERS["count"], GATHERS["on"] = 0, True
        try:
            marks = original(self, t0)
        finally:
            GATHERS["on"] = False
        report["gathers"].append(GATHERS["count"])
        if reference is not None:  # test only: the gathered path's chain for the same weights (its gathers counted apart)
            GATHERS["count"], GATHERS["on"] = 0, True
            if rank == 0:
                reference.send_weights(gathering_iter())
                report["reference"].append([reference.records[-1].kind, reference.records[-1].state_hash])
            else:
                for _ in gathering_iter():
                    pass
            GATHERS["on"] = False
            report["reference_gathers"].append(GATHERS["count"])
        return marks

    AsyncGRPOTrainer._sync_weight_merged = counted_sync
    if rank == 0:
        with ScoreFeeder(bucket, tokenizer):
            trainer.train()
    else:
        trainer.train()
    full = {n: t for n, t in gathering_iter()}  # collective; after training, outside the counted window
    report["final_hash"] = state_hash({n: t.detach().to(torch.bfloat16) for n, t in full.items()})
    report["records"] = [[r.step, r.kind, r.state_hash, len(r.keys)] for r in transfer.records] if transfer.records else None
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"gathers": report["gathers"], "records": report["records"]})
    report["ranks"] = per_rank
    report["global_step"] = trainer.state.global_step
    params = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
    report["sharded_params"] = sum(isinstance(p, DTensor) for p in params), len(params)
    if rank == 0:
        Path(options["report"]).write_text(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(json.loads(sys.argv[1]))
