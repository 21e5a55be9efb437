"""Reading back weights vLLM's CPU kernels keep prepacked: the packing order, found by probing.

Some of vLLM's CPU kernels keep a weight in their own element order: the fused MoE experts
(``cpu_prepack_moe_weight``, bf16) and block-FP8 linear layers (``convert_weight_packed``, the VNNI
layout of ``CPUFp8BlockScaledMMKernel``, e4m3). Both only move elements. The order is found, not
assumed (:func:`packing_order`): the kernel's own prepack runs on a probe whose elements are their own
positions, a few bits at a time (bit patterns the prepack moves as they are: 15 bits as bf16, 6 bits as
e4m3, never a NaN pattern), and :func:`unpack` inverts it, so reading back returns exactly what the served
kernel reads, every bit (``-0.0`` included).
"""

from __future__ import annotations

import enum
import functools

import torch


class Packing(str, enum.Enum):
    """The CPU prepacks that are read back: which op, and the probe digits' dtype and width."""

    MOE_BF16 = "cpu_prepack_moe_weight"
    FP8_LINEAR = "convert_weight_packed"

    @property
    def digit(self) -> tuple[torch.dtype, torch.dtype, int]:
        """``(integer dtype, probe dtype, bits)`` of one probe digit."""
        if self is Packing.MOE_BF16:
            return torch.int16, torch.bfloat16, 15
        return torch.uint8, torch.float8_e4m3fn, 6  # 0..63: finite e4m3 patterns only

    def pack(self, probe: torch.Tensor, isa: str) -> torch.Tensor:
        """The kernel's own prepack of ``probe``."""
        if self is Packing.MOE_BF16:
            from vllm._custom_ops import cpu_prepack_moe_weight

            return cpu_prepack_moe_weight(probe, isa)
        return torch.ops._C.convert_weight_packed(probe)


@functools.lru_cache(maxsize=32)
def packing_order(packing: Packing, shape: tuple[int, ...], isa: str = "") -> torch.Tensor:
    """For each element of a tensor of ``shape`` prepacked by ``packing``, its position in the unpacked tensor.

    Args:
        packing: The prepack.
        shape: The (unpacked and packed: the prepacks keep it) shape.
        isa: The MoE kernel's instruction set (``cpu_prepack_moe_weight``'s argument).

    Raises:
        RuntimeError: The prepack is not a permutation of the positions (a kernel this cannot invert).
    """
    int_dtype, probe_dtype, bits = packing.digit
    count = 1
    for d in shape:
        count *= d
    positions = torch.arange(count, dtype=torch.int64)
    order = torch.zeros(count, dtype=torch.int64)
    mask = (1 << bits) - 1
    for shift in range(0, max(1, count.bit_length()), bits):
        digit = ((positions >> shift) & mask).to(int_dtype).view(probe_dtype).view(shape)
        packed = packing.pack(digit, isa).reshape(-1).view(int_dtype).to(torch.int64) & mask
        order |= packed << shift
    if packed.numel() != count or not torch.equal(torch.sort(order).values, positions):
        raise RuntimeError(f"{packing.value} of shape {shape} is not a permutation of its elements")
    return order


def unpack(tensor: torch.Tensor, packing: Packing, isa: str = "") -> torch.Tensor:
    """``tensor`` (prepacked by ``packing``) in its plain layout, on CPU."""
    tensor = tensor.detach().to("cpu")
    out = torch.empty_like(tensor)
    out.view(-1)[packing_order(packing, tuple(tensor.shape), isa)] = tensor.reshape(-1)
    return out
