"""The callbacks :class:`~rlsync.trl.BucketSync` wires into a built ``AsyncGRPOTrainer`` (:class:`SyncCallbacks`):
the guards, the final sync, checkpoints into the bucket, publish coalescing while a Hub bucket's request budget
is short, trackio figures when asked; what a stop while waiting for rollouts still saves; and the calls at each
publish."""

from __future__ import annotations

from typing import Any, Callable

from ..bucket import Bucket
from ..bucket.watch import meter_of
from ..protocol import PublishRecord
from .checkpoints import BucketCheckpoints, CheckpointCallback
from .final_sync import FinalWeightSync
from .guards import NonFiniteStepGuard, VersionGuard


class SyncCallbacks:
    """The trainer's callbacks of one :class:`~rlsync.trl.BucketSync` (those that need the trainer: made by
    :meth:`install`).

    Args:
        trackio: Log each publish's sizes and times into the trainer's trackio run
            (:class:`~rlsync.trl.trackio_sync.TrackioSyncFigures`, :attr:`trackio`).
        on_publish: Called with every :class:`~rlsync.protocol.PublishRecord`.
    """

    def __init__(self, *, trackio: bool = False, on_publish: Callable[[PublishRecord], None] | None = None) -> None:
        self.trackio: Any = None
        if trackio:
            from .trackio_sync import TrackioSyncFigures

            self.trackio = TrackioSyncFigures()
        self.on_publish = on_publish
        self.step_guard = NonFiniteStepGuard()
        self.version_guard: VersionGuard | None = None
        self.final_sync: FinalWeightSync | None = None
        self.checkpoint_callback: Any = None
        self.coalescing: Any = None

    def install(
        self,
        trainer: Any,
        *,
        transfer: Any,
        worker: Any,
        checkpoints: BucketCheckpoints,
        bucket: Bucket,
        sharded: bool,
        info: Callable[[], dict[str, Any]],
    ) -> None:
        """Make the callbacks for ``trainer`` and add them, after TRL's own weight-sync callback, which the guards
        follow (checkpoints in DCP's format with ``sharded``; coalescing only on a metered bucket)."""
        if sharded:
            from .sharded_checkpoints import ShardedCheckpointCallback

            self.checkpoint_callback = ShardedCheckpointCallback(checkpoints, info=info)
        else:
            self.checkpoint_callback = CheckpointCallback(checkpoints, info=info)
        self.version_guard = VersionGuard(trainer, transfer, worker)
        self.final_sync = FinalWeightSync(trainer, transfer)  # every rank flushes (TRL gives rank 0 the transfer)
        meter = meter_of(bucket)
        if meter is not None:
            from .coalesce import PublishCoalescing

            self.coalescing = PublishCoalescing(trainer, meter)
        for callback in (self.step_guard, self.version_guard, self.checkpoint_callback, self.final_sync, self.coalescing):
            if callback is not None:
                trainer.add_callback(callback)
        if self.trackio is not None:
            self.trackio.install(trainer)

    def published(self, record: PublishRecord) -> None:
        """At every publish: its trackio figures, then ``on_publish``."""
        if self.trackio is not None:
            self.trackio.record(record)
        if self.on_publish is not None:
            self.on_publish(record)

    def save_last(self, trainer: Any) -> None:
        """After a stop while waiting for rollouts: checkpoint the last step the callbacks could not, and publish it."""
        step = trainer.state.global_step
        if step and self.checkpoint_callback.last_step != step:
            trainer._save_checkpoint(trainer.model, trial=None)
            self.checkpoint_callback.upload(trainer.args.output_dir, step)
        self.final_sync.sync(step)
