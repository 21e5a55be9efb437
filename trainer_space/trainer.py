"""The trainer role: learns from scored rollouts and publishes weights to the bucket.

Loop: read scored groups from ``scores/``, drop samples more than
``max_staleness`` versions old, take an AdamW step on the GRPO loss, and every
``sync_every`` optimizer steps publish the weights (bf16) through the shared
:class:`~shared.protocol.Publisher`: an anchor or a sparse delta, as the anchor
policy decides. The policy can be changed while running through the bucket's
control object, from this Space's panel or any other.

A restart resumes from the newest published state in the bucket (version
numbers continue). The fp32 master weights and optimizer state are not in the
bucket, so a restarted trainer continues from the bf16 weights with a fresh
optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from env_space.environments import get_environment
from shared.bucket import Bucket, BucketError, open_bucket
from shared.codecs import default_codec
from shared.protocol import CONTROL_KEY, Adaptive, FixedInterval, NonFiniteError, Publisher, policy_to_json
from shared.spaces.exchange import SCORES_PREFIX, MetricsLog, Refusals, Sample, SampleLimits, list_batches, read_samples
from shared.spaces.settings import from_env, resolve_device
from shared.spaces.tiny_model import model_or_default

from .grpo import grpo_loss

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainerConfig:
    """Settings of the trainer Space (environment variables ``TRAINER_<FIELD>``)."""

    bucket: str = dataclasses.field(default="./runs/bucket", metadata={"help": "bucket URL or path (write access)"})
    model: str = dataclasses.field(default="", metadata={"help": "model name or folder (default: Qwen/Qwen3-0.6B on a GPU, the tiny offline model on CPU)"})
    device: str = dataclasses.field(default="auto", metadata={"help": "torch device ('auto': cuda if available, else cpu)"})
    lr: float = dataclasses.field(default=3e-4, metadata={"help": "AdamW learning rate"})
    weight_decay: float = dataclasses.field(default=0.0, metadata={"help": "AdamW weight decay"})
    groups_per_step: int = dataclasses.field(default=8, metadata={"help": "task groups per optimizer step"})
    sync_every: int = dataclasses.field(default=1, metadata={"help": "optimizer steps per publish"})
    max_staleness: int = dataclasses.field(default=2, metadata={"help": "drop samples this many versions behind"})
    max_buffered_groups: int = dataclasses.field(default=64, metadata={"help": "newest groups kept waiting for a step"})
    clip_eps: float = dataclasses.field(default=0.2, metadata={"help": "importance-ratio clip"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature of the replicas"})
    anchor_policy: str = dataclasses.field(default="fixed", metadata={"help": "'fixed' or 'adaptive'"})
    anchor_interval: int = dataclasses.field(default=10, metadata={"help": "publishes per anchor (fixed policy)"})
    max_catchup_ratio: float = dataclasses.field(default=2.0, metadata={"help": "adaptive policy bound, in anchors"})
    keep_anchors: int = dataclasses.field(default=2, metadata={"help": "anchors retained in the bucket"})
    codec: str = dataclasses.field(default="auto", metadata={"help": "delta codec: 'classgap', 'gapzz', 'trl' or 'auto' (classgap on a GPU, gapzz on CPU)"})
    max_steps: int = dataclasses.field(default=0, metadata={"help": "stop after this many optimizer steps (0: never)"})
    poll_s: float = dataclasses.field(default=0.5, metadata={"help": "seconds between bucket polls"})
    seed: int = dataclasses.field(default=0, metadata={"help": "torch seed"})
    trainer_id: str = dataclasses.field(default="", metadata={"help": "run-lock owner id; a restart with the same id takes over (default: SPACE_ID or host name)"})

    @classmethod
    def from_env(cls, **overrides) -> "TrainerConfig":
        return from_env(cls, "TRAINER", **overrides)

    def policy(self):
        if self.anchor_policy == "adaptive":
            return Adaptive(self.max_catchup_ratio)
        return FixedInterval(self.anchor_interval)


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names; tied duplicates keep their first name."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        key = tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor
    return state


class Trainer:
    """Async GRPO trainer publishing through the bucket.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: TrainerConfig, bucket: Bucket | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(config.seed)
        self.bucket = bucket or open_bucket(config.bucket)
        device = resolve_device(config.device)
        config = dataclasses.replace(config, device=device, codec=default_codec(device) if config.codec == "auto" else config.codec)
        self.config = config
        model = model_or_default(config.model, config.device, get_environment)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(config.device)
        self.model.train()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.publisher = Publisher(
            self.bucket, policy=config.policy(), keep_anchors=config.keep_anchors, codec=config.codec,
            owner=config.trainer_id or None,
        )  # fmt: skip
        self._last_heartbeat = time.time()
        self.metrics = MetricsLog(self.bucket, "trainer")
        self.version: int | None = None
        self.opt_steps = 0
        self.consumed: set[str] = set()
        self.buffer: list[list[Sample]] = []
        self.dropped_stale = 0
        self.refusals = Refusals()
        self.non_finite_refused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- weights ------------------------------------------------------------

    def setup(self) -> None:
        """Resume from the bucket, or publish the initial weights as version 0."""
        if self.version is not None:
            return
        state = self.publisher.resume()
        if state is None:
            self.version = 0
            self._publish()
            return
        names = checkpoint_state(self.model)
        with torch.no_grad():
            for name, tensor in state.items():
                names[name].copy_(tensor.to(names[name].dtype))
        self.version = self.publisher.step
        logger.info("trainer resumed at version %d", self.version)

    def _publish(self) -> None:
        assert self.version is not None
        state = {n: t.detach() for n, t in checkpoint_state(self.model).items()}
        try:
            rec = self.publisher.publish(self.version, state)
        except NonFiniteError as exc:  # never publish a poisoned model: go back to the published weights
            logger.error("%s; restoring the published weights and resetting the optimizer", exc)
            self.non_finite_refused += 1
            self.version -= 1
            with torch.no_grad():
                for name, tensor in checkpoint_state(self.model).items():
                    tensor.copy_(self.publisher.detector.published[name].to(tensor.dtype))
            self.optimizer.state.clear()
            return
        self.metrics.add(
            kind=rec.kind, version=rec.step, nbytes=rec.nbytes, changed_pct=100 * rec.changed_fraction,
            encode_s=rec.encode_s, hash_s=rec.hash_s, upload_s=rec.upload_s, catchup_bytes=rec.catchup_bytes,
        )  # fmt: skip

    def set_anchor_policy(self, policy: str, interval: int = 10, max_catchup_ratio: float = 2.0) -> None:
        """Change the anchor policy for the next publish, through the bucket's control object
        (so it also reaches a trainer running in another Space)."""
        new = Adaptive(max_catchup_ratio) if policy == "adaptive" else FixedInterval(int(interval))
        self.bucket.put(CONTROL_KEY, policy_to_json(new))

    # -- data ---------------------------------------------------------------

    def collect(self) -> int:
        """Read new scored objects into the group buffer; returns groups added.

        Scored objects stay in the bucket (the environment prunes old batches), so
        every Space can tell answered batches from waiting ones.
        """
        added = 0
        for batch, keys in sorted(list_batches(self.bucket, SCORES_PREFIX).items()):
            for key in keys:
                if key in self.consumed:
                    continue
                self.consumed.add(key)
                limits = SampleLimits(
                    vocab_size=self.model.get_input_embeddings().num_embeddings, max_version=self.version,
                    max_total_tokens=getattr(self.model.config, "max_position_embeddings", None),
                )  # fmt: skip
                read = read_samples(self.bucket, key, limits=limits, refusals=self.refusals)
                if read is None:
                    continue
                groups: dict[str, list[Sample]] = {}
                for s in read[1]:
                    if s.reward is None:
                        continue
                    if self.version is not None and s.version < self.version - self.config.max_staleness:
                        self.dropped_stale += 1
                        continue
                    groups.setdefault(s.task_id, []).append(s)
                self.buffer.extend(g for g in groups.values() if g)
                added += len(groups)
        return added

    def train_step(self) -> bool:
        """One optimizer step if enough fresh groups are buffered; publishes every ``sync_every`` steps."""
        assert self.version is not None
        fresh = [g for g in self.buffer if g[0].version >= self.version - self.config.max_staleness]
        self.dropped_stale += sum(len(g) for g in self.buffer) - sum(len(g) for g in fresh)
        self.buffer = fresh[-self.config.max_buffered_groups :]
        if len(self.buffer) < self.config.groups_per_step:
            return False
        groups, self.buffer = self.buffer[: self.config.groups_per_step], self.buffer[self.config.groups_per_step :]
        t0 = time.perf_counter()
        loss, stats = grpo_loss(
            self.model, groups, temperature=self.config.temperature, clip_eps=self.config.clip_eps,
            pad_id=self.pad_id, device=self.config.device,
        )  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.opt_steps += 1
        self.metrics.add(
            kind="train", opt_step=self.opt_steps, version=self.version, loss=stats.loss, mean_reward=stats.mean_reward,
            samples=stats.samples, groups=stats.groups, clipped=stats.clipped_fraction, ratio=stats.mean_ratio,
            dropped_stale=self.dropped_stale, step_s=time.perf_counter() - t0,
            sample_versions=sorted({s.version for g in groups for s in g}),
        )  # fmt: skip
        if self.opt_steps % self.config.sync_every == 0:
            self.version += 1
            self._publish()
        return True

    def step(self) -> bool:
        """One iteration: collect, train if possible, flush figures; returns whether it trained."""
        self.setup()
        self.collect()
        trained = self.train_step()
        if trained:
            self._last_heartbeat = time.time()
        elif time.time() - self._last_heartbeat > 60:  # keep the run lock fresh while waiting for data
            self.publisher.heartbeat()
            self._last_heartbeat = time.time()
        self.metrics.extra = {
            "version": self.version, "opt_steps": self.opt_steps, "buffered_groups": len(self.buffer),
            "refused": self.refusals.as_dict(), "non_finite_refused": self.non_finite_refused,
        }  # fmt: skip
        self.metrics.flush()
        return trained

    # -- lifecycle ----------------------------------------------------------

    @property
    def finished(self) -> bool:
        return bool(self.config.max_steps) and self.opt_steps >= self.config.max_steps

    def run(self) -> None:
        """Run until :meth:`stop` or ``max_steps``; bucket errors are logged and retried."""
        while not self._stop.is_set() and not self.finished:
            try:
                trained = self.step()
            except BucketError as exc:
                logger.warning("bucket error, retrying: %s", exc)
                trained = False
            if not trained:
                self._stop.wait(self.config.poll_s)

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=60)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
