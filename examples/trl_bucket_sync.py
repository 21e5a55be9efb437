"""Your own TRL run, publishing every weight sync to a bucket that replicas anywhere follow bit-exactly.

Install (one line), then run as is on a GPU or on CPU:

    pip install "rlsync[trl] @ git+https://github.com/OWNER/rl-weight-sync#subdirectory=shared"
    python trl_bucket_sync.py --bucket hf://buckets/me/rl-sync --model Qwen/Qwen3-0.6B

TRL's ``AsyncGRPOTrainer`` takes its scored rollouts from the bucket's ``scores/`` (written by the env
Space, or by anything that writes the same objects) and publishes each weight sync as an anchor or a
sparse bf16 delta. Replicas: ``python -m rollout_space --bucket URL`` (a rollout Space), or
``vllm serve`` with the ``bucket`` backend (README, "vLLM in the rollout fleet"). A ``hf://`` bucket needs
``HF_TOKEN`` with write access to it. bf16 training only where the GPU supports it; CPU runs in fp32.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from rlsync import FixedInterval, Publisher, open_bucket
from rlsync.spaces.exchange import read_samples  # parser of the scores/ objects (pure Python)
from rlsync.trl import (
    BucketCheckpoints,
    BucketRolloutWorker,
    BucketWeightTransfer,
    CheckpointCallback,
    FinalWeightSync,
    NonFiniteStepGuard,
    VersionGuard,
    apply_cpu_compat,
)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--bucket", default="./runs/bucket", help="hf://buckets/OWNER/NAME or a local folder")
parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model id or folder")
parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps")
parser.add_argument("--lr", type=float, default=1e-6, help="learning rate")
parser.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
parser.add_argument("--output-dir", default="out", help="local checkpoints; the final model is saved here")
parser.add_argument("--resume", action="store_true", help="continue the bucket's run from its newest checkpoint")
parser.add_argument("--new-run", action="store_true", help="start a new run, replacing the one in the bucket")
args = parser.parse_args()

bucket = open_bucket(args.bucket)
tokenizer = AutoTokenizer.from_pretrained(args.model)
# A bucket that holds a run is continued (--resume) or replaced (--new-run); anything else is refused.
restored = BucketCheckpoints(bucket).restore(args.output_dir) if args.resume else None
folder = restored[1] if restored else None
transfer = BucketWeightTransfer(
    publisher=Publisher(bucket, policy=FixedInterval(10)), resume_from_checkpoint=folder, new_run=args.new_run
)
worker = BucketRolloutWorker(bucket, read_samples, vocab_size=len(tokenizer), heartbeat=transfer.heartbeat)
apply_cpu_compat()  # replaces TRL's two GPU-only pieces when there is no GPU; nothing on a GPU with the kernel
on_gpu = torch.cuda.is_available()
config = AsyncGRPOConfig(
    output_dir=args.output_dir, learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
    token_budget=0, weight_sync_steps=1, max_staleness=2, max_steps=args.max_steps, save_steps=50,
    bf16=on_gpu and torch.cuda.is_bf16_supported(), use_cpu=not on_gpu, report_to=[],
)  # fmt: skip
trainer = AsyncGRPOTrainer(
    model=args.model, args=config, processing_class=tokenizer, rollout_worker=worker, weight_transfer=transfer,
    train_dataset=Dataset.from_dict({"prompt": ["(prompts come from the bucket's tasks/)"]}),
)  # fmt: skip
trainer.add_callback(FinalWeightSync(trainer))  # publish the last steps off the weight_sync_steps grid
trainer.add_callback(CheckpointCallback(BucketCheckpoints(bucket)))  # Trainer checkpoints into checkpoints/
trainer.add_callback(NonFiniteStepGuard())  # a NaN/Inf step never reaches the optimizer
trainer.add_callback(VersionGuard(trainer, transfer, worker))  # TRL's version stays the bucket's after a refused publish
trainer.train(resume_from_checkpoint=folder)
trainer.save_model(args.output_dir)
print(f"trained {trainer.state.global_step} steps; published version {transfer.version} to {bucket.url}")
