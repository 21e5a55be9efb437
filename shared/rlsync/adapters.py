"""LoRA adapter chains: a run that trains an adapter publishes adapter versions, not weights.

The adapter chain lives in the same bucket as the weights chain, under :data:`ADAPTER_PREFIX`,
and is written and read by the unchanged :class:`~rlsync.protocol.Publisher` and
:class:`~rlsync.protocol.Subscriber` through a :class:`~rlsync.bucket.PrefixedBucket`; so it has
the same anchors and sparse bf16 deltas, crash safety, pointer-last order, run lock, retention and
whole-state hash (of the whole adapter state dict)::

    latest.json, anchors/, deltas/        the weights chain: the base model (one anchor)
    adapters/latest.json                  the adapter chain's pointer, naming its base
    adapters/anchors/…, adapters/deltas/… adapter versions (peft tensor names)
    adapters/lock.json                    its run lock

The adapter chain's pointer metadata (:class:`AdapterChain`) names the base model, its state hash
and the LoRA settings. A replica subscribes with the hash of the base it serves, and a chain for
another base is refused before anything is downloaded.

Tensor names are those of peft's ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight``), which peft and vLLM load as they are. This module
needs no peft; :mod:`rlsync.lora` holds what does.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from .bucket import Bucket, PrefixedBucket
from .errors import FormatError
from .jsonlimits import loads_bounded
from .layout import ADAPTER_PREFIX
from .limits import MAX_METADATA_BYTES
from .protocol import Manifest, Publisher, Subscriber

#: Name of an adapter's tensor file and config in a peft / vLLM adapter folder.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
MAX_LORA_RANK = 1024
MAX_TARGET_MODULES = 64


class AdapterMetadata(str, enum.Enum):
    """Keys of an adapter chain's pointer metadata."""

    BASE_MODEL = "base_model"
    BASE_HASH = "base_hash"
    LORA = "lora"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings an adapter is built with.

    Args:
        rank: LoRA rank ``r``.
        alpha: ``lora_alpha`` (the update is scaled by ``alpha / rank``).
        target_modules: Module names the adapter wraps (e.g. ``("q_proj", "v_proj")``; kept sorted).

    Raises:
        ValueError: a rank outside ``[1, MAX_LORA_RANK]``, a non-positive alpha, or no or too many
            target modules.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if type(self.rank) is not int or not 1 <= self.rank <= MAX_LORA_RANK:
            raise ValueError(f"LoRA rank must be an integer in [1, {MAX_LORA_RANK}], got {self.rank!r}")
        if type(self.alpha) not in (int, float) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        modules = self.target_modules
        if not modules or len(modules) > MAX_TARGET_MODULES or not all(isinstance(m, str) and 0 < len(m) <= 128 for m in modules):
            raise ValueError(f"LoRA target modules must be 1 to {MAX_TARGET_MODULES} module names, got {modules!r}")
        object.__setattr__(self, "target_modules", tuple(sorted(set(modules))))

    @classmethod
    def from_peft(cls, config: Any) -> "LoraSpec":
        """The settings of a peft ``LoraConfig``."""
        return cls(int(config.r), float(config.lora_alpha), tuple(config.target_modules))

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)})

    @classmethod
    def from_json(cls, text: str) -> "LoraSpec":
        """Parse :meth:`to_json`.

        Raises:
            FormatError: not such a JSON object, or invalid settings.
        """
        doc = loads_bounded(text, what="LoRA settings", max_bytes=MAX_METADATA_BYTES)
        try:
            return cls(doc["rank"], doc["alpha"], tuple(doc["target_modules"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"invalid LoRA settings in the adapter chain: {exc}") from None


@dataclasses.dataclass(frozen=True)
class AdapterChain:
    """What an adapter chain's versions apply to: stored in its pointer from the first publish on.

    Args:
        base_model: Name of the base model (a Hub id or folder name; informative).
        base_hash: :func:`rlsync.hashing.state_hash` of the base weights in the serving dtype
            (the weights chain's state hash when the base is published there).
        lora: The LoRA settings.
    """

    base_model: str
    base_hash: str
    lora: LoraSpec

    def metadata(self) -> dict[str, str]:
        """The pointer metadata of this chain."""
        return {
            AdapterMetadata.BASE_MODEL.value: self.base_model,
            AdapterMetadata.BASE_HASH.value: self.base_hash,
            AdapterMetadata.LORA.value: self.lora.to_json(),
        }

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "AdapterChain":
        """The chain an adapter pointer describes.

        Raises:
            FormatError: the pointer lacks the adapter metadata or holds invalid LoRA settings.
        """
        meta = manifest.metadata
        try:
            return cls(
                meta[AdapterMetadata.BASE_MODEL.value], meta[AdapterMetadata.BASE_HASH.value],
                LoraSpec.from_json(meta[AdapterMetadata.LORA.value]),
            )  # fmt: skip
        except KeyError as exc:
            raise FormatError(f"the pointer is not an adapter chain's: no {exc} metadata") from None

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check that an adapter's (verified) tensors are this chain's: its pointer's LoRA settings are
        writable, the tensors are hashed. Every tensor is a ``lora_A`` or ``lora_B`` weight of a target
        module, of rank :attr:`LoraSpec.rank`, and every target module has one.

        Raises:
            FormatError: a tensor of another module, kind or rank, or a target module without tensors.
        """
        found: set[str] = set()
        for name, tensor in tensors.items():
            path, _, kind = name.rpartition(".lora_")
            target = next((t for t in self.lora.target_modules if path == t or path.endswith("." + t)), None)
            rank_dim = {"A.weight": 0, "B.weight": 1}.get(kind)
            if target is None or rank_dim is None or tensor.dim() != 2:
                raise FormatError(f"adapter tensor {name!r} is not a LoRA weight of the chain's target modules")
            if tensor.shape[rank_dim] != self.lora.rank:
                raise FormatError(f"adapter tensor {name!r} has rank {tensor.shape[rank_dim]}, the chain's settings say {self.lora.rank}")
            found.add(target)
        missing = set(self.lora.target_modules) - found
        if missing:
            raise FormatError(f"the chain's settings name target modules the adapter has no tensors for: {sorted(missing)}")

    def adapter_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` for an adapter folder of this chain."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model,
            "r": self.lora.rank, "lora_alpha": self.lora.alpha, "target_modules": list(self.lora.target_modules),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True,
        }  # fmt: skip


def adapter_bucket(bucket: Bucket) -> PrefixedBucket:
    """The view of ``bucket`` the adapter chain is published in and read from."""
    return PrefixedBucket(bucket, ADAPTER_PREFIX)


def adapter_publisher(bucket: Bucket, chain: AdapterChain, **kwargs: Any) -> Publisher:
    """A :class:`~rlsync.protocol.Publisher` of the adapter chain of ``bucket``.

    Args:
        bucket: The run's bucket (the chain goes under :data:`ADAPTER_PREFIX`).
        chain: The base and LoRA settings, written into the chain's pointer.
        **kwargs: Further :class:`~rlsync.protocol.Publisher` arguments (policy, codec, owner...).
    """
    return Publisher(adapter_bucket(bucket), metadata=chain.metadata(), **kwargs)


def adapter_subscriber(bucket: Bucket, base_hash: str, **kwargs: Any) -> Subscriber:
    """A :class:`~rlsync.protocol.Subscriber` of the adapter chain of ``bucket`` for the base ``base_hash``.

    A chain published for another base is refused (counted, nothing downloaded). Set the
    subscriber's ``expect_metadata`` again if the served base changes.
    """
    return Subscriber(adapter_bucket(bucket), expect_metadata={AdapterMetadata.BASE_HASH.value: base_hash}, **kwargs)


def write_adapter_folder(folder: str | Path, tensors: Mapping[str, torch.Tensor], chain: AdapterChain) -> Path:
    """Write an adapter as the peft folder vLLM's ``LoRARequest`` and peft load.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / ADAPTER_WEIGHTS_FILE)
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(chain.adapter_config(), indent=1))
    return path
