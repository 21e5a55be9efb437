"""The environment Space's settings, :class:`EnvConfig` (``ENV_<FIELD>`` environment variables).

Kept apart from :mod:`env_space.simulator` so that reading them (``--help``, the deploy
command, the combined app's flags) imports no environment source.
"""

from __future__ import annotations

import dataclasses

from rlsync.spaces.settings import bucket_field, from_env, metrics_every_field, poll_field


@dataclasses.dataclass
class EnvConfig:
    """Settings of the environment Space (environment variables ``ENV_<FIELD>``)."""

    bucket: str = bucket_field("bucket URL or path")
    environment: str = dataclasses.field(
        default="reverse",
        metadata={"help": "reverse | arithmetic | reasoning_gym:NAME[=W],... | dataset:HUB_ID_OR_PATH | openenv:URL"},
    )
    chat_template: str = dataclasses.field(
        default="", metadata={"help": "model id/path whose chat template formats source prompts ('' = plain text)"}
    )
    source_settings: str = dataclasses.field(
        default="", metadata={"help": "JSON object of source settings, over the ENV_RG_/ENV_DATASET_/ENV_OPENENV_ variables"}
    )
    score_timeout_s: float = dataclasses.field(default=10.0, metadata={"help": "time bound of one scoring call"})
    score_budget_s: float = dataclasses.field(default=60.0, metadata={"help": "time bound of scoring one rollouts object"})
    score_memory_mb: int = dataclasses.field(default=2048, metadata={"help": "memory a confined scoring child may add"})
    failure_reward: float = dataclasses.field(default=0.0, metadata={"help": "reward of a sample whose scoring failed"})
    tasks_per_batch: int = dataclasses.field(default=4, metadata={"help": "tasks in one batch"})
    queue_depth: int = dataclasses.field(default=2, metadata={"help": "batches kept waiting for replicas"})
    keep_batches: int = dataclasses.field(default=64, metadata={"help": "batches kept in the bucket"})
    poll_s: float = poll_field()
    metrics_every_s: float = metrics_every_field()
    seed: int = dataclasses.field(default=0, metadata={"help": "base seed of task generation"})
    vocab_size: int = dataclasses.field(default=0, metadata={"help": "refuse token ids at or above it (0: the trainer checks them)"})
    max_completion_tokens: int = dataclasses.field(default=4096, metadata={"help": "refuse rollouts with longer completions"})

    @classmethod
    def from_env(cls, **overrides) -> "EnvConfig":
        return from_env(cls, "ENV", **overrides)
