"""The trainer role: TRL's ``AsyncGRPOTrainer`` learning from the bucket and publishing to it.

The training loop, the GRPO loss (PPO-clip against the sampler's
log-probabilities) and the optimizer are TRL's; this module only wires the
sync library's TRL plug-ins (:mod:`rlsync.trl`) into it:

- :class:`~rlsync.trl.BucketRolloutWorker` feeds the trainer the scored samples
  under ``scores/`` (group-normalised advantages, the sampler's log-probabilities,
  each sample's policy version; TRL drops those more than ``max_staleness`` old);
- :class:`~rlsync.trl.BucketWeightTransfer` publishes every ``sync_every``
  optimizer steps through the :class:`~rlsync.protocol.Publisher` (an anchor or a
  sparse bf16 delta, as the anchor policy decides; the policy follows the bucket's
  control object, so any panel can change it while the run goes on); the final
  weights are published at ``max_steps`` or on stop;
- with ``lora_rank`` set, TRL trains a LoRA adapter (``peft_config``) and
  :class:`~rlsync.trl.BucketAdapterSync` publishes the base once to the weights chain and
  then adapter versions to the adapter chain under ``adapters/`` (see ``docs/lora.md``);
- :class:`~rlsync.trl.BucketCheckpoints` keeps Trainer-format checkpoints (fp32
  weights, optimizer, scheduler, RNG, step) under ``checkpoints/`` every
  ``checkpoint_every`` steps and on stop; a restarted trainer resumes from the
  newest complete one and continues the bucket's version numbers; without a checkpoint it
  refuses to publish over the bucket's run unless ``new_run`` starts a new one.
- :class:`~rlsync.trl.NonFiniteStepGuard` skips a step with non-finite gradients before
  the optimizer, and :class:`~rlsync.trl.VersionGuard` keeps TRL's policy version at the
  bucket's when a publish is refused;
- :class:`~trainer_space.flow.FlowControl` writes ``control/demand.json`` once per step
  (pacing ``demand``: the env issues tasks at the rate the trainer consumes) and counts
  trained samples and the trainer's waiting time.

TRL's logs feed ``metrics/trainer.json`` (kind ``train`` rows next to the
``anchor``/``delta`` rows of each publish), which every panel plots.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import shutil
import tempfile
import threading
from typing import Any

import torch
from transformers import TrainerCallback

from env_space.environments import get_environment
from rlsync.adapters import LoraSpec
from rlsync.lora import peft_config
from rlsync.bucket import Bucket, open_bucket
from rlsync.bucket.watch import meter_of
from rlsync.codecs import default_codec
from rlsync.protocol import CONTROL_KEY, Adaptive, FixedInterval, NonFiniteError, Publisher, PublishRecord, policy_to_json, read_manifest
from rlsync.spaces.exchange import MetricsLog, Refusals, SampleLimits, read_samples, watch_role_bucket
from rlsync.spaces.settings import default_model, from_env, resolve_device
from rlsync.spaces.tiny_model import model_or_default
from rlsync.trl import (
    BucketAdapterSync,
    BucketCheckpoints,
    BucketRolloutWorker,
    BucketWeightTransfer,
    CheckpointCallback,
    FinalWeightSync,
    NonFiniteStepGuard,
    StopRequested,
    VersionGuard,
    apply_cpu_compat,
)
from rlsync.spaces.demand import Pacing
from rlsync.trl.checkpoint_checks import CheckpointExpectations
from rlsync.trl.coalesce import PublishCoalescing
from rlsync.trl.metrics import trl_layout_bytes
from rlsync.trl.trackio_sync import TrackioSyncFigures

from .flow import FlowControl

logger = logging.getLogger(__name__)

#: ``max_steps`` given to TRL when the run has no limit (TRL needs one; the schedule is constant).
UNLIMITED_STEPS = 10**9
TINY_MODEL_LR, TINY_MODEL_ADAM_EPSILON = 5e-4, 3e-3  # the CPU demo: median delta ~8% changed, reward +0.29 in 5 min
# LoRA runs (docs/lora.md): plain AdamW (its step is ~lr on every adapter element), a larger lr than full fine-tuning
TINY_MODEL_LORA_LR, REAL_MODEL_LORA_LR, LORA_ADAM_EPSILON = 1e-3, 1e-5, 1e-8
REAL_MODEL_LR, REAL_MODEL_ADAM_EPSILON = 1e-6, 1e-8  # RL fine-tuning of a pretrained model


class ReportTo(str, enum.Enum):
    """Where TRL's logs and the sync figures go (``TRAINER_REPORT_TO``)."""

    AUTO = "auto"
    TRACKIO = "trackio"
    NONE = "none"


@dataclasses.dataclass
class TrainerConfig:
    """Settings of the trainer Space (environment variables ``TRAINER_<FIELD>``); they map onto TRL's ``AsyncGRPOConfig``."""

    bucket: str = dataclasses.field(default="./runs/bucket", metadata={"help": "bucket URL or path (write access)"})
    model: str = dataclasses.field(default="", metadata={"help": "model name or folder (default: Qwen/Qwen3-0.6B on a GPU, the tiny offline model on CPU)"})
    device: str = dataclasses.field(default="auto", metadata={"help": "torch device ('auto': cuda if available, else cpu)"})
    lr: float = dataclasses.field(default=0.0, metadata={"help": "learning rate (learning_rate); 0: 5e-4 for the tiny offline CPU model, 1e-6 for a real model (LoRA: 1e-3 and 1e-5)"})
    optim: str = dataclasses.field(default="adamw_torch", metadata={"help": "optimizer: a transformers optim name, e.g. 'adamw_torch' or 'sgd' (optim)"})
    adam_epsilon: float = dataclasses.field(default=0.0, metadata={"help": "AdamW epsilon (adam_epsilon); 0: 3e-3 for the tiny offline CPU model (steps follow the gradient's size, so weights with small gradients barely move and deltas stay sparse), 1e-8 for a real model and for LoRA"})
    weight_decay: float = dataclasses.field(default=0.0, metadata={"help": "weight decay (weight_decay)"})
    batch_size: int = dataclasses.field(default=16, metadata={"help": "samples per optimizer step (per_device_train_batch_size)"})
    sync_every: int = dataclasses.field(default=1, metadata={"help": "optimizer steps per publish (weight_sync_steps)"})
    max_staleness: int = dataclasses.field(default=2, metadata={"help": "drop samples this many versions behind (max_staleness)"})
    pacing: str = dataclasses.field(default="demand", metadata={"help": "'demand': write control/demand.json so the env issues tasks at the rate this trainer consumes; 'queue': the env keeps its queue_depth batches waiting"})
    clip_eps: float = dataclasses.field(default=0.2, metadata={"help": "importance-ratio clip (epsilon)"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature of the replicas (temperature)"})
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"help": "gradient clipping (max_grad_norm)"})
    anchor_policy: str = dataclasses.field(default="fixed", metadata={"help": "'fixed' or 'adaptive'"})
    anchor_interval: int = dataclasses.field(default=10, metadata={"help": "publishes per anchor (fixed policy)"})
    max_catchup_ratio: float = dataclasses.field(default=2.0, metadata={"help": "adaptive policy bound, in anchors"})
    keep_anchors: int = dataclasses.field(default=2, metadata={"help": "anchors retained in the bucket"})
    codec: str = dataclasses.field(default="classrice", metadata={"help": "delta codec: 'classrice', 'classgap', 'gapzz', 'trl' or 'auto' (the default for the device)"})
    max_steps: int = dataclasses.field(default=0, metadata={"help": "stop after this many optimizer steps (0: never) (max_steps)"})
    checkpoint_every: int = dataclasses.field(default=50, metadata={"help": "optimizer steps per bucket checkpoint, also saved on stop (save_steps)"})
    keep_checkpoints: int = dataclasses.field(default=2, metadata={"help": "checkpoints retained in the bucket"})
    poll_s: float = dataclasses.field(default=0.5, metadata={"help": "seconds between bucket polls (a Hub bucket is watched instead)"})
    metrics_every_s: float = dataclasses.field(default=30.0, metadata={"help": "seconds between metrics writes on a Hub bucket"})
    seed: int = dataclasses.field(default=0, metadata={"help": "torch seed (seed)"})
    trainer_id: str = dataclasses.field(default="", metadata={"help": "run-lock owner id; a restart with the same id takes over (default: SPACE_ID or host name)"})
    new_run: bool = dataclasses.field(default=False, metadata={"help": "when the bucket holds a run but no checkpoint to continue from: start a new run (new run id; replicas re-bootstrap from its first anchor) instead of refusing; a checkpoint, when there is one, is always resumed from"})
    lora_rank: int = dataclasses.field(default=0, metadata={"help": "train a LoRA adapter of this rank and publish adapter versions under adapters/ (0: train all weights)"})
    lora_alpha: float = dataclasses.field(default=16.0, metadata={"help": "LoRA alpha (the update is scaled by alpha / rank)"})
    lora_target_modules: str = dataclasses.field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", metadata={"help": "comma-separated module names the adapter wraps"})
    report_to: str = dataclasses.field(default=ReportTo.AUTO.value, metadata={"help": "'trackio', 'none' or 'auto' (trackio on a Space, i.e. SPACE_ID set; none elsewhere); TRL's logs and the sync figures go there (report_to)"})
    trackio_project: str = dataclasses.field(default="rlsync", metadata={"help": "Trackio project (project)"})
    trackio_space_id: str = dataclasses.field(default="", metadata={"help": "Trackio Space to log to, e.g. 'user/trackio' (empty: local Trackio database only) (trackio_space_id)"})
    trackio_bucket_id: str = dataclasses.field(default="", metadata={"help": "Hugging Face Bucket keeping the Trackio database (empty: Trackio's default) (trackio_bucket_id)"})

    @classmethod
    def from_env(cls, **overrides) -> "TrainerConfig":
        return from_env(cls, "TRAINER", **overrides)

    def with_model_defaults(self, device: str) -> "TrainerConfig":
        """``lr`` and ``adam_epsilon`` left at 0 take the defaults of the model that will train: the CPU
        demo's for the tiny offline model, conservative ones for a real model (e.g. Qwen3-0.6B on a GPU);
        a LoRA run (``lora_rank``) has its own."""
        tiny = not (self.model or default_model(device))
        lr, eps = (TINY_MODEL_LR, TINY_MODEL_ADAM_EPSILON) if tiny else (REAL_MODEL_LR, REAL_MODEL_ADAM_EPSILON)
        if self.lora_rank:
            lr, eps = (TINY_MODEL_LORA_LR if tiny else REAL_MODEL_LORA_LR), LORA_ADAM_EPSILON
        return dataclasses.replace(self, lr=self.lr or lr, adam_epsilon=self.adam_epsilon or eps)

    def lora(self) -> LoraSpec | None:
        """The LoRA settings, or ``None`` when all weights train."""
        if not self.lora_rank:
            return None
        modules = tuple(m.strip() for m in self.lora_target_modules.split(",") if m.strip())
        return LoraSpec(self.lora_rank, self.lora_alpha, modules)

    def report_targets(self) -> list[str]:
        """The ``report_to`` list given to TRL."""
        target = ReportTo(self.report_to)
        if target is ReportTo.AUTO:
            target = ReportTo.TRACKIO if os.environ.get("SPACE_ID") else ReportTo.NONE
        return [] if target is ReportTo.NONE else [target.value]

    def policy(self):
        if self.anchor_policy == "adaptive":
            return Adaptive(self.max_catchup_ratio)
        return FixedInterval(self.anchor_interval)

    def grpo_config(self, output_dir: str) -> Any:
        """These settings as TRL's ``AsyncGRPOConfig``."""
        from trl.experimental.async_grpo import AsyncGRPOConfig

        on_gpu = self.device.startswith("cuda")
        return AsyncGRPOConfig(
            output_dir=output_dir, learning_rate=self.lr, optim=self.optim, adam_epsilon=self.adam_epsilon,
            weight_decay=self.weight_decay,
            per_device_train_batch_size=self.batch_size, token_budget=0, gradient_accumulation_steps=1,
            weight_sync_steps=self.sync_every, max_staleness=self.max_staleness, epsilon=self.clip_eps,
            temperature=self.temperature, max_grad_norm=self.max_grad_norm,
            max_steps=self.max_steps or UNLIMITED_STEPS, bf16=on_gpu, use_cpu=not on_gpu, seed=self.seed,
            save_strategy="steps", save_steps=max(1, self.checkpoint_every or UNLIMITED_STEPS), save_total_limit=None,
            logging_steps=1, report_to=self.report_targets(), disable_tqdm=True, dataloader_num_workers=0,
            project=self.trackio_project, trackio_space_id=self.trackio_space_id or None,
            trackio_bucket_id=self.trackio_bucket_id or None, trackio_static_space_id=False,
        )  # fmt: skip


class BucketFigures(TrainerCallback):
    """Mirrors TRL's logs to ``metrics/trainer.json`` and ends training when a stop is requested."""

    def __init__(self, owner: "Trainer") -> None:
        self.owner = owner

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        self.owner.metrics.add(
            kind="train", opt_step=state.global_step, version=self.owner.transfer.version, loss=logs.get("loss"),
            mean_reward=logs.get("reward"), samples=logs.get("batch/samples_per_step"),
            groups=logs.get("batch/groups_per_step"), clipped=logs.get("clip_ratio/region_mean"), ratio=logs.get("ratio"),
            kl=logs.get("kl"), entropy=logs.get("entropy"), staleness=logs.get("sample/staleness_mean"),
            dropped_stale=self.owner.worker.counts["dropped_stale"], step_s=logs.get("perf/step_s"),
            wait_s=logs.get("perf/rollout_wait_s"),
        )  # fmt: skip
        self.owner.flush()

    def on_step_end(self, args, state, control, **kwargs):
        self.owner.opt_steps = state.global_step
        if self.owner.stop_requested:
            control.should_training_stop = True
            control.should_save = True
        return control


class Trainer:
    """The trainer Space's role: ``AsyncGRPOTrainer`` with the bucket plug-ins, in a thread.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: TrainerConfig, bucket: Bucket | None = None) -> None:
        from transformers import AutoTokenizer
        from trl.experimental.async_grpo import AsyncGRPOTrainer

        self.bucket = watch_role_bucket(bucket or open_bucket(config.bucket))
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        device = resolve_device(config.device)
        config = dataclasses.replace(config, device=device, codec=default_codec(device) if config.codec == "auto" else config.codec)
        config = config.with_model_defaults(device)
        self.config = config
        self.metrics = MetricsLog(self.bucket, "trainer", every_s=config.metrics_every_s if self.meter is not None else 0.0)
        self.trackio = TrackioSyncFigures() if ReportTo.TRACKIO.value in config.report_targets() else None
        chain_settings = dict(
            policy=config.policy(), keep_anchors=config.keep_anchors, codec=config.codec, owner=config.trainer_id or None,
            new_run=config.new_run,
        )  # fmt: skip
        lora = config.lora()
        self.adapter_sync = BucketAdapterSync(self.bucket, **chain_settings) if lora else None
        if self.adapter_sync is not None:
            self.transfer = self.adapter_sync.transfer
            self.transfer.on_publish, self.transfer.on_non_finite = self._record_publish, self._restore_published
        else:
            self.transfer = BucketWeightTransfer(
                publisher=Publisher(self.bucket, **chain_settings), on_publish=self._record_publish,
                on_non_finite=self._restore_published,
            )  # fmt: skip
        self.publisher = self.transfer.publisher
        self.checkpoints = BucketCheckpoints(self.bucket, keep=config.keep_checkpoints, chain=self.publisher)
        self.scratch = tempfile.mkdtemp(prefix="rlsync-trainer-")
        self.opt_steps = 0
        self.notice = ""
        self.stop_requested = False
        self.refusals = Refusals()
        self._thread: threading.Thread | None = None
        model = model_or_default(config.model, config.device, get_environment)
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.vocab_size = len(tokenizer)
        self.worker = BucketRolloutWorker(
            self.bucket, self._read_scores, vocab_size=len(tokenizer), poll_s=config.poll_s,
            queue_maxsize=max(4 * config.batch_size, 256), max_staleness=config.max_staleness,
            heartbeat=self.transfer.heartbeat, max_tokens=0, chain=self.publisher.bucket,  # _read_scores bounds tokens by the model's context
        )  # fmt: skip
        sdpa = apply_cpu_compat()
        from datasets import Dataset

        self.trl = AsyncGRPOTrainer(
            model=model, args=config.grpo_config(self.scratch), processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["(prompts come from the bucket's tasks/)"]}),
            rollout_worker=self.worker, weight_transfer=self.transfer, peft_config=peft_config(lora) if lora else None,
        )  # fmt: skip
        if self.adapter_sync is not None:
            self.adapter_sync.attach(self.trl)
        self.checkpoint_callback = CheckpointCallback(
            self.checkpoints, info=lambda: {"published_version": self.transfer.version}
        )
        self.final_sync = FinalWeightSync(self.trl)
        self.step_guard = NonFiniteStepGuard()
        self.version_guard = VersionGuard(self.trl, self.transfer, self.worker)
        self.flow = FlowControl(
            self.bucket, self.worker, self.transfer, batch_size=config.batch_size,
            max_staleness=config.max_staleness, pacing=Pacing(config.pacing),
        )  # fmt: skip
        self.coalescing = PublishCoalescing(self.trl, self.meter) if self.meter is not None else None
        callbacks = (self.step_guard, self.version_guard, self.flow, self.checkpoint_callback, self.final_sync, BucketFigures(self), self.coalescing)
        for callback in callbacks:
            if callback is not None:
                self.trl.add_callback(callback)
        if self.trackio is not None:
            self.trackio.install(self.trl)
        logger.info(
            "training %s%s through TRL AsyncGRPOTrainer on %s (%s attention), lr %g, %d samples per step, publish every %d step(s)",
            model, f" (LoRA rank {lora.rank} on {','.join(lora.target_modules)})" if lora else "", config.device,
            "SDPA tree" if sdpa else "flash-attention-3 tree", config.lr, config.batch_size, config.sync_every,
        )  # fmt: skip

    @property
    def version(self) -> int | None:
        """The newest published version."""
        return self.transfer.version

    # -- bucket objects -------------------------------------------------------

    def _read_scores(self, bucket: Bucket, key: str):
        """Read one scores object within the trainer's limits, counting refusals. In a new run, samples
        scored for the replaced run's versions are dropped (counted): another run's policy sampled them."""
        limits = SampleLimits(
            vocab_size=self.vocab_size, max_version=self.transfer.version,
            max_total_tokens=getattr(self.trl.model.config, "max_position_embeddings", None),
        )  # fmt: skip
        read = read_samples(bucket, key, limits=limits, refusals=self.refusals)
        replaced = self.publisher.replaced_step
        if read is None or replaced is None:
            return read
        header, samples = read
        kept = [s for s in samples if s.version > replaced]
        if len(kept) < len(samples):
            self.refusals.add(key, f"{len(samples) - len(kept)} sample(s) of the replaced run (version <= {replaced})")
        return (header, kept) if kept else None

    def _restore_published(self, exc: NonFiniteError) -> None:
        """Never train on from a poisoned model: back to the published weights, optimizer state reset."""
        logger.error("%s; restoring the published weights and resetting the optimizer", exc)
        self._load_published(self.publisher.detector.published or {})
        if self.trl.optimizer is not None:
            self.trl.optimizer.state.clear()

    def _load_published(self, published: dict[str, torch.Tensor]) -> None:
        """Load published tensors (weights, or the adapter in a LoRA run) into the trained model."""
        if self.adapter_sync is not None:
            self.adapter_sync.restore(published)
            return
        params = dict(self.trl.model.named_parameters())
        with torch.no_grad():
            for name, tensor in published.items():
                if name in params:
                    params[name].copy_(tensor.to(params[name].dtype))

    # -- figures ------------------------------------------------------------

    def _record_publish(self, rec: PublishRecord) -> None:
        self.metrics.add(
            kind=rec.kind, version=rec.step, nbytes=rec.nbytes, changed=rec.changed, total=rec.total,
            changed_pct=100 * rec.changed_fraction,
            trl_nbytes=trl_layout_bytes(rec.changed, len(self.publisher.detector.published or ())),
            encode_s=rec.encode_s, hash_s=rec.hash_s, upload_s=rec.upload_s, catchup_bytes=rec.catchup_bytes,
        )  # fmt: skip
        if self.trackio is not None:
            self.trackio.record(rec)
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write ``metrics/trainer.json`` (rows and the trainer's current state)."""
        budget = {"hub": self.meter.snapshot(), "coalescing": self.coalescing.notice} if self.meter is not None else {}
        self.metrics.extra = {
            **budget,
            "version": self.transfer.version, "opt_steps": self.opt_steps, "queued_samples": self.worker.rollout_buffer.qsize(),
            "checkpoint_step": self.checkpoint_callback.last_step, "notice": self.notice,
            "refused": self.refusals.as_dict(), "non_finite_refused": self.transfer.non_finite_refused,
            "checkpoints_skipped": self.checkpoints.skipped, "bucket_refused": dict(self.publisher.refused),
            "non_finite_steps_skipped": self.step_guard.skipped, "version_corrections": self.version_guard.corrected,
            "flow": self.flow.figures(),
        }  # fmt: skip
        self.metrics.flush(force)

    def set_anchor_policy(self, policy: str, interval: int = 10, max_catchup_ratio: float = 2.0) -> None:
        """Change the anchor policy for the next publish, through the bucket's control object
        (so it also reaches a trainer running in another Space)."""
        new = Adaptive(max_catchup_ratio) if policy == "adaptive" else FixedInterval(int(interval))
        self.publisher.bucket.put(CONTROL_KEY, policy_to_json(new))  # the adapter chain's own in a LoRA run

    # -- resuming -------------------------------------------------------------

    def prepare(self) -> str | None:
        """Take the run lock and find where to continue.

        A bucket that holds a run is continued from its newest checkpoint that verifies. Without
        one, the trainer refuses (:class:`~rlsync.protocol.RunExistsError`, naming both ways on)
        unless ``new_run`` is set, which starts a new run: a new run id, its first version an
        anchor, which replicas notice and re-bootstrap from.

        Returns:
            The local checkpoint folder to resume from, or ``None`` (an empty bucket or a new run).

        Raises:
            RunExistsError: the bucket holds a run, no checkpoint verifies and ``new_run`` is off.
        """
        manifest = read_manifest(self.publisher.bucket)  # checkpoints are checked against the chain it names
        expect = CheckpointExpectations.for_model(
            self.trl.model, pins={p.step: p.weights_hash for p in manifest.checkpoints} if manifest else {},
            published_step=manifest.step if manifest else 0, lr=self.config.lr,
        )  # fmt: skip
        restored = self.checkpoints.restore(self.scratch, expect)
        self.transfer.resume_from_checkpoint = restored[1] if restored else None
        self.transfer.continue_run()
        if restored is None:
            return None
        step, folder, marker = restored
        saved = marker.get("published_version")
        self.opt_steps = step
        if isinstance(saved, int) and self.transfer.version is not None and self.transfer.version > saved:
            self.notice = (
                f"published version {self.transfer.version} is newer than checkpoint {step} (saved at version {saved}): "
                f"resumed from the checkpoint; the next version is a delta from {self.transfer.version}"
            )
            logger.warning(self.notice)
        logger.info("resuming from checkpoint %d", step)
        return str(folder)

    # -- lifecycle ------------------------------------------------------------

    def run(self, folder: str | None = None, prepared: bool = False) -> None:
        """Train until :meth:`stop` or ``max_steps``; publishes and checkpoints the last step.

        Args:
            folder: The checkpoint folder :meth:`prepare` returned, when ``prepared``.
            prepared: :meth:`prepare` was called already (by :meth:`start`).
        """
        if not prepared:
            folder = self.prepare()
        try:
            self.trl.train(resume_from_checkpoint=folder)
        except StopRequested:  # stopped while waiting for rollouts: save what the callbacks could not
            step = self.trl.state.global_step
            if step and self.checkpoint_callback.last_step != step:
                self.trl._save_checkpoint(self.trl.model, trial=None)
                self.checkpoint_callback.upload(self.scratch, step)
            self.final_sync.sync(step)
        finally:
            self._publish_coalesced()
            self.flush(force=True)
        logger.info("trainer finished at step %d, version %s", self.trl.state.global_step, self.transfer.version)

    def _publish_coalesced(self) -> None:
        """While publishes were coalesced the last steps may not be published: publish the final weights."""
        if self.coalescing is None or self.coalescing.factor == 1 or not self.trl.state.global_step:
            return
        self.final_sync.synced_step = None
        self.final_sync.sync(self.trl.state.global_step)

    def start(self) -> None:
        if self.running:
            return
        self.stop_requested = False
        folder = self.prepare()  # here, so that a refusal reaches the caller (the panel shows it)
        self._thread = threading.Thread(target=self.run, args=(folder, True), name="trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step (or while waiting for rollouts), saving a checkpoint and publishing."""
        self.stop_requested = True
        self.worker.request_stop()
        if self._thread:
            self._thread.join(timeout=300)

    def close(self) -> None:
        """Stop, delete the local scratch folder and stop watching the bucket."""
        self.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._owns_watch:
            self.bucket.close()

    @property
    def finished(self) -> bool:
        """Whether ``max_steps`` optimizer steps were trained."""
        return bool(self.config.max_steps) and self.trl.state.global_step >= self.config.max_steps

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
