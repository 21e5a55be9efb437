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
import logging
import shutil
import tempfile
import threading

import torch
from transformers import TrainerCallback

from env_space.environments import get_environment
from rlsync.bucket import Bucket
from rlsync.bucket.watch import meter_of
from rlsync.codecs import default_codec
from rlsync.defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_MAX_CATCHUP_RATIO
from rlsync.errors import NonFiniteError, StopRequested
from rlsync.lora import peft_config
from rlsync.protocol import Adaptive, FixedInterval, Publisher, PublishRecord, read_manifest
from rlsync.spaces.anchor_policy import ControlledPolicy, write_policy
from rlsync.spaces.demand import Pacing
from rlsync.spaces.exchange import MetricsLog, Refusals, SampleLimits, open_role_bucket, read_samples
from rlsync.spaces.settings import resolve_device, space_owner
from rlsync.spaces.tiny_model import model_or_default
from rlsync.trl import (
    BucketAdapterSync,
    BucketCheckpoints,
    BucketRolloutWorker,
    BucketWeightTransfer,
    CheckpointCallback,
    FinalWeightSync,
    NonFiniteStepGuard,
    VersionGuard,
    apply_cpu_compat,
)
from rlsync.trl.checkpoint_checks import CheckpointExpectations
from rlsync.trl.coalesce import PublishCoalescing
from rlsync.trl.metrics import trl_layout_bytes
from rlsync.trl.trackio_sync import TrackioSyncFigures

from .config import ReportTo, TrainerConfig
from .flow import FlowControl

logger = logging.getLogger(__name__)


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

        self.bucket = open_role_bucket("trainer", config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        device = resolve_device(config.device)
        config = dataclasses.replace(config, device=device, codec=default_codec(device) if config.codec == "auto" else config.codec)
        config = config.with_model_defaults(device)
        self.config = config
        self.metrics = MetricsLog(self.bucket, "trainer", every_s=config.metrics_every_s if self.meter is not None else 0.0)
        self.trackio = TrackioSyncFigures() if ReportTo.TRACKIO.value in config.report_targets() else None
        self.control = ControlledPolicy(self.bucket, config.policy())  # the panels' anchor policy
        chain_settings = dict(
            policy=self.control, keep_anchors=config.keep_anchors, codec=config.codec, owner=config.trainer_id or space_owner(),
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
            "checkpoints_skipped": self.checkpoints.skipped, "bucket_refused": dict(self.publisher.refused + self.control.refused),
            "non_finite_steps_skipped": self.step_guard.skipped, "version_corrections": self.version_guard.corrected,
            "flow": self.flow.figures(), "publish": self._publish_figures(),
        }  # fmt: skip
        self.metrics.flush(force)

    def _publish_figures(self) -> dict:
        """The background publisher's figures: the last send's stall (the cast into the staging
        buffer), versions coalesced while it was behind, publishes that failed."""
        background = self.transfer.background
        if background is None:
            return {}
        return {"stall_s": background.stall_s, "coalesced": background.coalesced, "errors": background.errors}

    def set_anchor_policy(
        self, policy: str, interval: int = DEFAULT_ANCHOR_INTERVAL, max_catchup_ratio: float = DEFAULT_MAX_CATCHUP_RATIO
    ) -> None:
        """Change the anchor policy for the next publish, through the bucket's control object
        (so it also reaches a trainer running in another Space)."""
        write_policy(self.bucket, Adaptive(max_catchup_ratio) if policy == "adaptive" else FixedInterval(int(interval)))

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
            self.flush(force=True)
        logger.info("trainer finished at step %d, version %s", self.trl.state.global_step, self.transfer.version)

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
