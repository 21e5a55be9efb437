"""peft glue for LoRA runs: peft's ``LoraConfig`` of a :class:`~rlsync.adapters.LoraSpec`, and the
adapter and base tensors of a peft model (needs ``peft``: the ``lora`` or ``trl`` extra)."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from .adapters import LoraSpec


def peft_config(spec: LoraSpec, **kwargs: Any) -> Any:
    """``spec`` as a peft ``LoraConfig`` (``kwargs`` are passed on, e.g. ``lora_dropout``)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), **kwargs)


def adapter_tensors(model: Any, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter ``adapter_name`` of a peft model under peft's saved names, gathered to whole CPU tensors.

    Every rank of a sharded model must call it (gathering a sharded tensor is a collective).
    """
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    gathered = {}
    for name, tensor in state.items():
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor
            tensor = tensor.full_tensor()
        gathered[name] = tensor.detach().cpu()
    return gathered


def base_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's parameters of a peft model under the base checkpoint's names (adapter tensors left out)."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        yield name.removeprefix("module.").removeprefix("base_model.model.").replace(".base_layer", ""), param
