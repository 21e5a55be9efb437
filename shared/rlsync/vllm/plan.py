"""Planning an update in the driver and in the worker: where each checkpoint tensor lives, and which
changes patch in place and which reload their whole module (:func:`plan_update`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from rlsync.patch import TensorPatch


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Where each checkpoint tensor lives in the vLLM model.

    Attributes:
        module_of: Checkpoint name -> path of the vLLM module that loads it.
        in_place: Module paths whose weights can be patched element-wise in place
            (no prepacked kernel copy).
        ignored_prefixes: Checkpoint-name prefixes vLLM skips on load (``lm_head.``
            when the embeddings are tied).
    """

    module_of: dict[str, str]
    in_place: frozenset[str]
    ignored_prefixes: tuple[str, ...] = ()

    def ignores(self, name: str) -> bool:
        """Whether vLLM skips this checkpoint name on load (e.g. a tied ``lm_head.weight``)."""
        return name.startswith(self.ignored_prefixes) if self.ignored_prefixes else False

    def to_json(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly form."""
        return {
            "module_of": self.module_of,
            "in_place": sorted(self.in_place),
            "ignored_prefixes": list(self.ignored_prefixes),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "WeightLayout":
        """Inverse of :meth:`to_json`."""
        return cls(dict(obj["module_of"]), frozenset(obj["in_place"]), tuple(obj.get("ignored_prefixes", ())))


def plan_update(
    layout: WeightLayout, patches: Mapping[str, TensorPatch], state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, TensorPatch], dict[str, torch.Tensor]]:
    """Split a verified delta into in-place patches and whole-tensor reloads.

    Args:
        layout: The model's layout (see :meth:`~rlsync.vllm.model_weights.ModelWeights.layout`).
        patches: The delta, in checkpoint names and coordinates.
        state: The full verified state after the delta.

    Returns:
        ``(sparse, full)``: patches for in-place modules, and for every touched
        prepacked module the full state tensors of *all* checkpoint names it loads
        (a packed ``qkv_proj`` needs ``q``, ``k`` and ``v`` together).

    Non-float tensors go to the reload path too (vLLM's sparse loader marks
    unchanged elements with NaN, which only float tensors have).

    Raises:
        KeyError: A patch names a tensor the model does not load (and does not
            deliberately skip, like a tied ``lm_head.weight``).
    """
    sparse: dict[str, TensorPatch] = {}
    reload_modules: set[str] = set()
    for name, patch in patches.items():
        if patch.numel == 0 or layout.ignores(name):
            continue
        try:
            module = layout.module_of[name]
        except KeyError:
            raise KeyError(f"the vLLM model does not load a tensor named {name!r}") from None
        if module in layout.in_place and patch.values.dtype.is_floating_point:
            sparse[name] = patch
        else:
            reload_modules.add(module)
    full = {name: state[name] for name, module in layout.module_of.items() if module in reload_modules}
    return sparse, full

