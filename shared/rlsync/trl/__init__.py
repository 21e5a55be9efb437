"""Bucket sync for TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``).

Plug-ins any TRL user can pass to the trainer, importable without the Spaces:

- :class:`BucketWeightTransfer`: ``weight_transfer=``; publishes every weight sync to
  the bucket as an anchor or a sparse bf16 delta (needs no TRL import itself).
- :class:`BucketRolloutWorker`: ``rollout_worker=``; feeds the trainer scored samples
  from the bucket's ``scores/``.
- :class:`BucketCheckpoints`, :class:`CheckpointCallback`: Trainer-format checkpoints in
  the bucket, resume from the newest complete one.
- :class:`FinalWeightSync`: publish the last steps when training ends between two syncs.
- :func:`apply_cpu_compat`: run the trainer without a GPU.
- :class:`TrackioSyncFigures`: each publish's sizes and times in the ``report_to="trackio"`` run.

Names are imported on first use, so publishing alone does not import TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BucketWeightTransfer": "weight_transfer",
    "BucketRolloutWorker": "rollout_worker",
    "StopRequested": "rollout_worker",
    "group_advantages": "rollout_worker",
    "to_rollout_sample": "rollout_worker",
    "BucketCheckpoints": "checkpoints",
    "CheckpointCallback": "checkpoints",
    "FinalWeightSync": "final_sync",
    "apply_cpu_compat": "cpu_compat",
    "TrackioSyncFigures": "trackio_sync",
    "sdpa_tree_attention": "cpu_compat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
