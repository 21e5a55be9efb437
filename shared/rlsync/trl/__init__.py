"""Bucket sync for TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``).

:class:`BucketSync` is the integration as one object (``trainer_kwargs()``, ``attach(trainer)``,
``checkpoint``); it is made of the plug-ins below, which any TRL user can also wire alone,
importable without the Spaces:

- :class:`BucketWeightTransfer`: ``weight_transfer=``; publishes every weight sync to
  the bucket as an anchor or a sparse bf16 delta (needs no TRL import itself).
- :class:`BucketRolloutWorker`: ``rollout_worker=``; feeds the trainer scored samples
  from the bucket's ``scores/``.
- :class:`BucketCheckpoints`, :class:`CheckpointCallback`: Trainer-format checkpoints in
  the bucket, resume from the newest complete one.
- :class:`ShardedWeightTransfer`: ``weight_transfer=`` for FSDP2 runs; every rank publishes
  its own shards, nothing gathers (:func:`allow_cpu_fsdp`: FSDP2 through accelerate on CPU);
  :class:`ShardedCheckpointCallback`, :func:`restore_sharded`: its checkpoints in DCP's format.
- :class:`BucketAdapterSync`: a LoRA run (``peft_config``) publishes its adapter, not merged weights,
  to the bucket's adapter chain (:mod:`rlsync.adapters`).
- :class:`FinalWeightSync`: publish the last steps when training ends between two syncs.
- :class:`NonFiniteStepGuard`, :class:`VersionGuard`: skip steps with non-finite gradients
  before the optimizer; keep TRL's policy version from running ahead of the bucket's.
- :func:`apply_cpu_compat`: run the trainer without a GPU.
- :class:`TrackioSyncFigures`: each publish's sizes and times in the ``report_to="trackio"`` run.

Names are imported on first use, so publishing alone does not import TRL. Two warnings of the pinned
TRL (1.16) that are known and harmless here are silenced, by their exact messages: the one for every
import from ``trl.experimental`` (``AsyncGRPOTrainer`` lives there), and "TRL currently supports vLLM
versions from 0.22.0 to 0.31.0" (the bucket route never uses TRL's vLLM client); and, because TRL
imports vLLM where one is installed, vLLM's CPU-build notice "Triton is installed, but doesn't include
CPU backend" (its logger is set to errors only).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

#: Messages (regular expressions, matched at the start) of the known, harmless warnings of the pinned TRL.
KNOWN_WARNINGS = (r"You are importing from 'trl\.experimental'", r"TRL currently supports vLLM versions")
for _message in KNOWN_WARNINGS:
    warnings.filterwarnings("ignore", message=_message)
logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)

_EXPORTS = {
    "BucketSync": "bucket_sync",
    "BucketAdapterSync": "adapter_sync",
    "BucketWeightTransfer": "weight_transfer",
    "BucketRolloutWorker": "rollout_worker",
    "StopRequested": "rollout_worker",
    "group_advantages": "rollout_samples",
    "to_rollout_sample": "rollout_samples",
    "BucketCheckpoints": "checkpoints",
    "CheckpointCallback": "checkpoints",
    "FinalWeightSync": "final_sync",
    "ShardedWeightTransfer": "sharded_sync",
    "ShardedCheckpointCallback": "sharded_checkpoints",
    "restore_sharded": "sharded_checkpoints",
    "allow_cpu_fsdp": "cpu_fsdp",
    "NonFiniteStepGuard": "guards",
    "VersionGuard": "guards",
    "apply_cpu_compat": "cpu_compat",
    "TrackioSyncFigures": "trackio_sync",
    "sdpa_tree_attention": "cpu_compat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
