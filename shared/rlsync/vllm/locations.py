"""Where each checkpoint tensor lives in a vLLM model: its module, parameter and packed shard, the fused MoE
experts, the modules sharing a parameter, and which served tensors are plain views of checkpoint tensors."""

from __future__ import annotations

from typing import Iterable

import torch

from .experts import expert_location
from .plan import WeightLayout
from .served import checkpoint_view, is_prepacked, is_tied, parameter_aliases, patchable_in_place


class CheckpointLocations:
    """Checkpoint names located in a vLLM model.

    Args:
        model: The worker's model.
        names: The checkpoint's tensor names.

    Attributes:
        experts: Checkpoint name -> its place in a fused MoE layer (:func:`~rlsync.vllm.experts.expert_location`).
        of: Checkpoint name -> ``(module path, parameter name, shard index)``, for every name vLLM loads.
        aliases: Modules holding a parameter that another module also holds (tied weights).

    Raises:
        ValueError: A checkpoint name cannot be located in the model.
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[str]) -> None:
        self.model = model
        names = list(names)
        self.experts = {n: loc for n in names if (loc := expert_location(model, n))}
        self.of = {name: loc for name in names if (loc := self._locate(name)) is not None}
        self.aliases = parameter_aliases(model)

    def _locate(self, name: str) -> tuple[str, str, int | None] | None:
        """``(module path, parameter name, shard index)`` for a checkpoint name, or ``None`` if vLLM skips it."""
        if name in self.experts:
            return self.experts[name][0], self.experts[name][1], None
        mapped = name
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapped = mapper.get_rename_mapper().map_name(name)
            if mapped is None:
                return None
        if is_tied(self.model) and mapped.startswith("lm_head."):
            return None  # vLLM skips it: lm_head shares embed_tokens' weight
        module_path, _, param = mapped.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        shard = None
        for packed, parts in getattr(self.model, "packed_modules_mapping", {}).items():
            if leaf in parts:
                module_path, shard = f"{parent}.{packed}" if parent else packed, parts.index(leaf)
                break
        try:
            module = self.model.get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"cannot locate checkpoint tensor {name!r} in the vLLM model ({module_path!r})") from None
        if not hasattr(module, param):
            raise ValueError(f"vLLM module {module_path!r} has no parameter {param!r} for {name!r}")
        return module_path, param, shard

    @property
    def names(self) -> list[str]:
        """Checkpoint names the model loads, sorted."""
        return sorted(self.of)

    def layout(self) -> WeightLayout:
        """Where each checkpoint tensor lives, and which modules can be patched in place."""
        module_of = {name: loc[0] for name, loc in self.of.items()}
        in_place = {m for m in module_of.values() if patchable_in_place(self.model.get_submodule(m))}
        return WeightLayout(module_of, frozenset(in_place), ("lm_head.",) if is_tied(self.model) else ())

    def views(self) -> dict[str, torch.Tensor]:
        """The model's own tensors as checkpoint tensors, where a plain view is one: what the ``bucket``
        backend's subscriber writes in place, so no copy of them is kept (see :mod:`rlsync.vllm.transfer`).

        A module's names are all viewed or none. Not viewed: prepacked CPU modules and modules sharing
        a parameter with one (the kernel keeps its own copy), quantized modules, fused MoE experts,
        LoRA-wrapped modules, non-float parameters, and every module at tensor parallelism above 1 (a
        rank holds a shard of each tensor).

        Returns:
            Checkpoint name -> a contiguous view of the served parameter (as
            :meth:`~rlsync.vllm.model_weights.ModelWeights.read` reads it).
        """
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            return {}
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in self.aliases:
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(module)
        tied_to_kernel = {id(m) for mods in owners.values() if any(map(is_prepacked, mods)) for m in mods}
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        refused: set[str] = set()
        for name, (path, param, shard) in self.of.items():
            if path in refused:
                continue
            module = self.model.get_submodule(path)
            viewable = name not in self.experts and id(module) not in tied_to_kernel
            view = checkpoint_view(module, param, shard) if viewable else None
            if view is None:
                refused.add(path)
                by_module.pop(path, None)
                continue
            by_module.setdefault(path, {})[name] = view
        return {name: view for views in by_module.values() for name, view in views.items()}
