"""The rollout engine interface: what a replica needs from an inference engine.

Engines only ever receive updates that already verified. An engine that exposes its own
serving tensors (:meth:`Engine.weights`) has them written in place by the replica's
:class:`~rlsync.protocol.Subscriber`; the others receive each verified update from the
subscriber's own copy, unless they follow the bucket themselves (:class:`BucketFollowingEngine`:
their own subscriber, where the weights live, verifies each update; the replica only says when).
Engines live in ``rollout_space/engines/``, one file per engine, each registered in :mod:`rlsync.registry`
(``Kind.ENGINE``) with what it can do (:class:`EngineCapability`) and the modules it needs (``requires=``); the
replica, its settings' help and the panel's dropdown follow the registry.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib.util
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
from rlsync.adapters import AdapterChain
from rlsync.errors import ConfigurationError
from rlsync.patch import TensorPatch
from rlsync.registry import Entry, Kind, entries, get
from rlsync.vllm.status import TransferStatus


class EngineCapability(str, enum.Enum):
    """What an engine declares it can do where it registers (``capabilities=``)."""

    #: Created with ``device=`` (a torch device): it runs anywhere torch does; ``auto`` picks it off an accelerator.
    DEVICE = "device"
    #: ``auto`` picks it on an accelerator, when the modules it requires are installed.
    ACCELERATOR = "accelerator"
    #: Serves the FP8 chain (``ROLLOUT_CHAIN=fp8``) from a block-FP8 checkpoint.
    FP8 = "fp8"
    #: Serves LoRA adapters in slots sized at start (``max_loras=``, ``max_lora_rank=``).
    LORA_SLOTS = "lora_slots"


@dataclasses.dataclass
class Completion:
    """One sampled completion.

    Attributes:
        text: The decoded completion (without the prompt).
        token_ids: Generated token ids.
        logprobs: Log-probability of each generated token under the sampling policy.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]


@dataclasses.dataclass
class SamplingSettings:
    """How to sample: G completions per prompt (``adapter``: the adapter version to serve, in a LoRA run)."""

    n: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    adapter: int | None = None


class Engine(abc.ABC):
    """An inference engine whose weights a replica keeps in sync with the bucket."""

    #: Registry name, e.g. ``"transformers"`` or ``"vllm"``.
    name: str

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The engine's own serving tensors by checkpoint name, for a subscriber to write in place.

        Tied names map to the same storage. A replica then keeps no copy of the model: its
        :class:`~rlsync.protocol.Subscriber` copies anchors into these tensors and scatters deltas
        into them, and :meth:`load_state` and :meth:`apply_patches` are not called.

        Returns:
            Contiguous tensors that are the weights generation reads, or ``None`` when the engine
            cannot expose them (it then receives every verified update through :meth:`load_state`
            and :meth:`apply_patches`, from the subscriber's own copy).
        """
        return None

    @abc.abstractmethod
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all weights with ``state`` (Hugging Face names, serving dtype)."""

    @abc.abstractmethod
    def apply_patches(
        self, patches: Mapping[str, TensorPatch], state: Mapping[str, torch.Tensor]
    ) -> None:
        """Apply a verified sparse update.

        Args:
            patches: Changed elements per tensor, in checkpoint coordinates.
            state: The full verified state after the update, for engines that
                must reload whole tensors instead of patching in place.
        """

    @abc.abstractmethod
    def generate(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions for each prompt."""

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor], chain: AdapterChain) -> str:
        """Serve a verified adapter as version ``version`` (a new adapter id per version), next to the others.

        Args:
            version: The adapter chain's version; ``SamplingSettings.adapter`` names it.
            tensors: The whole adapter (peft names, serving dtype); copied, not kept.
            chain: The chain's LoRA settings and base.

        Returns:
            The :func:`rlsync.hashing.state_hash` of the adapter as the engine will serve it
            (the caller drops the version unless it equals the verified hash).

        Raises:
            NotImplementedError: this engine serves no adapters.
        """
        raise NotImplementedError(f"the {self.name} engine serves no LoRA adapters")

    def drop_adapter(self, version: int) -> None:
        """Stop serving adapter version ``version`` and free it (unknown versions are ignored: an engine
        that serves no adapters has none to drop)."""

    def close(self) -> None:
        """Release the engine's resources."""


@runtime_checkable
class BucketFollowingEngine(Protocol):
    """An engine that follows the bucket itself, where its weights live (vLLM's ``bucket`` weight-transfer
    backend: :mod:`rlsync.vllm.transfer`), driven by a :class:`~rollout_space.bucket_follower.BucketFollower`.

    Each call returns the engine's transfer status (:class:`rlsync.vllm.status.TransferStatus`: ``step``,
    ``state_hash``, ``preparing``, ``prepared``, ``error``, ``rehashing``, ``rehash``...).
    """

    #: Whether it was started able to follow the bucket (else the replica feeds it from a subscriber).
    follows_bucket: bool

    def follow_bucket(self, url: str, chain: str) -> TransferStatus:
        """Follow ``chain`` of the bucket at ``url`` from its newest anchor (again: the served weights are
        replaced by the next anchor)."""

    def prepare_update(self) -> TransferStatus:
        """Start downloading, decoding and verifying the next update in the background, while generating."""

    def transfer_status(self) -> TransferStatus:
        """Where the engine stands."""

    def apply_prepared(self, step: int) -> None:
        """Write the prepared update toward ``step`` (a pause of generation; nothing downloaded or decoded), then
        drop the KV computed with the old weights."""

    def verify_served(self) -> TransferStatus:
        """Start re-hashing the served weights against the verified state hash in the background."""


def installed(entry: Entry) -> bool:
    """Whether the modules engine ``entry`` requires (its ``requires=`` detail) are installed."""
    return all(importlib.util.find_spec(name) is not None for name in entry.details.get("requires", ()))


def choose_engine(name: str, device: str, fp8: bool) -> Entry:
    """The engine ``ROLLOUT_ENGINE=name`` selects: ``auto`` is the engine of the FP8 chain for ``fp8``, else an
    installed accelerator engine on ``cuda``, else the first that takes a device.

    Raises:
        UnknownNameError: no engine has that name.
        ConfigurationError: ``fp8`` with an engine that does not serve the FP8 chain.
    """
    if name != "auto":
        entry = get(Kind.ENGINE, name)
    else:
        wanted = EngineCapability.FP8 if fp8 else EngineCapability.ACCELERATOR if device.startswith("cuda") else None
        found = [e for e in entries(Kind.ENGINE) if wanted is not None and e.has(wanted) and (fp8 or installed(e))]
        entry = found[0] if found else next(e for e in entries(Kind.ENGINE) if e.has(EngineCapability.DEVICE))
    if fp8 and not entry.has(EngineCapability.FP8):
        served = [e.name for e in entries(Kind.ENGINE) if e.has(EngineCapability.FP8)]
        raise ConfigurationError(
            f"ROLLOUT_CHAIN=fp8 is served by ROLLOUT_ENGINE={' or '.join(served)}, not {entry.name!r}"
        )
    return entry


def create_engine(name: str, **kwargs) -> Engine:
    """Create the engine registered as ``name``.

    Raises:
        UnknownNameError: no engine has that name (a ``ValueError``).
        ValueError: its modules are not installed.
    """
    entry = get(Kind.ENGINE, name)
    try:
        factory = entry.load()
    except ImportError as exc:
        raise ConfigurationError(f"the {name!r} engine is unavailable: {exc}") from exc
    return factory(**kwargs)
