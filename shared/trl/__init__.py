"""Bucket sync for TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``).

Plug-ins any TRL user can pass to the trainer, importable without the Spaces:

- :class:`BucketWeightTransfer`: ``weight_transfer=``; publishes every weight sync to
  the bucket as an anchor or a sparse bf16 delta.
- :class:`BucketRolloutWorker`: ``rollout_worker=``; feeds the trainer scored samples
  from the bucket's ``scores/``.
- :class:`BucketCheckpoints`: Trainer-format checkpoints in the bucket, resume from the newest.
- :func:`apply_cpu_compat`: run the trainer without a GPU.
"""

from .checkpoints import BucketCheckpoints, CheckpointCallback, FinalWeightSync
from .cpu_compat import apply_cpu_compat, sdpa_tree_attention
from .rollout_worker import BucketRolloutWorker, StopRequested, group_advantages, to_rollout_sample
from .weight_transfer import BucketWeightTransfer

__all__ = [
    "BucketCheckpoints",
    "BucketRolloutWorker",
    "BucketWeightTransfer",
    "CheckpointCallback",
    "FinalWeightSync",
    "StopRequested",
    "apply_cpu_compat",
    "group_advantages",
    "sdpa_tree_attention",
    "to_rollout_sample",
]
