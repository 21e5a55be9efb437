"""The trainer role: TRL's ``AsyncGRPOTrainer`` learning from the bucket and publishing to it.

The training loop, the GRPO loss (PPO-clip against the sampler's
log-probabilities) and the optimizer are TRL's; the bucket is joined to it by
:class:`~rlsync.trl.BucketSync`, the same object a TRL user's script uses
(``examples/trl_bucket_sync.py``): the rollout worker reading ``scores/``, the
weight transfer publishing every ``sync_every`` optimizer steps (an anchor or a
sparse bf16 delta), the guards, the final sync, checkpoints under ``checkpoints/``
with resume and new-run handling, and with ``lora_rank`` set the adapter chain
(``docs/lora.md``). This role adds what belongs to the Space:

- the anchor policy follows the bucket's control object
  (:class:`~rlsync.spaces.anchor_policy.ControlledPolicy`), so any panel can change it
  while the run goes on; the trainer always resumes from the newest checkpoint that
  verifies (saved after the first step, every ``checkpoint_every`` steps and on every stop, SIGTERM
  included), and refuses to publish over the bucket's run without one unless ``new_run`` or its
  weights are still the run's newest version;
- :class:`~trainer_space.flow.FlowControl` writes ``control/demand.json`` once per step
  (pacing ``demand``: the env issues tasks at the rate the trainer consumes) and counts
  trained samples and the trainer's waiting time.

TRL's logs feed ``metrics/trainer.json`` (kind ``train`` rows next to the
``anchor``/``delta`` rows of each publish), which every panel plots.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import tempfile
from typing import Any

from transformers import TrainerCallback

from env_space.environments import get_environment
from rlsync.bucket import Bucket
from rlsync.bucket.watch import meter_of
from rlsync.checkpoint_layout import CheckpointLayout, expert_changed_pct
from rlsync.codecs import default_codec
from rlsync.protocol import PublishRecord
from rlsync.protocol.run import new_run_id
from rlsync.roles import Role
from rlsync.spaces.anchor_policy import ControlledPolicy
from rlsync.spaces.role_control import OneThreadRole
from rlsync.spaces.demand import Pacing
from rlsync.spaces.exchange import open_role_bucket
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.metrics import (
    BackgroundPublishFigures,
    HubCounts,
    MetricsLog,
    PublishRow,
    RefusalCounts,
    TrainerMetrics,
    TrainRow,
)
from rlsync.spaces.settings import resolve_device, space_owner
from rlsync.spaces.tiny_model import model_or_default
from rlsync.supervised import SupervisedThread
from rlsync.trl import BucketSync
from rlsync.trl.logs import AsyncGRPOTrainer, quiet_trl
from rlsync.trl.metrics import trl_layout_bytes

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
        self.owner.metrics.add(TrainRow.from_logs(
            logs, opt_step=state.global_step, version=self.owner.version,
            dropped_stale=self.owner.worker.counts["dropped_stale"],
        ))  # fmt: skip
        self.owner.summary.add(steps=1, samples=logs.get("batch/samples_per_step") or 0, wait_s=logs.get("perf/rollout_wait_s") or 0)
        self.owner.summary.note(version=self.owner.version, loss=logs.get("loss"), reward=logs.get("reward"))
        self.owner.flush()
        self.owner.summary.flush()

    def on_step_end(self, args, state, control, **kwargs):
        self.owner.opt_steps = state.global_step
        if self.owner.stop_requested:
            control.should_training_stop = True
            control.should_save = True
        return control


class FirstStepCheckpoint(TrainerCallback):
    """Saves a checkpoint after a run's first optimizer step, before TRL's every ``checkpoint_every``: a Space that
    restarts soon after Start (hardware change, update, sleep) resumes from it instead of losing the run."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            control.should_save = True
        return control


class Trainer(OneThreadRole):
    """The trainer Space's role: ``AsyncGRPOTrainer`` joined to the bucket by :class:`~rlsync.trl.BucketSync`, in a thread.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: TrainerConfig, bucket: Bucket | None = None) -> None:
        from datasets import Dataset
        from transformers import AutoTokenizer

        self.bucket = open_role_bucket(Role.TRAINER, config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        device = resolve_device(config.device)
        config = dataclasses.replace(config, device=device, codec=default_codec(device) if config.codec == "auto" else config.codec)
        config = config.with_model_defaults(device)
        self.config = config
        self.metrics = MetricsLog(self.bucket, TrainerMetrics, every_s=config.metrics_every_s if self.meter is not None else 0.0)
        self.control = ControlledPolicy(self.bucket, config.policy())  # the panels' anchor policy
        lora = config.lora()
        model = model_or_default(config.model, config.device, get_environment)
        layout = CheckpointLayout.from_pretrained(model) if not lora else None  # a MoE's fused experts, per expert
        self.sync = BucketSync(
            self.bucket, policy=self.control, keep_anchors=config.keep_anchors, codec=config.codec,
            owner=config.trainer_id or space_owner(), resume=True, new_run=config.new_run, lora=lora,
            keep_checkpoints=config.keep_checkpoints, poll_s=config.poll_s, queue_maxsize=max(4 * config.batch_size, 256),
            max_staleness=config.max_staleness, on_publish=self._record_publish,
            trackio=ReportTo.TRACKIO.value in config.report_targets(), layout=layout, fp8=config.fp8,
            worker_summary_s=None,  # the trainer's own summary line reports the worker's counts
        )  # fmt: skip
        self.scratch = tempfile.mkdtemp(prefix="rlsync-trainer-")
        self.opt_steps = 0
        self.stop_requested = False
        self._thread: SupervisedThread | None = None
        self.trl = AsyncGRPOTrainer(
            model=model, args=config.grpo_config(self.scratch), processing_class=AutoTokenizer.from_pretrained(model),
            train_dataset=Dataset.from_dict({"prompt": ["(prompts come from the bucket's tasks/)"]}),
            **self.sync.trainer_kwargs(),
        )  # fmt: skip
        quiet_trl(self.trl)
        self.sync.attach(self.trl, prepare=False)  # start() prepares, so that a refusal reaches the panel
        # the parts, for the figures and the tests
        self.transfer, self.worker, self.publisher = self.sync.transfer, self.sync.worker, self.sync.publisher
        self.checkpoints, self.refusals, self.adapter_sync = self.sync.checkpoints, self.sync.refusals, self.sync.adapter_sync
        callbacks = self.sync.callbacks
        self.step_guard, self.version_guard = callbacks.step_guard, callbacks.version_guard
        self.checkpoint_callback, self.final_sync, self.coalescing = (
            callbacks.checkpoint_callback, callbacks.final_sync, callbacks.coalescing
        )
        self.flow = FlowControl(
            self.bucket, self.worker, self.transfer, batch_size=config.batch_size,
            max_staleness=config.max_staleness, pacing=Pacing(config.pacing),
        )  # fmt: skip
        self.trl.add_callback(self.flow)
        self.trl.add_callback(BucketFigures(self))
        self.trl.add_callback(FirstStepCheckpoint())
        self.summary = IntervalLog(logger, self._summary_line)
        self._flow_at_summary = dict(self.worker.counts)
        logger.info(
            "training %s%s through TRL AsyncGRPOTrainer on %s (%s attention), lr %g, %d samples per step, publish every %d step(s)",
            model, f" (LoRA rank {lora.rank} on {','.join(lora.target_modules)})" if lora else "", config.device,
            "SDPA tree" if self.sync.uses_sdpa else "flash-attention-3 tree", config.lr, config.batch_size, config.sync_every,
        )  # fmt: skip

    @property
    def version(self) -> int | None:
        """The newest published version: the bucket's, what replicas can hold (TRL's counter,
        ``transfer.version``, is ahead of it while a version is published in the background)."""
        return self.transfer.published_version

    @property
    def notice(self) -> str:
        """What the last resume found worth telling ('' when nothing)."""
        return self.sync.notice

    # -- figures ------------------------------------------------------------

    def _record_publish(self, rec: PublishRecord) -> None:
        self.metrics.add(PublishRow(
            kind=rec.kind, version=rec.step, nbytes=rec.nbytes, changed=rec.changed, total=rec.total,
            changed_pct=100 * rec.changed_fraction,
            trl_nbytes=trl_layout_bytes(rec.changed, len(self.publisher.detector.published or ())),
            encode_s=rec.encode_s, hash_s=rec.hash_s, upload_s=rec.upload_s, catchup_bytes=rec.catchup_bytes,
            experts_changed_pct=expert_changed_pct(rec.changed_tensors, self.publisher.detector.published or {})
            if self.transfer.layout is not None and rec.kind == "delta" else {},
        ))  # fmt: skip
        self.summary.add(**{rec.kind: 1, f"{rec.kind}_bytes": rec.nbytes, f"{rec.kind}_changed_pct": 100 * rec.changed_fraction})
        self.flush()

    def _summary_line(self, counts: collections.Counter, latest: dict[str, Any], seconds: float) -> str:
        """The trainer's line per interval: steps, version, samples, waiting, loss and reward, publishes, drops."""
        flow, last = dict(self.worker.counts), self._flow_at_summary
        self._flow_at_summary = flow
        parts = [
            f"{int(counts['steps'])} steps in {seconds:.0f}s (version {latest.get('version')})",
            f"{int(counts['samples'])} samples trained", f"waited {100 * counts['wait_s'] / max(seconds, 1e-9):.0f}%",
        ]  # fmt: skip
        for key, label, digits in (("loss", "loss", 4), ("reward", "batch reward", 3)):
            if isinstance(latest.get(key), (int, float)):
                parts.append(f"{label} {latest[key]:.{digits}f}")
        for kind in ("anchor", "delta"):
            if n := int(counts[kind]):
                changed = f", {counts[f'{kind}_changed_pct'] / n:.1f}% changed" if kind == "delta" else ""
                parts.append(f"{n} {kind}(s) published ({counts[f'{kind}_bytes'] / n / 1e3:.0f} KB{changed})")
        for key in ("dropped_stale", "expired_unread", "invalid", "dropped_degenerate"):
            if grown := flow[key] - last.get(key, 0):
                parts.append(f"{grown} {key.replace('_', ' ')}")
        return "trainer: " + ", ".join(parts)

    def flush(self, force: bool = False) -> None:
        """Write ``metrics/trainer.json`` (rows and the trainer's current state)."""
        budget = {"hub": HubCounts(**self.meter.snapshot()), "coalescing": self.coalescing.notice} if self.meter is not None else {}
        self.metrics.state = TrainerMetrics(
            **budget,
            version=self.version, opt_steps=self.opt_steps, queued_samples=self.worker.rollout_buffer.qsize(),
            checkpoint_step=self.checkpoint_callback.last_step, notice=self.notice,
            refused=RefusalCounts.of(self.refusals), non_finite_refused=self.transfer.non_finite_refused,
            checkpoints_skipped=self.checkpoints.skipped, bucket_refused=dict(self.publisher.refused + self.control.refused),
            non_finite_steps_skipped=self.step_guard.skipped, version_corrections=self.version_guard.corrected,
            flow=self.flow.figures(), publish=self._publish_figures(),
        )  # fmt: skip
        self.metrics.flush(force)

    def _publish_figures(self) -> BackgroundPublishFigures | None:
        """The background publisher's figures: the last send's stall (the cast into the staging
        buffer), versions coalesced while it was behind, publishes that failed."""
        background = self.transfer.background
        if background is None:
            return None
        return BackgroundPublishFigures(stall_s=background.stall_s, coalesced=background.coalesced, errors=background.errors)

    # -- resuming -------------------------------------------------------------

    def prepare(self) -> str | None:
        """Take the run lock and find where to continue (:meth:`rlsync.trl.BucketSync.prepare`).

        A bucket that holds a run is continued from its newest checkpoint that verifies, or, without one,
        when the model is bit for bit the run's newest version (a restart before the first checkpoint,
        saved after the first step). Otherwise the trainer refuses (:class:`~rlsync.protocol.RunExistsError`, naming both ways on)
        unless ``new_run`` is set, which starts a new run: a new run id, its first version an
        anchor, which replicas notice and re-bootstrap from.

        Returns:
            The local checkpoint folder to resume from, or ``None`` (an empty bucket or a new run).

        Raises:
            RunExistsError: the bucket holds a run, no checkpoint verifies and ``new_run`` is off.
        """
        folder = self.sync.prepare()
        if self.sync.checkpoint_step is not None:
            self.opt_steps = self.sync.checkpoint_step
        # The Trackio run is named by the bucket's run id (fixed now for a run not published yet): the same after
        # every restart of the run, which TRL's Trackio callback opens with resume="allow".
        ownership = self.publisher.ownership
        ownership.run_id = ownership.run_id or new_run_id()
        self.trl.args.run_name = ownership.run_id
        return folder

    # -- lifecycle ------------------------------------------------------------

    def run(self, prepared: bool = False) -> None:
        """Train until :meth:`stop` or ``max_steps``; publishes and checkpoints the last step.

        Args:
            prepared: :meth:`prepare` was called already (by :meth:`start`).
        """
        if not prepared:
            self.prepare()
        try:
            self.sync.train()
        finally:
            self.flush(force=True)
        logger.info("trainer finished at step %d, version %s", self.trl.state.global_step, self.version)

    def start(self) -> None:
        if self.running:
            return
        self.stop_requested = False
        self.prepare()  # here, so that a refusal reaches the caller (the panel shows it)
        self._thread = SupervisedThread(self.run, args=(True,), name="trainer", restart=False)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step (or while waiting for rollouts), saving a checkpoint and publishing."""
        self.stop_requested = True
        self.sync.request_stop()
        if self._thread:
            self._thread.join(timeout=300)

    def close(self) -> None:
        """Stop, finish the background publish and stop its worker, delete the local scratch folder and
        stop watching the bucket."""
        self.stop()
        try:
            self.sync.close()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
            if self._owns_watch:
                self.bucket.close()

    @property
    def finished(self) -> bool:
        """Whether ``max_steps`` optimizer steps were trained."""
        return bool(self.config.max_steps) and self.trl.state.global_step >= self.config.max_steps
