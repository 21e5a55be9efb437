"""The trainer Space's settings, :class:`TrainerConfig` (``TRAINER_<FIELD>`` environment variables).

Kept apart from :mod:`trainer_space.trainer` so that reading them (``--help``, the deploy
command, the combined app's flags) imports neither torch nor TRL.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import TYPE_CHECKING, Any

from rlsync.defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_CODEC, DEFAULT_MAX_CATCHUP_RATIO
from rlsync.errors import ConfigurationError
from rlsync.registry import Kind, check_choice, names
from rlsync.spaces.settings import bucket_field, from_env, metrics_every_field, poll_field

if TYPE_CHECKING:
    from rlsync.adapters import LoraSpec
    from rlsync.protocol import AnchorPolicy

#: ``max_steps`` given to TRL when the run has no limit (TRL needs one; the schedule is constant).
UNLIMITED_STEPS = 10**9
TINY_MODEL_LR, TINY_MODEL_ADAM_EPSILON = 5e-4, 3e-3  # the CPU demo: median delta ~8% changed, reward +0.29 in 5 min
# LoRA runs (docs/lora.md): plain AdamW (its step is ~lr on every adapter element), a larger lr than full fine-tuning
TINY_MODEL_LORA_LR, REAL_MODEL_LORA_LR, LORA_ADAM_EPSILON = 1e-3, 1e-5, 1e-8
REAL_MODEL_LR, REAL_MODEL_ADAM_EPSILON = 1e-6, 1e-8  # RL fine-tuning of a pretrained model


class ReportTo(str, enum.Enum):
    """Where TRL's logs and the sync figures go (``TRAINER_REPORT_TO``)."""

    AUTO = "auto"
    TRACKIO = "trackio"
    NONE = "none"


@dataclasses.dataclass
class TrainerConfig:
    """Settings of the trainer Space (environment variables ``TRAINER_<FIELD>``); they map onto TRL's ``AsyncGRPOConfig``."""

    bucket: str = bucket_field("bucket URL or path (write access)")
    model: str = dataclasses.field(default="", metadata={"help": "model name or folder (default: Qwen/Qwen3-0.6B on a GPU, the tiny offline model on CPU)"})
    device: str = dataclasses.field(default="auto", metadata={"help": "torch device ('auto': cuda if available, else cpu)"})
    lr: float = dataclasses.field(default=0.0, metadata={"help": "learning rate (learning_rate); 0: 5e-4 for the tiny offline CPU model, 1e-6 for a real model (LoRA: 1e-3 and 1e-5)"})
    optim: str = dataclasses.field(default="adamw_torch", metadata={"help": "optimizer: a transformers optim name, e.g. 'adamw_torch' or 'sgd' (optim)"})
    adam_epsilon: float = dataclasses.field(default=0.0, metadata={"help": "AdamW epsilon (adam_epsilon); 0: 3e-3 for the tiny offline CPU model (steps follow the gradient's size, so weights with small gradients barely move and deltas stay sparse), 1e-8 for a real model and for LoRA"})
    weight_decay: float = dataclasses.field(default=0.0, metadata={"help": "weight decay (weight_decay)"})
    batch_size: int = dataclasses.field(default=16, metadata={"help": "samples per optimizer step (per_device_train_batch_size)"})
    sync_every: int = dataclasses.field(default=1, metadata={"help": "optimizer steps per publish (weight_sync_steps)"})
    max_staleness: int = dataclasses.field(default=2, metadata={"help": "drop samples this many versions behind (max_staleness)"})
    pacing: str = dataclasses.field(default="demand", metadata={"help": "'demand': write control/demand.json so the env issues tasks at the rate this trainer consumes; 'queue': the env keeps its queue_depth batches waiting"})
    clip_eps: float = dataclasses.field(default=0.2, metadata={"help": "importance-ratio clip (epsilon)"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature of the replicas (temperature)"})
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"help": "gradient clipping (max_grad_norm)"})
    anchor_policy: str = dataclasses.field(default="fixed", metadata={"help": f"anchor policy: {', '.join(map(repr, names(Kind.ANCHOR_POLICY)))} (rlsync/protocol/policies/)"})
    anchor_interval: int = dataclasses.field(default=DEFAULT_ANCHOR_INTERVAL, metadata={"help": "publishes per anchor (fixed policy)"})
    max_catchup_ratio: float = dataclasses.field(default=DEFAULT_MAX_CATCHUP_RATIO, metadata={"help": "adaptive policy bound, in anchors"})
    anchor_settings: str = dataclasses.field(default="", metadata={"help": "the anchor policy's settings as a JSON object (any policy's; over the two above), e.g. {\"interval\": 5}"})
    keep_anchors: int = dataclasses.field(default=2, metadata={"help": "anchors retained in the bucket"})
    codec: str = dataclasses.field(default=DEFAULT_CODEC, metadata={"help": f"delta codec: {', '.join(map(repr, names(Kind.CODEC)))} or 'auto' (the default for the device)"})
    max_steps: int = dataclasses.field(default=0, metadata={"help": "stop after this many optimizer steps (0: never) (max_steps)"})
    checkpoint_every: int = dataclasses.field(default=50, metadata={"help": "optimizer steps per bucket checkpoint, also saved after the first step, on stop and on SIGTERM (save_steps)"})
    keep_checkpoints: int = dataclasses.field(default=2, metadata={"help": "checkpoints retained in the bucket"})
    poll_s: float = poll_field()
    metrics_every_s: float = metrics_every_field()
    seed: int = dataclasses.field(default=0, metadata={"help": "torch seed (seed)"})
    trainer_id: str = dataclasses.field(default="", metadata={"help": "run-lock owner id; a restart with the same id takes over (default: SPACE_ID or host name)"})
    new_run: bool = dataclasses.field(default=False, metadata={"help": "when the bucket holds a run but no checkpoint to continue from: start a new run (new run id; replicas re-bootstrap from its first anchor) instead of refusing; a checkpoint, when there is one, is always resumed from"})
    lora_rank: int = dataclasses.field(default=0, metadata={"help": "train a LoRA adapter of this rank and publish adapter versions under adapters/ (0: train all weights)"})
    lora_alpha: float = dataclasses.field(default=16.0, metadata={"help": "LoRA alpha (the update is scaled by alpha / rank)"})
    lora_target_modules: str = dataclasses.field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", metadata={"help": "comma-separated module names the adapter wraps"})
    fp8: bool = dataclasses.field(default=False, metadata={"help": "also publish an FP8 serving chain under fp8/: 128x128-block e4m3 weights quantized from each bf16 version, for replicas serving FP8 (docs/fp8.md)"})
    report_to: str = dataclasses.field(default=ReportTo.AUTO.value, metadata={"help": "'trackio', 'none' or 'auto' (trackio on a Space, i.e. SPACE_ID set; none elsewhere); TRL's logs and the sync figures go there (report_to)"})
    trackio_project: str = dataclasses.field(default="rlsync", metadata={"help": "Trackio project (project)"})
    trackio_space_id: str = dataclasses.field(default="", metadata={"help": "Trackio Space to log to, e.g. 'user/trackio' (empty: on a Space, the owner's 'rl-sync-trackio', so the run outlives restarts; elsewhere the local Trackio database) (trackio_space_id)"})
    trackio_bucket_id: str = dataclasses.field(default="", metadata={"help": "Hugging Face Bucket keeping the Trackio database (empty: Trackio's default) (trackio_bucket_id)"})

    def __post_init__(self) -> None:
        check_choice(Kind.CODEC, self.codec, "TRAINER_CODEC", also=("auto",))
        check_choice(Kind.ANCHOR_POLICY, self.anchor_policy, "TRAINER_ANCHOR_POLICY")

    @classmethod
    def from_env(cls, **overrides) -> "TrainerConfig":
        return from_env(cls, "TRAINER", **overrides)

    def with_model_defaults(self, device: str) -> "TrainerConfig":
        """``lr`` and ``adam_epsilon`` left at 0 take the defaults of the model that will train: the CPU
        demo's for the tiny offline model, conservative ones for a real model (e.g. Qwen3-0.6B on a GPU);
        a LoRA run (``lora_rank``) has its own."""
        from rlsync.spaces.tiny_model import is_tiny_model  # torch: not at import (--help stays light)

        tiny = is_tiny_model(self.model, device)
        lr, eps = (TINY_MODEL_LR, TINY_MODEL_ADAM_EPSILON) if tiny else (REAL_MODEL_LR, REAL_MODEL_ADAM_EPSILON)
        if self.lora_rank:
            lr, eps = (TINY_MODEL_LORA_LR if tiny else REAL_MODEL_LORA_LR), LORA_ADAM_EPSILON
        return dataclasses.replace(self, lr=self.lr or lr, adam_epsilon=self.adam_epsilon or eps)

    def lora(self) -> LoraSpec | None:
        """The LoRA settings, or ``None`` when all weights train."""
        from rlsync.adapters import LoraSpec

        if not self.lora_rank:
            return None
        modules = tuple(m.strip() for m in self.lora_target_modules.split(",") if m.strip())
        return LoraSpec(self.lora_rank, self.lora_alpha, modules)

    def report_targets(self) -> list[str]:
        """The ``report_to`` list given to TRL."""
        target = ReportTo(self.report_to)
        if target is ReportTo.AUTO:
            target = ReportTo.TRACKIO if os.environ.get("SPACE_ID") else ReportTo.NONE
        return [] if target is ReportTo.NONE else [target.value]

    def trackio_space(self) -> str | None:
        """The Trackio Space the run logs to: ``trackio_space_id``, else on a Space the owner's ``rl-sync-trackio``
        (:func:`~rlsync.spaces.trackio_link.default_trackio_space`: a restart wipes the container's disk)."""
        from rlsync.spaces.trackio_link import default_trackio_space

        return self.trackio_space_id or default_trackio_space()

    def policy(self) -> AnchorPolicy:
        """The anchor policy these settings name (settings another policy has are ignored).

        Raises:
            ConfigurationError: an unknown policy, invalid settings, or ``anchor_settings`` not a JSON object.
        """
        from rlsync.errors import FormatError
        from rlsync.jsonlimits import loads_bounded
        from rlsync.limits import MAX_CONTROL_BYTES
        from rlsync.protocol import policy_from_settings

        try:
            extra = loads_bounded(self.anchor_settings, what="anchor_settings", max_bytes=MAX_CONTROL_BYTES) if self.anchor_settings else {}
            if not isinstance(extra, dict):
                raise FormatError("anchor_settings is not a JSON object")
            settings = {"interval": self.anchor_interval, "max_catchup_ratio": self.max_catchup_ratio, **extra}
            return policy_from_settings({**settings, "policy": self.anchor_policy})
        except FormatError as exc:
            raise ConfigurationError(str(exc)) from None

    def grpo_config(self, output_dir: str) -> Any:
        """These settings as TRL's ``AsyncGRPOConfig``."""
        from trl.experimental.async_grpo import AsyncGRPOConfig

        on_gpu = self.device.startswith("cuda")
        return AsyncGRPOConfig(
            output_dir=output_dir, learning_rate=self.lr, optim=self.optim, adam_epsilon=self.adam_epsilon,
            weight_decay=self.weight_decay,
            per_device_train_batch_size=self.batch_size, token_budget=0, gradient_accumulation_steps=1,
            weight_sync_steps=self.sync_every, max_staleness=self.max_staleness, epsilon=self.clip_eps,
            temperature=self.temperature, max_grad_norm=self.max_grad_norm,
            max_steps=self.max_steps or UNLIMITED_STEPS, bf16=on_gpu, use_cpu=not on_gpu, seed=self.seed,
            save_strategy="steps", save_steps=max(1, self.checkpoint_every or UNLIMITED_STEPS), save_total_limit=None,
            logging_steps=1, report_to=self.report_targets(), disable_tqdm=True, dataloader_num_workers=0,
            project=self.trackio_project, trackio_space_id=self.trackio_space(),
            trackio_bucket_id=self.trackio_bucket_id or None, trackio_static_space_id=False,
        )  # fmt: skip
