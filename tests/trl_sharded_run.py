"""One rank of a TRL ``AsyncGRPOTrainer`` run with FSDP2 on gloo (CPU), for tests/library/trl/test_trl_sharded.py.

Launched by ``torchrun --nproc-per-node N tests/trl_sharded_run.py OPTIONS_JSON``. FSDP2 comes
from accelerate (``fsdp_config={"version": 2}``, :func:`rlsync.trl.allow_cpu_fsdp`), the weight
sync from :class:`rlsync.trl.ShardedWeightTransfer`, checkpoints in DCP's format
(:class:`rlsync.trl.ShardedCheckpointCallback`; ``resume``: :func:`rlsync.trl.restore_sharded`).

Every rank counts the gathers (``DTensor.full_tensor``/``redistribute`` and all-gather
collectives) made while TRL syncs weights. With ``reference`` set, after every sync (counted
apart) the ranks gather the weights through TRL's own iterator and rank 0 publishes them
single-process into the reference bucket with :class:`rlsync.trl.BucketWeightTransfer`: the
chain TRL's gathered path writes for the same weights. Rank 0 writes a JSON report to ``report``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

GATHERS = {"count": 0, "on": False}


class OptimizerProbe(TrainerCallback):
    """Hashes this rank's optimizer state when training begins (after a resume loaded it) and ends."""

    def __init__(self, report: dict) -> None:
        self.report = report

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.report["optimizer_begin"] = _optimizer_hash(optimizer)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self.report["optimizer_end"] = _optimizer_hash(optimizer)


def _count(owner, name):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        if GATHERS["on"]:
            GATHERS["count"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _optimizer_hash(optimizer) -> str:
    """Hash of this rank's local optimizer state (FSDP2: the shards of exp_avg, exp_avg_sq, step)."""
    from rlsync.hashing import state_hash

    tensors = {}
    for key, entry in optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            tensors[f"{key}.{name}"] = (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
    return state_hash(tensors)


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
    from rlsync.protocol.sharded_background import publish_group
    from rlsync.scores import read_samples
    from rlsync.spaces.tiny_model import tiny_model_path
    from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, FinalWeightSync, ShardedWeightTransfer
    from rlsync.trl import BucketCheckpoints, allow_cpu_fsdp, apply_cpu_compat
    from rlsync.trl.sharded_checkpoints import ShardedCheckpointCallback, restore_sharded
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
        learning_rate=1e-3, report_to=[], disable_tqdm=True, seed=0,
        save_strategy="steps" if options.get("save_steps") else "no", save_steps=options.get("save_steps") or 500,
        fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
                                        "state_dict_type": "SHARDED_STATE_DICT"},
    )  # fmt: skip
    report = {"gathers": [], "reference": [], "reference_gathers": [], "fp32_hashes": []}
    resume = bool(options.get("resume"))  # a second run continues the bucket's run (else it is refused)
    background = options.get("background", True)
    publisher = ShardedPublisher(bucket, policy=policy, owner="trainer", group=publish_group(120) if background else None)
    transfer = ShardedWeightTransfer(publisher=publisher, resume_from_checkpoint=resume, background=background)
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), poll_s=0.1)
    trainer = AsyncGRPOTrainer(
        model=path, args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["x"]}),
        rollout_worker=worker, weight_transfer=transfer,
    )  # fmt: skip
    transfer.attach(trainer)
    trainer.add_callback(FinalWeightSync(trainer, transfer))  # every rank flushes its background publisher
    trainer.add_callback(OptimizerProbe(report))
    checkpoints = BucketCheckpoints(bucket, chain=transfer.publisher)  # uploads pinned in its pointer
    trainer.add_callback(ShardedCheckpointCallback(checkpoints))
    resume_from = restore_sharded(checkpoints, options["out"]) if options.get("resume") else None
    rank = dist.get_rank()
    gathering_iter = AsyncGRPOTrainer._streaming_iter.__get__(trainer)  # TRL's own, gathering
    reference = (
        BucketWeightTransfer(
            publisher=Publisher(LocalBucket(options["reference"]), policy=policy), resume_from_checkpoint=resume, background=False
        )
        if options.get("reference") else None
    )  # fmt: skip
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
            full = dict(gathering_iter())
            if rank == 0:
                reference.send_weights(iter(full.items()))
                report["reference"].append([reference.records[-1].kind, reference.records[-1].state_hash])
                report["fp32_hashes"].append(state_hash({n: t.detach() for n, t in full.items()}))
            GATHERS["on"] = False
            report["reference_gathers"].append(GATHERS["count"])
        return marks

    AsyncGRPOTrainer._sync_weight_merged = counted_sync
    report["resumed_from"] = resume_from[0] if resume_from else None
    resume_path = str(resume_from[1]) if resume_from else None
    if rank == 0:
        with ScoreFeeder(bucket, tokenizer):
            trainer.train(resume_from_checkpoint=resume_path)
    else:
        trainer.train(resume_from_checkpoint=resume_path)
    full = {n: t.detach() for n, t in gathering_iter()}  # collective; after training, outside the counted window
    report["final_hash"] = state_hash({n: t.to(torch.bfloat16) for n, t in full.items()})
    report["final_fp32_hash"] = state_hash(full)
    report["records"] = [[r.step, r.kind, r.state_hash, len(r.keys)] for r in transfer.records]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {key: report[key] for key in ("gathers", "records", "optimizer_begin", "optimizer_end")})
    report["ranks"] = per_rank
    report["global_step"] = trainer.state.global_step
    report["coalesced"] = transfer.background.coalesced if transfer.background is not None else 0
    params = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
    report["sharded_params"] = sum(isinstance(p, DTensor) for p in params), len(params)
    if rank == 0:
        Path(options["report"]).write_text(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(json.loads(sys.argv[1]))
