"""Synthetic scored rollouts for tests of the TRL trainer without replicas: a thread that
writes one scores object per poll, tagged with the bucket's current version; and the short
``AsyncGRPOTrainer`` run those tests train."""

from __future__ import annotations

import random
import threading

from rlsync.bucket import Bucket
from rlsync.layout import score_key
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import Sample, write_samples


def off_grid_trainer(path: str, tokenizer, out: str, worker, transfer, *, learning_rate: float, peft_config=None):
    """TRL's ``AsyncGRPOTrainer`` on the tiny model: 3 CPU steps, a weight sync every 2, so the last
    step is off the sync grid; scores come from ``worker``, publishes go to ``transfer``."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, max_steps=3, weight_sync_steps=2, per_device_train_batch_size=16,
        token_budget=0, learning_rate=learning_rate, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return AsyncGRPOTrainer(
        model=path, args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["x"]}),
        rollout_worker=worker, weight_transfer=transfer, peft_config=peft_config,
    )  # fmt: skip


class ScoreFeeder:
    """Writes ``tasks`` groups of ``group`` samples (random completions, rewards 0/1) every ``every_s``,
    tagged with the newest version of ``chain`` (default ``bucket``; the adapter chain in a LoRA run)."""

    def __init__(
        self, bucket: Bucket, tokenizer, tasks: int = 4, group: int = 4, every_s: float = 0.3, seed: int = 0,
        chain: Bucket | None = None,
    ) -> None:  # fmt: skip
        self.bucket, self.tokenizer, self.tasks, self.group, self.every_s = bucket, tokenizer, tasks, group, every_s
        self.chain = chain or bucket
        self.rng = random.Random(seed)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def write_one(self) -> bool:
        manifest = read_manifest(self.chain)
        if manifest is None:
            return False
        samples = []
        for t in range(self.tasks):
            prompt = self.tokenizer(f"reverse {self.batches}{t} =")["input_ids"]
            for _ in range(self.group):
                tokens = [self.rng.randrange(4, 14) for _ in range(4)]
                samples.append(Sample(f"t{t}", "p", "c", prompt, tokens, [-2.0] * 4, manifest.step, reward=float(self.rng.random() < 0.5)))
        write_samples(self.bucket, score_key(self.batches, "feed"), samples)
        self.batches += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.write_one()
            self._stop.wait(self.every_s)

    def __enter__(self) -> "ScoreFeeder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
