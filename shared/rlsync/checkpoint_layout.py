"""Checkpoint names of a transformers model whose weights are converted on load (fused MoE experts).

transformers 5 loads MoE checkpoints into fused parameters: a Qwen3-MoE layer's experts are
``mlp.experts.gate_up_proj`` (experts x 2 * intermediate x hidden) and ``mlp.experts.down_proj``,
while its checkpoint (what ``save_pretrained`` writes, what vLLM loads) holds one
``mlp.experts.<e>.gate_proj.weight``, ``up_proj`` and ``down_proj`` per expert. The sync
library publishes checkpoint names, so that a chain's whole-state hash is the checkpoint's, read
back the same way from any engine; and a per-expert tensor that did not change is simply absent
from a delta.

:class:`CheckpointLayout` records where each checkpoint tensor lies inside the model's own
tensors. It is found, not assumed: each model tensor's element positions (``arange``) go
through transformers' own reverse conversion (``revert_weight_conversion``, what
``save_pretrained`` runs), and every checkpoint tensor that comes out must be one contiguous
run of positions, so it is a view of the model tensor (no copy): the trainer streams views,
and an engine writes into them in place.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterable, Iterator, Mapping

import torch


#: A checkpoint tensor of one expert; groups: the experts' prefix, the expert, the projection.
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def expert_of(name: str) -> str | None:
    """``"<layer>.<expert>"`` for a checkpoint tensor of one expert (``model.layers.3.mlp.experts.5.up_proj.weight``
    -> ``"3.5"``), else ``None``."""
    match = EXPERT_TENSOR.match(name)
    layer = _LAYER.search(name) if match else None
    return f"{layer[1]}.{match['expert']}" if match and layer else None


def expert_changed_pct(changed: Mapping[str, int], state: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Percentage of each expert's elements that changed (``"<layer>.<expert>"`` -> %), from changed elements per
    tensor (:attr:`~rlsync.protocol.PublishRecord.changed_tensors`) and the state's tensors (for their sizes)."""
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    for name, tensor in state.items():
        expert = expert_of(name)
        if expert is not None:
            sizes[expert] = sizes.get(expert, 0) + tensor.numel()
            counts[expert] = counts.get(expert, 0) + changed.get(name, 0)
    return {e: 100 * counts[e] / sizes[e] for e in sorted(sizes, key=lambda e: tuple(map(int, e.split("."))))}


@dataclasses.dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside a model tensor.

    Attributes:
        name: The checkpoint name.
        start: Its first element in the model tensor (flat, row-major).
        shape: Its shape in the checkpoint.
    """

    name: str
    start: int
    shape: tuple[int, ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of a contiguous model tensor, as a view."""
        size = 1
        for d in self.shape:
            size *= d
        return tensor.reshape(-1)[self.start : self.start + size].view(self.shape)


class CheckpointLayout:
    """Model tensor name -> the checkpoint tensors it holds.

    Args:
        parts: For each converted model tensor, its checkpoint parts in order. Tensors not
            listed are stored under their own name.
    """

    def __init__(self, parts: Mapping[str, tuple[Part, ...]]) -> None:
        self.parts = dict(parts)

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "CheckpointLayout":
        """Find the layout of a transformers model (it may live on the ``meta`` device).

        Raises:
            ValueError: a checkpoint tensor is not one contiguous run of its model tensor.
        """
        from transformers.core_model_loading import revert_weight_conversion

        parts: dict[str, tuple[Part, ...]] = {}
        state = model.state_dict()
        kept = revert_weight_conversion(model, {n: torch.empty(t.shape, device="meta") for n, t in state.items()})
        for name in [n for n in state if n not in kept]:  # the converted ones (none for most dense models)
            tensor = state[name]
            dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
            probe = torch.arange(tensor.numel(), dtype=dtype).view(tensor.shape)
            found = []
            for part_name, positions in revert_weight_conversion(model, {name: probe}).items():
                flat = positions.reshape(-1)
                start = int(flat[0]) if flat.numel() else 0
                if not torch.equal(flat, torch.arange(start, start + flat.numel(), dtype=dtype)):
                    raise ValueError(f"checkpoint tensor {part_name!r} is not a contiguous slice of {name!r}")
                found.append(Part(part_name, start, tuple(positions.shape)))
            parts[name] = tuple(sorted(found, key=lambda p: p.start))
        return cls(parts)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "CheckpointLayout":
        """The layout of the model in a folder, built on the ``meta`` device (no weights loaded)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.of_model(model)

    def split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A model tensor as its checkpoint tensors (views of it when contiguous)."""
        parts = self.parts.get(name)
        if parts is None:
            return [(name, tensor)]
        tensor = tensor.contiguous()
        return [(p.name, p.view(tensor)) for p in parts]

    def stream(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(model name, tensor)`` pairs as ``(checkpoint name, tensor)`` pairs."""
        for name, tensor in tensors:
            yield from self.split(name, tensor)

    def checkpoint_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A model state dict in checkpoint names (views)."""
        return dict(self.stream(state.items()))
