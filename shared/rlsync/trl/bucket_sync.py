"""The TRL integration as one object: :class:`BucketSync` joins an ``AsyncGRPOTrainer`` to a bucket.

>>> sync = BucketSync("hf://buckets/me/run", anchor_every=10)
>>> trainer = AsyncGRPOTrainer(model=..., args=config, **sync.trainer_kwargs())
>>> sync.attach(trainer)
>>> trainer.train(resume_from_checkpoint=sync.checkpoint)

It is made of the plug-ins of :mod:`rlsync.trl`, each usable alone:

- what the trainer takes as arguments (:meth:`~BucketSync.trainer_kwargs`): the weight transfer
  (:class:`~rlsync.trl.BucketWeightTransfer`; :class:`~rlsync.trl.ShardedWeightTransfer` with
  ``sharded``; the adapter chain's, :class:`~rlsync.trl.BucketAdapterSync`, with ``lora``), the
  rollout worker (:class:`~rlsync.trl.BucketRolloutWorker`) reading ``scores/`` with the library's
  parser (:func:`rlsync.scores.read_samples`), and the LoRA ``peft_config``; building them also
  applies :func:`~rlsync.trl.apply_cpu_compat` (a no-op on a GPU with the kernel);
- what it wires into the built trainer (:meth:`~BucketSync.attach`): the guards
  (:class:`~rlsync.trl.NonFiniteStepGuard`, :class:`~rlsync.trl.VersionGuard`), the final sync
  (:class:`~rlsync.trl.FinalWeightSync`), checkpoints into the bucket
  (:class:`~rlsync.trl.CheckpointCallback`, or DCP shards with ``sharded``), publish coalescing
  while a Hub bucket's request budget is short, and trackio figures when asked;
- where the run goes on (:meth:`~BucketSync.prepare`, run by ``attach``): a bucket that holds a
  run is continued from its newest checkpoint that verifies (``resume``), or replaced
  (``new_run``), or refused with :class:`~rlsync.errors.RunExistsError`; :attr:`~BucketSync.checkpoint`
  is the folder to give ``trainer.train(resume_from_checkpoint=...)``.

A publish refused because the weights hold NaN or Inf puts the published weights back into the
trained model and clears the optimizer state: training never goes on from a poisoned model.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..bucket import Bucket, open_bucket
from ..checkpoint_layout import CheckpointLayout
from ..defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_CODEC
from ..errors import NonFiniteError, StopRequested
from ..fp8 import fp8_publisher
from ..lora import LoraSpec, peft_config
from ..protocol import AnchorPolicy, FixedInterval, Publisher, PublishRecord
from ..protocol.retention import DEFAULT_KEEP_ANCHORS
from .adapter_sync import BucketAdapterSync
from .checkpoints import BucketCheckpoints
from .cpu_compat import apply_cpu_compat
from .guards import restore_published
from .resume import resume_point
from .rollout_worker import BucketRolloutWorker
from .scores_reader import TrainerScores
from .trainer_callbacks import SyncCallbacks
from .weight_transfer import BucketWeightTransfer

__all__ = ["BucketSync"]

logger = logging.getLogger(__name__)


class BucketSync:
    """Everything that joins TRL's ``AsyncGRPOTrainer`` to a bucket, as one object.

    Args:
        bucket: The run's bucket, or its URL (``hf://buckets/OWNER/NAME`` or a local folder).
        anchor_every: Publishes per anchor (the others are sparse deltas); ignored when ``policy`` is given.
        policy: The anchor policy (e.g. :class:`~rlsync.protocol.Adaptive`, or a panel-controlled one).
        codec: The delta codec.
        keep_anchors: Anchors retained in the bucket.
        keep_checkpoints: Checkpoints retained in the bucket.
        owner: Run-lock owner (default: this host and process).
        resume: Continue the bucket's run from its newest checkpoint that verifies (a bucket that
            holds a run and no such checkpoint is refused unless ``new_run``).
        new_run: On a bucket that holds a run and without a checkpoint to continue from, start a
            new run (a new run id; replicas re-bootstrap from its first anchor) instead of refusing.
        lora: Train a LoRA adapter with these settings and publish adapter versions
            (:class:`~rlsync.trl.BucketAdapterSync`): the base once, then the adapter chain.
        sharded: FSDP2: every rank publishes its own shards (:class:`~rlsync.trl.ShardedWeightTransfer`)
            and checkpoints in DCP's format; build the object and call :meth:`attach` on every rank.
        sharded_background: With ``sharded``, every rank publishes on a worker thread of its own
            (:mod:`rlsync.protocol.sharded_background`); ``False``: within the sync.
        poll_s: Seconds between listings of ``scores/``.
        queue_maxsize: Bound of the rollout queue (0: unbounded).
        max_staleness: Skip samples this many versions behind when read (``None``: TRL's check only).
        on_publish: Called with every :class:`~rlsync.protocol.PublishRecord`.
        trackio: Log each publish's sizes and times into the trainer's trackio run.
        layout: The model's checkpoint layout (:class:`~rlsync.checkpoint_layout.CheckpointLayout`): a MoE's
            fused experts are published in checkpoint names, one tensor per expert.
        fp8: Also publish the FP8 serving chain (:mod:`rlsync.fp8`) beside the bf16 one.
        worker_summary_s: Seconds between the rollout worker's summary lines (``None``: none, the caller
            reports its counts).

    Attributes:
        transfer: The weight transfer (its ``version`` is the newest version sent, TRL's counter;
            ``published_version`` the newest in the bucket: they differ while the weight transfer
            publishes in the background, its default).
        worker: The rollout worker (its ``counts`` are the flow figures).
        publisher: The publisher of the trained chain (the adapter chain's with ``lora``).
        checkpoints: The run's checkpoints in the bucket.
        callbacks: The trainer's callbacks (:class:`~rlsync.trl.trainer_callbacks.SyncCallbacks`: the guards, the final
            sync, checkpoints, coalescing), made by :meth:`attach`.
        read_scores: The scores reader (:class:`~rlsync.trl.scores_reader.TrainerScores`).
        refusals: Scores objects refused by the parser, by prefix.
        checkpoint: The local checkpoint folder to resume from (``None``: a fresh or new run), set by
            :meth:`prepare`; ``checkpoint_step`` is its optimizer step.
        notice: What the last :meth:`prepare` found worth telling ('' when nothing).

    Raises:
        ValueError: both ``lora`` and ``sharded``.
    """

    def __init__(
        self,
        bucket: Bucket | str,
        *,
        anchor_every: int = DEFAULT_ANCHOR_INTERVAL,
        policy: AnchorPolicy | None = None,
        codec: str = DEFAULT_CODEC,
        keep_anchors: int = DEFAULT_KEEP_ANCHORS,
        keep_checkpoints: int = 2,
        owner: str | None = None,
        resume: bool = False,
        new_run: bool = False,
        lora: LoraSpec | None = None,
        sharded: bool = False,
        sharded_background: bool = True,
        poll_s: float = 0.5,
        queue_maxsize: int = 0,
        max_staleness: int | None = None,
        on_publish: Callable[[PublishRecord], None] | None = None,
        trackio: bool = False,
        layout: CheckpointLayout | None = None,
        fp8: bool = False,
        worker_summary_s: float | None = 60.0,
    ) -> None:
        if lora is not None and sharded:
            raise ValueError("a LoRA run and a sharded run are not supported together")
        self.bucket = open_bucket(bucket) if isinstance(bucket, str) else bucket
        self.lora, self.sharded, self.resume = lora, sharded, resume
        chain = dict(
            policy=policy or FixedInterval(anchor_every), keep_anchors=keep_anchors, codec=codec, owner=owner,
            new_run=new_run,
        )  # fmt: skip
        self.adapter_sync = BucketAdapterSync(self.bucket, **chain) if lora is not None else None
        self.transfer = (
            self.adapter_sync.transfer if self.adapter_sync is not None
            else _weight_transfer(self.bucket, chain, sharded=sharded, background=sharded_background, layout=layout, fp8=fp8)
        )  # fmt: skip
        self.callbacks = SyncCallbacks(trackio=trackio, on_publish=on_publish)
        self.transfer.on_publish, self.transfer.on_non_finite = self.callbacks.published, self._restore_published
        if self.callbacks.trackio is not None:
            self.transfer.on_send = self.callbacks.trackio.sent
        self.publisher = self.transfer.publisher
        self.checkpoints = BucketCheckpoints(self.bucket, keep=keep_checkpoints, chain=self.publisher)
        self.read_scores = TrainerScores(self._limits, lambda: self.publisher.replaced_step)
        self.refusals = self.read_scores.refusals
        self.worker = BucketRolloutWorker(
            self.bucket, self.read_scores, vocab_size=0, max_tokens=0, poll_s=poll_s, queue_maxsize=queue_maxsize,
            max_staleness=max_staleness, heartbeat=self.transfer.heartbeat, chain=self.publisher.bucket,
            summary_s=worker_summary_s,
        )  # fmt: skip  # vocab_size: the trainer's tokenizer, at attach(); read_scores bounds tokens by the model's context
        self.trainer: Any = None
        self.checkpoint: str | None = None
        self.checkpoint_step: int | None = None
        self.notice = ""
        self.uses_sdpa = None

    @property
    def version(self) -> int | None:
        """The newest version sent (``None`` before the first): TRL's counter, in the bucket once its
        background publish is done (:attr:`published_version` is what the bucket holds now)."""
        return self.transfer.version

    @property
    def published_version(self) -> int | None:
        """The newest version in the bucket (``None`` before the first publish)."""
        return self.transfer.published_version

    def trainer_kwargs(self) -> dict[str, Any]:
        """What to pass to ``AsyncGRPOTrainer(...)``: ``rollout_worker``, ``weight_transfer`` and, with
        ``lora``, ``peft_config``. Also makes TRL runnable without a GPU (:func:`~rlsync.trl.apply_cpu_compat`),
        which must happen before the trainer is built."""
        self.uses_sdpa = apply_cpu_compat()
        kwargs: dict[str, Any] = {"rollout_worker": self.worker, "weight_transfer": self.transfer}
        if self.lora is not None:
            kwargs["peft_config"] = peft_config(self.lora)
        return kwargs

    def attach(self, trainer: Any, *, prepare: bool = True) -> "BucketSync":
        """Wire the built trainer: guards, final sync, checkpoints, coalescing; then :meth:`prepare`.

        Args:
            trainer: The ``AsyncGRPOTrainer`` built with :meth:`trainer_kwargs` (on every rank with ``sharded``).
            prepare: Run :meth:`prepare` now (a role that starts training later calls it then).

        Returns:
            This object.

        Raises:
            RunExistsError, RunLockedError: as :meth:`prepare`.
            SyncError: with ``lora``, the bucket's weights chain holds another base model.
        """
        self.trainer = trainer
        self.worker.vocab_size = len(trainer.processing_class)
        if self.adapter_sync is not None:
            self.adapter_sync.attach(trainer)
        if self.sharded:
            self.transfer.attach(trainer)  # type: ignore[attr-defined]
        self.callbacks.install(
            trainer, transfer=self.transfer, worker=self.worker, checkpoints=self.checkpoints, bucket=self.bucket,
            sharded=self.sharded, info=self._checkpoint_info,
        )  # fmt: skip
        if prepare:
            self.prepare()
        return self

    def prepare(self) -> str | None:
        """Take the run lock and find where to continue (again at each call: a restarted role calls it).

        With ``resume``, the newest checkpoint that verifies against the published chain and the
        model is downloaded into the trainer's ``output_dir``. Without one, a bucket that holds a run
        is refused unless ``new_run`` starts a new run.

        Returns:
            :attr:`checkpoint`: the local checkpoint folder, or ``None`` (an empty bucket or a new run).

        Raises:
            RuntimeError: :meth:`attach` was not called.
            RunExistsError: the bucket holds a run, no checkpoint is resumed from and ``new_run`` is off.
            RunLockedError: another trainer holds the run lock.
        """
        if self.trainer is None:
            raise RuntimeError("call BucketSync.attach(trainer) first")
        point = resume_point(self.trainer, self.checkpoints, self.transfer, resume=self.resume, sharded=self.sharded)
        self.checkpoint, self.checkpoint_step = point.folder, point.step
        if point.notice:
            self.notice = point.notice
        return self.checkpoint

    def train(self) -> None:
        """``trainer.train(resume_from_checkpoint=checkpoint)``; a stop while waiting for rollouts
        (:meth:`request_stop`) still checkpoints and publishes the last step."""
        trainer = self.trainer
        try:
            trainer.train(resume_from_checkpoint=self.checkpoint)
        except StopRequested:  # stopped while waiting for rollouts: save what the callbacks could not
            self.callbacks.save_last(trainer)

    def request_stop(self) -> None:
        """End a ``train()`` that waits for rollouts (:class:`~rlsync.errors.StopRequested`)."""
        self.worker.request_stop()

    def close(self) -> None:
        """Done for good (a role closing): stop reading rollouts, finish the background publish and stop its
        worker, freeing its staging buffer. Raises as :meth:`BucketWeightTransfer.close`."""
        self.worker.stop()
        self.transfer.close()

    def _limits(self) -> tuple[int, int | None, int | None]:
        config = getattr(getattr(self.trainer, "model", None), "config", None)
        return self.worker.vocab_size, self.transfer.version, getattr(config, "max_position_embeddings", None)

    def _checkpoint_info(self) -> dict[str, Any]:
        return {"published_version": self.transfer.version}

    def _restore_published(self, exc: NonFiniteError) -> None:
        """Never train on from a poisoned model: back to the published weights, optimizer state reset."""
        logger.error("%s; restoring the published weights and resetting the optimizer", exc)
        restore_published(self.trainer, self.publisher.detector.published or {}, self.adapter_sync, self.transfer.layout)


def _weight_transfer(
    bucket: Bucket, chain: dict[str, Any], *, sharded: bool, background: bool, layout: CheckpointLayout | None, fp8: bool
) -> BucketWeightTransfer:
    """The transfer of a full-weights run: each rank's shards (``sharded``, published on a worker thread
    of each rank with ``background``), else the whole model (with an FP8 chain beside it, with ``fp8``)."""
    if sharded:
        from ..protocol.sharded import ShardedPublisher
        from ..protocol.sharded_background import publish_group
        from .sharded_sync import ShardedWeightTransfer

        group = publish_group() if background else None
        return ShardedWeightTransfer(publisher=ShardedPublisher(bucket, group=group, **chain), background=background)
    return BucketWeightTransfer(
        publisher=Publisher(bucket, **chain), layout=layout if layout is not None and layout.parts else None,
        fp8=fp8_publisher(bucket, **chain) if fp8 else None,
    )  # fmt: skip
