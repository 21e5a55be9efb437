"""Size figures of a published version, for comparisons in panels and benchmarks."""

from __future__ import annotations

#: Safetensors header bytes per tensor in TRL's layout (an estimate: two entries, ``.indices`` and ``.values``).
TRL_HEADER_BYTES_PER_TENSOR = 192


def trl_layout_bytes(changed: int, tensors: int, value_bytes: int = 2) -> int:
    """Bytes of a delta in the plain layout of TRL's public delta-sync design.

    Each changed element costs an int32 index plus its value (6 bytes for bf16), plus
    the safetensors header (estimated per tensor; the exact size depends on names).

    Args:
        changed: Changed elements (the delta's ``changed`` metadata).
        tensors: Tensors in the header (an upper bound: the model's tensor count).
        value_bytes: Bytes per value (2 for bf16).
    """
    return changed * (4 + value_bytes) + TRL_HEADER_BYTES_PER_TENSOR * tensors + 8
