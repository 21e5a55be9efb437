"""Publishing the last steps of a TRL run that ends between two weight syncs."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class FinalWeightSync(TrainerCallback):
    """Publishes the final weights when training ends between two weight syncs.

    ``AsyncGRPOTrainer`` syncs every ``weight_sync_steps`` optimizer steps, so with
    ``max_steps`` (or a stop) off that grid the last steps would never reach the
    replicas. At train end this runs the trainer's own sync once more if any step
    was trained since the last one.

    Args:
        trainer: The ``AsyncGRPOTrainer`` (its ``_sync_weight`` keeps the version accounting).
        transfer: The weight transfer to flush (default: the trainer's). Give it for a sharded run:
            TRL keeps the transfer on the main process only, and every rank must flush.
    """

    def __init__(self, trainer: Any, transfer: Any = None) -> None:
        self.trainer = trainer
        self.transfer = transfer
        self.synced_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.synced_step = state.global_step  # the trainer syncs at train begin

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.weight_sync_steps == 0:
            self.synced_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.sync(state.global_step)

    def sync(self, step: int) -> bool:
        """Publish unless ``step`` was the last synced, then wait for a background publish
        (:meth:`~rlsync.trl.BucketWeightTransfer.flush`); returns whether it published.

        Raises:
            What the last background publish raised.
        """
        published = self.synced_step != step
        if published:
            self.trainer._sync_weight()
            self.synced_step = step
        transfer = self.transfer if self.transfer is not None else self.trainer.weight_transfer  # TRL's: main process only
        flush = getattr(transfer, "flush", None)
        if flush is not None:
            flush()
        return published
