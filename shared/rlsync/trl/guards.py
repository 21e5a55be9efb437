"""Callbacks that keep ``AsyncGRPOTrainer`` honest about steps and versions.

- :class:`NonFiniteStepGuard`: a step whose gradients are not finite (a NaN or
  infinite loss) never reaches the optimizer: its gradients are dropped before
  ``optimizer.step()``, so neither the weights nor the optimizer state change.
- :class:`VersionGuard`: TRL counts a weight sync as a new policy version even
  when :class:`~rlsync.trl.BucketWeightTransfer` refused to publish it (non-finite
  weights). Its staleness check would then run ahead of the bucket and drop every
  honest sample; the guard pins TRL's ``model_version`` to the bucket's after
  every step.

Add both after constructing the trainer (``trainer.add_callback(...)``): TRL's
own weight-sync callback must run first.

- :func:`restore_weights`: a publish refused as non-finite puts the published weights back into the model
  (:func:`restore_published`: the adapter's with LoRA, and the optimizer state cleared).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from transformers import TrainerCallback

from ..checkpoint_layout import CheckpointLayout

logger = logging.getLogger(__name__)


class NonFiniteStepGuard(TrainerCallback):
    """Skip optimizer steps whose gradients hold NaN or Inf; counts them in :attr:`skipped`."""

    def __init__(self) -> None:
        self.skipped = 0

    def on_pre_optimizer_step(self, args, state, control, model: torch.nn.Module | None = None, **kwargs: Any):
        if model is None:
            return control
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and not all(bool(torch.isfinite(g).all()) for g in grads):
            self.skipped += 1
            logger.error("step %d: non-finite loss or gradients; step skipped before the optimizer (%d so far)",
                         state.global_step + 1, self.skipped)  # fmt: skip
            model.zero_grad(set_to_none=True)  # the optimizer skips parameters without a gradient
        return control


class VersionGuard(TrainerCallback):
    """Keep TRL's ``model_version`` equal to the bucket's newest version in the trainer's numbering.

    Args:
        trainer: The ``AsyncGRPOTrainer``.
        transfer: Its :class:`~rlsync.trl.BucketWeightTransfer`.
        worker: Its :class:`~rlsync.trl.BucketRolloutWorker` (holds the version offset).
    """

    def __init__(self, trainer: Any, transfer: Any, worker: Any) -> None:
        self.trainer, self.transfer, self.worker = trainer, transfer, worker
        self.corrected = 0

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.pin()
        return control

    def pin(self) -> None:
        """Set TRL's version (and the worker's) back to the bucket's if it ran ahead."""
        if self.worker.version_offset is None or self.transfer.version is None:
            return
        version = self.worker.trainer_version(self.transfer.version)
        if self.trainer.model_version > version:
            self.corrected += 1
            logger.warning("TRL's policy version %d ran ahead of the bucket's (%d): pinned back",
                           self.trainer.model_version, version)  # fmt: skip
            self.trainer.model_version = version
            self.worker.update_model_version(version)


def restore_weights(model: torch.nn.Module, published: Mapping[str, torch.Tensor], layout: CheckpointLayout | None) -> None:
    """Copy the published weights back into ``model`` (never train on from a poisoned model).

    Args:
        model: The trained model.
        published: The published weights by name (names the model lacks are skipped): whole tensors, or a
            sharded publisher's flat slices (:class:`~rlsync.shards.LocalSlice` data), which go back into the
            rank's own part of the parameter (an FSDP2 DTensor's local shard).
        layout: The checkpoint layout the weights were published in (a MoE's fused experts), or ``None``.

    Raises:
        ValueError: a published tensor's size is not that of the parameter (or of its local shard).
    """
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    if layout is not None:  # published in checkpoint names: views of the fused parameters
        params = layout.checkpoint_state(params)
    with torch.no_grad():
        for name, tensor in published.items():
            if name not in params:
                continue
            target = params[name].to_local() if isinstance(params[name], DTensor) else params[name]
            if target.numel() != tensor.numel():
                raise ValueError(f"{name}: published {tensor.numel()} elements, the parameter holds {target.numel()} here")
            target.copy_(tensor.reshape(target.shape).to(target.dtype))


def restore_published(trainer: Any, published: Mapping[str, torch.Tensor], adapter_sync: Any, layout: CheckpointLayout | None) -> None:
    """Put the published weights back into ``trainer``'s model (into its adapter through ``adapter_sync``, with LoRA)
    and clear its optimizer state: training never goes on from a poisoned model."""
    if adapter_sync is not None:
        adapter_sync.restore(published)
    else:
        restore_weights(trainer.model, published, layout)
    if trainer.optimizer is not None:
        trainer.optimizer.state.clear()
