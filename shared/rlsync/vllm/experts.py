"""A vLLM model's fused MoE experts, in checkpoint names.

vLLM keeps a MoE layer's experts as two fused parameters of its ``RoutedExperts`` module
(``<layer>.mlp.experts.routed_experts``): ``w13_weight`` (experts x 2 * intermediate x hidden, each
expert's ``gate_proj`` rows then its ``up_proj`` rows) and ``w2_weight`` (experts x hidden x
intermediate, ``down_proj``). A checkpoint holds ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight``
per expert; vLLM's own loader maps them in (``load_weights``), and this module maps them back out
for reading (:func:`expert_location`, :func:`read_expert`).

On vLLM's CPU backend the fused experts are prepacked for its grouped-GEMM kernels
(``cpu_prepack_moe_weight``): the parameter holds the same elements in another order. That order is
found, not assumed (:mod:`.packing`), so reading back inverts exactly what the served kernel reads
(every bit, ``-0.0`` included). Tensor parallelism splits the intermediate dimension: each rank's
part is gathered over the TP group.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..checkpoint_layout import EXPERT_TENSOR
from .packing import Packing, unpack

#: Where a projection lives in the fused parameters: (parameter, half of w13 or None).
_SLOTS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}
ROUTED = "routed_experts"


def expert_location(model: torch.nn.Module, name: str) -> tuple[str, str, int | None, int] | None:
    """``(module path, parameter, half, expert)`` of an expert's checkpoint tensor, or ``None`` if
    ``name`` names no expert of a fused MoE layer of ``model``."""
    match = EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in _SLOTS:
        return None
    path = f"{match['prefix']}.{ROUTED}"
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    param, half = _SLOTS[match["proj"]]
    if not hasattr(module, param):
        return None
    return path, param, half, int(match["expert"])


def repack_experts(modules: Iterable[torch.nn.Module]) -> None:
    """Prepack reloaded experts again for vLLM's CPU kernels (nothing for other modules and backends).

    vLLM 0.32's reload copies new expert weights into the parameters in the plain layout, and
    prepacks them for its CPU kernels only on the first load (``_setup_kernel``: not on a weight
    update), so reloaded experts would be served from unpacked weights. Read-back through the
    packing order (:func:`read_expert`) checks the result after every update.
    """
    for module in modules:
        if _isa(module) is not None:
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


def _isa(module: torch.nn.Module) -> str | None:
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if type(experts).__name__.endswith("CPUUnquantizedExperts") and not getattr(experts, "_use_zentorch", False):
        return experts.isa
    return None


def _unpacked(module: torch.nn.Module, param: str) -> torch.Tensor:
    """The fused parameter in vLLM's plain layout (experts x rows x columns), on CPU."""
    tensor = getattr(module, param).detach().to("cpu")
    isa = _isa(module)
    if isa is None or tensor.dtype != torch.bfloat16:
        return tensor
    return unpack(tensor, Packing.MOE_BF16, isa)


def read_expert(module: torch.nn.Module, param: str, half: int | None, expert: int) -> torch.Tensor:
    """One expert's projection as its checkpoint tensor (gathered over TP at TP > 1: a collective).

    Raises:
        ValueError: the expert is not on this rank (expert parallelism is not read back).
    """
    from .tensor_parallel import all_gather

    local = _local_expert(module, expert)
    weight = _unpacked(module, param)[local]
    if half is not None:
        rows = weight.shape[0] // 2
        weight = weight[half * rows : (half + 1) * rows]
    intermediate_dim = 0 if param == "w13_weight" else 1
    parts = all_gather(weight)
    return torch.cat(parts, dim=intermediate_dim) if len(parts) > 1 else weight


def _local_expert(module: torch.nn.Module, expert: int) -> int:
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        return expert
    local = int(expert_map[expert])
    if local < 0:
        raise ValueError(f"expert {expert} is not on this rank: reading back under expert parallelism is not supported")
    return local
