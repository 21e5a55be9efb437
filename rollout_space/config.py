"""A rollout replica's settings, :class:`ReplicaConfig` (``ROLLOUT_<FIELD>`` environment variables).

Kept apart from :mod:`rollout_space.replica` so that reading them (``--help``, the deploy
command, the combined app's flags) imports neither torch nor an engine.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from rlsync.errors import ConfigurationError
from rlsync.registry import Kind, check_choice, names
from rlsync.spaces.settings import bucket_field, from_env, instance_id, on_space, poll_field

from .token_budget import context_length

#: The tiny CPU demo's answers are a few tokens. A real model's must fit a worked answer: GSM8K's and reasoning-gym's
#: are step-by-step solutions of a few hundred tokens on Qwen3-0.6B; at 64 most were cut before the final answer
#: (reward 0 for every sample of a group: no advantage, nothing to learn). rollout_space/README.md says more.
TINY_MODEL_MAX_NEW_TOKENS, REAL_MODEL_MAX_NEW_TOKENS = 8, 512


def default_replica_id() -> str:
    """On a Space, its id with ``--`` for the slash (``alice/rl-sync-rollout`` -> ``alice--rl-sync-rollout``: two
    duplicates differ, a restart keeps it); elsewhere ``<host>-<pid>``. Sanitised for object keys."""
    if on_space():
        return instance_id()
    return f"{_key_safe(socket.gethostname())[:40] or 'replica'}-{os.getpid()}"


def _key_safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


@dataclasses.dataclass
class ReplicaConfig:
    """Settings of a rollout replica (environment variables ``ROLLOUT_<FIELD>``)."""

    bucket: str = bucket_field("bucket URL or path (read access to weights, write to rollouts/ and status/)")
    replicas: int = dataclasses.field(default=1, metadata={"help": "replicas in this process, each with its own engine (several: ids get -0, -1, ... suffixes); a restart resumes as many"})
    replica_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: on a Space its SPACE_ID, owner--name; elsewhere host-pid); a live status of this id written by another host refuses the start"})
    engine: str = dataclasses.field(default="auto", metadata={"help": f"{', '.join(map(repr, names(Kind.ENGINE)))}, or 'auto' (vllm on a GPU when installed, or for the fp8 chain)"})
    model: str = dataclasses.field(default="", metadata={"help": "model name or folder (default: Qwen/Qwen3-0.6B on a GPU, the tiny offline model on CPU)"})
    chain: str = dataclasses.field(default="bf16", metadata={"help": "weights chain to follow: 'bf16', or 'fp8' (the trainer's FP8 chain, TRAINER_FP8=1; served by vLLM from the model quantized to block FP8: a GPU, or a CPU with AMX; docs/fp8.md)"})
    device: str = dataclasses.field(default="auto", metadata={"help": "torch device for the transformers engine ('auto': cuda if available)"})
    samples_per_task: int = dataclasses.field(default=4, metadata={"help": "G completions per task"})
    max_new_tokens: int = dataclasses.field(default=0, metadata={"help": "completion length limit (0: 8 for the tiny offline CPU model, 512 for a real model)"})
    max_prompt_tokens: int = dataclasses.field(default=0, metadata={"help": "longest prompt answered (0: the model's context less max_new_tokens)"})
    max_batch_tokens: int = dataclasses.field(default=1 << 20, metadata={"help": "most tokens (prompts and completions, all samples) one task batch may cost"})
    chunk_tokens: int = dataclasses.field(default=1 << 16, metadata={"help": "most padded tokens in one engine call"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature"})
    poll_s: float = poll_field()
    status_every_s: float = dataclasses.field(default=30.0, metadata={"help": "seconds between status writes on a Hub bucket"})
    seed: int = dataclasses.field(default=0, metadata={"help": "sampling seed (mixed with batch and version)"})
    rehash_every_s: float = dataclasses.field(default=300.0, metadata={"help": "seconds between background full re-hashes of the engine's weights (0: only after anchors)"})
    lora: bool = dataclasses.field(default=False, metadata={"help": "a LoRA run: serve the adapter chain (adapters/) on the base from the weights chain"})
    lora_window: int = dataclasses.field(default=3, metadata={"help": "adapter versions served at once (the trainer's max_staleness + 1)"})
    lora_max_rank: int = dataclasses.field(default=16, metadata={"help": "largest adapter rank the vLLM engine accepts (1, 8, 16, 32, 64...)"})
    max_model_bytes: int = dataclasses.field(default=0, metadata={"help": "largest model the bucket's first anchor may hold, in bytes (0: the size of the model's weights files)"})

    def __post_init__(self) -> None:
        check_choice(Kind.ENGINE, self.engine, "ROLLOUT_ENGINE", also=("auto",))
        if type(self.replicas) is not int or self.replicas < 1:
            raise ConfigurationError(f"ROLLOUT_REPLICAS must be a whole number >= 1, got {self.replicas!r}")

    @classmethod
    def from_env(cls, **overrides) -> "ReplicaConfig":
        return from_env(cls, "ROLLOUT", **overrides)

    def with_model_defaults(self, device: str) -> "ReplicaConfig":
        """``max_new_tokens`` left at 0 takes the default of the model that will run (the same for a Space made
        by the deploy command or duplicated by hand), at most half the context of a model folder (a completion
        length the context cannot hold would leave every prompt too long)."""
        from rlsync.spaces.tiny_model import is_tiny_model  # torch: not at import (--help stays light)

        if self.max_new_tokens:
            return self
        default = TINY_MODEL_MAX_NEW_TOKENS if is_tiny_model(self.model, device) else REAL_MODEL_MAX_NEW_TOKENS
        if self.model and Path(self.model, "config.json").is_file():  # a model folder: half its context stays for prompts
            default = min(default, max(1, context_length(self.model) // 2))
        return dataclasses.replace(self, max_new_tokens=default)
