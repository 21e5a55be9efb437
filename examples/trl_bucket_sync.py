"""Your own TRL run, publishing every weight sync to a bucket that replicas anywhere follow bit-exactly.

    pip install "rlsync[trl] @ git+https://github.com/OWNER/rl-weight-sync#subdirectory=shared"
    python trl_bucket_sync.py --bucket hf://buckets/me/rl-sync --model Qwen/Qwen3-0.6B

Scored rollouts come from the bucket's scores/ (the env Space writes them); each sync is an anchor or a
sparse bf16 delta. A bucket that holds a run is continued (--resume) or replaced (--new-run), else refused.
"""

import argparse

import torch
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from rlsync.trl import BucketSync

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

sync = BucketSync(args.bucket, anchor_every=10, resume=args.resume, new_run=args.new_run)
gpu = torch.cuda.is_available()  # bf16 where the GPU supports it; CPU trains in fp32
config = AsyncGRPOConfig(
    output_dir=args.output_dir, learning_rate=args.lr, per_device_train_batch_size=args.batch_size, token_budget=0,
    max_steps=args.max_steps, save_steps=50, max_staleness=2, bf16=gpu and torch.cuda.is_bf16_supported(), use_cpu=not gpu,
)  # fmt: skip
prompts = Dataset.from_dict({"prompt": ["(prompts come from the bucket's tasks/)"]})
trainer = AsyncGRPOTrainer(model=args.model, args=config, train_dataset=prompts, **sync.trainer_kwargs())
sync.attach(trainer)  # guards, final sync, checkpoints into the bucket; continues or refuses an existing run
trainer.train(resume_from_checkpoint=sync.checkpoint)
trainer.save_model(args.output_dir)
print(f"trained {trainer.state.global_step} steps; published version {sync.version} to {sync.bucket.url}")
