"""Validation shared by codec decoders: reject hostile input before any write."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..errors import FormatError


def require_entry(entries: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, length: int | None = None) -> torch.Tensor:
    """Return the 1-D entry ``key`` after checking its dtype and optionally its length."""
    if key not in entries:
        raise FormatError(f"missing entry {key!r}")
    tensor = entries[key]
    if tensor.dtype != dtype or tensor.dim() != 1:
        raise FormatError(f"entry {key!r}: expected 1-D {dtype}, got {tensor.dim()}-D {tensor.dtype}")
    if length is not None and tensor.numel() != length:
        raise FormatError(f"entry {key!r}: expected {length} elements, got {tensor.numel()}")
    return tensor


def check_index(name: str, index: np.ndarray, numel: int) -> None:
    """Check that ``index`` is strictly increasing and inside ``[0, numel)``."""
    if index.size == 0:
        return
    if index[0] < 0 or index[-1] >= numel:
        raise FormatError(f"{name}: index out of range for a tensor of {numel} elements")
    if index.size > 1 and not bool(np.all(index[1:] > index[:-1])):
        raise FormatError(f"{name}: indices are not strictly increasing (duplicates or unsorted)")
