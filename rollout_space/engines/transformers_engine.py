"""A rollout engine on plain ``transformers``: simple, exact, and runs on CPU.

Weights are addressed by their checkpoint names (the tensor names in the model
folder's ``model.safetensors``), so a replica can hand this engine exactly what
it received from the bucket. Where transformers converts weights on load (a MoE
model's fused experts), each checkpoint tensor is a view of the fused parameter
(:class:`~rlsync.checkpoint_layout.CheckpointLayout`), written in place. Tied parameters (e.g. ``lm_head.weight`` tied to
``model.embed_tokens.weight``) are written once, through the name that the
checkpoint stores.

Sampling is done here (:mod:`rollout_space.engines.sampling`), token by token with a KV cache, so the reported
log-probabilities are those of the distribution actually sampled from:
``log_softmax(logits.float() / temperature)``, renormalised over the top-p
nucleus when ``top_p < 1``. ``temperature <= GREEDY_TEMPERATURE`` means greedy
decoding; its log-probabilities are then those of the unscaled logits.

LoRA runs: each adapter version is a peft adapter of its own (``v<version>``) on the same
model, in the serving dtype (``autocast_adapter_dtype=False``, so the served bits are the
published ones); ``generate`` activates the version ``SamplingSettings.adapter`` names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from rlsync.adapters import AdapterChain
from rlsync.checkpoint_layout import CheckpointLayout
from rlsync.hashing import state_hash
from rlsync.lora import peft_config
from rlsync.patch import TensorPatch
from rlsync.registry import Kind, register

from rollout_space.engine import Completion, Engine, SamplingSettings
from rollout_space.engines.sampling import generate_completions

logger = logging.getLogger(__name__)


class TransformersEngine(Engine):
    """Serve a causal LM with ``transformers``.

    Args:
        model_path: A local model folder (config, tokenizer, safetensors weights).
        device: Torch device for the model.
        dtype: Serving dtype of the weights.

    Raises:
        ValueError: The checkpoint's tensor names cannot be matched to the model's
            parameters and buffers (weight renaming on load is not supported).
    """

    name = "transformers"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self._targets, self._aliases = _map_checkpoint_names(self.model, _checkpoint_names(self.model_path))
        self._peft: Any = None  # the peft wrapper, once an adapter is loaded
        self._eos_ids = _eos_ids(self.model, self.tokenizer)
        self._pad_id = self.tokenizer.pad_token_id
        if self._pad_id is None:
            self._pad_id = next(iter(self._eos_ids))
        logger.info("transformers engine: %s on %s (%s)", self.model_path, self.device, dtype)

    # -- weights -------------------------------------------------------------------

    def checkpoint_names(self) -> list[str]:
        """Names of the tensors the engine's weights are addressed by, sorted."""
        return sorted(self._targets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return the current weights under their checkpoint names.

        Returns:
            Detached tensors in the serving dtype, on CPU. On a CPU engine they share
            memory with the model, so clone them before mutating or keeping them
            across updates.
        """
        return {name: t.detach().cpu() for name, t in sorted(self._targets.items())}

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's own tensors under their checkpoint names and tied aliases (see :meth:`Engine.weights`).

        Writing into them changes what :meth:`generate` computes with; no copy is kept anywhere.
        """
        own = {name: t.detach() for name, t in self._targets.items()}
        return own | {alias: own[source] for alias, source in self._aliases.items()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy a full state (checkpoint names, serving dtype) into the model bit-exactly.

        Args:
            state: One tensor per checkpoint name. Names of tied aliases (e.g.
                ``lm_head.weight`` when tied) may be included if they hold the same
                bits as the tensor they alias.

        Raises:
            KeyError: A checkpoint tensor is missing, or an unknown name is given.
            ValueError: A shape, dtype or tied-alias mismatch. Nothing is written then.
        """
        missing = set(self._targets) - set(state)
        if missing:
            raise KeyError(f"state lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        for name in set(state) - set(self._targets):
            source = self._aliases.get(name)
            if source is None:
                raise KeyError(f"unknown tensor name {name!r}")
            if not _same_bits(state[name], state[source]):
                raise ValueError(f"{name!r} is tied to {source!r} but holds different values")
        for name, target in self._targets.items():
            _check_compatible(name, target, state[name].dtype, tuple(state[name].shape))
        with torch.no_grad():
            for name, target in self._targets.items():
                target.copy_(state[name])

    def apply_patches(
        self, patches: Mapping[str, TensorPatch], state: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Write the patched elements into the model's tensors in place.

        Args:
            patches: Changed elements per checkpoint name (tied aliases resolve to
                the tensor they alias).
            state: Unused; this engine patches in place.

        Raises:
            KeyError: A patch names an unknown tensor.
            ValueError: A patch's shape or dtype does not match. Nothing is written then.
        """
        resolved: list[tuple[torch.Tensor, TensorPatch]] = []
        for name, patch in patches.items():
            key = self._aliases.get(name, name)
            if key not in self._targets:
                raise KeyError(f"unknown tensor name {name!r}")
            target = self._targets[key]
            _check_compatible(name, target, patch.values.dtype, tuple(patch.shape))
            resolved.append((target, patch))
        with torch.no_grad():
            for target, patch in resolved:
                patch.apply_(target)

    # -- adapters ------------------------------------------------------------------

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor], chain: AdapterChain) -> str:
        """Add adapter version ``version`` as the peft adapter ``v<version>`` (see :meth:`Engine.load_adapter`).

        Raises:
            ValueError: the tensors are not exactly the adapter's (unknown or missing names); nothing stays loaded.
            RuntimeError: a tensor's shape is not the settings' (peft's size mismatch); nothing stays loaded.
        """
        from peft import get_peft_model, set_peft_model_state_dict

        name = _adapter_name(version)
        config = peft_config(chain.lora, lora_dropout=0.0, inference_mode=True)
        if self._peft is None:
            self._peft = get_peft_model(self.model, config, adapter_name=name, autocast_adapter_dtype=False)
        else:
            self._peft.add_adapter(name, config, autocast_adapter_dtype=False)
        try:
            result = set_peft_model_state_dict(self._peft, dict(tensors), adapter_name=name)
            served = self.adapter_state(version)
            if result.unexpected_keys or served.keys() != tensors.keys():
                raise ValueError(f"adapter {version}: tensor names do not match the LoRA settings (e.g. {result.unexpected_keys[:2]})")
        except BaseException:
            self.drop_adapter(version)  # nothing stays loaded: a size mismatch raises RuntimeError here
            raise
        return state_hash(served)

    def adapter_state(self, version: int) -> dict[str, torch.Tensor]:
        """The served tensors of adapter version ``version`` under peft's saved names."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self._peft, adapter_name=_adapter_name(version))

    def drop_adapter(self, version: int) -> None:
        """Delete the peft adapter of ``version`` (see :meth:`Engine.drop_adapter`)."""
        name = _adapter_name(version)
        if self._peft is not None and name in self._peft.peft_config:
            self._peft.delete_adapter(name)

    @contextlib.contextmanager
    def _adapter(self, version: int | None) -> Iterator[None]:
        """Serve adapter ``version`` (``None``: the base model) within the block."""
        if self._peft is None:
            if version is not None:
                raise KeyError(f"adapter {version} is not loaded")
            yield
        elif version is None:
            with self._peft.disable_adapter():
                yield
        else:
            if _adapter_name(version) not in self._peft.peft_config:
                raise KeyError(f"adapter {version} is not loaded")
            self._peft.set_adapter(_adapter_name(version), inference_mode=True)
            yield

    # -- sampling ------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions per prompt.

        Completions stop after an EOS token (which is kept in ``token_ids`` and
        ``logprobs`` but not in ``text``) or after ``sampling.max_new_tokens``.
        With a ``sampling.seed`` the result is reproducible for the same weights,
        prompts and settings.

        Args:
            prompts: Plain-text prompts; the tokenizer adds its special tokens.
            sampling: Sampling settings.

        Returns:
            For each prompt, ``sampling.n`` completions.

        Raises:
            ValueError: ``n`` or ``max_new_tokens`` is below 1, or ``top_p`` is not in ``(0, 1]``.
            KeyError: ``sampling.adapter`` names an adapter version that is not loaded.
        """
        with self._adapter(sampling.adapter):
            return generate_completions(
                self.model, self.tokenizer, prompts, sampling, eos_ids=self._eos_ids, pad_id=self._pad_id, device=self.device
            )

    def close(self) -> None:
        """Drop the model and tokenizer."""
        self.model = None
        self.tokenizer = None
        self._peft = None
        self._targets = {}


def _adapter_name(version: int) -> str:
    return f"v{version}"


def _checkpoint_names(model_path: Path) -> list[str] | None:
    """Tensor names stored in the folder's safetensors checkpoint, or ``None`` if there is none."""
    from safetensors import safe_open

    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    single = model_path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return sorted(f.keys())
    return None


def _map_checkpoint_names(
    model: torch.nn.Module, names: list[str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map checkpoint names to the model's tensors, and tied aliases to their checkpoint name.

    Raises:
        ValueError: A checkpoint name has no model tensor, or a model tensor is
            neither in the checkpoint nor tied to one that is.
    """
    own = model.state_dict(keep_vars=True)
    if names is not None and not own.keys() >= set(names):  # converted on load (fused MoE experts): views of them
        own = CheckpointLayout.of_model(model).checkpoint_state(own)
    if names is None:  # no safetensors file: keep the first name of each storage
        seen: set[int] = set()
        names = []
        for name, t in own.items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                names.append(name)
    unknown = [n for n in names if n not in own]
    if unknown:
        raise ValueError(f"checkpoint tensors without a same-named model tensor (renamed on load?): {unknown[:3]}")
    targets = {n: own[n] for n in names}
    by_ptr = {t.data_ptr(): n for n, t in targets.items()}
    aliases: dict[str, str] = {}
    for name, t in own.items():
        if name in targets:
            continue
        source = by_ptr.get(t.data_ptr())
        if source is None or targets[source].shape != t.shape:
            raise ValueError(f"model tensor {name!r} is not in the checkpoint and not tied to a tensor that is")
        aliases[name] = source
    return targets, aliases


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no EOS token id")
    return ids


def _check_compatible(name: str, target: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if dtype != target.dtype:
        raise ValueError(f"{name!r}: dtype {dtype} does not match the model's {target.dtype}")
    if shape != tuple(target.shape):
        raise ValueError(f"{name!r}: shape {shape} does not match the model's {tuple(target.shape)}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


register(Kind.ENGINE, "transformers", "rollout_space.engines.transformers_engine:TransformersEngine",
         capabilities=("device",), summary="transformers generate() on any torch device; adapters through PEFT")
