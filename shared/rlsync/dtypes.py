"""Dtype helpers: safetensors dtype names and bit-pattern views.

The sync library never compares float values: it compares and ships bit patterns,
so NaN payloads, infinities, -0.0 and subnormals round-trip exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import FormatError

_ST_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_ST = {v: k for k, v in _ST_NAMES.items()}

#: Exponent field (shift, mask) of each float dtype, by safetensors name.
EXPONENT_FIELDS: dict[str, tuple[int, int]] = {
    "BF16": (7, 0xFF),
    "F16": (10, 0x1F),
    "F32": (23, 0xFF),
    "F64": (52, 0x7FF),
    "F8_E4M3": (3, 0xF),
    "F8_E5M2": (2, 0x1F),
}

_INT_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_NP_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _ST_NAMES[dtype]
    except KeyError:
        raise FormatError(f"unsupported dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name.

    Raises:
        FormatError: the name is unknown.
    """
    try:
        return _FROM_ST[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype name {name!r}") from None


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``'s bits as a signed integer tensor of the same width."""
    flat = tensor.reshape(-1)
    if tensor.dtype == torch.bool:
        return flat.view(torch.int8)
    return flat.view(_INT_BY_SIZE[tensor.element_size()])


def bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    """Move an integer bit view to a numpy array of unsigned ints of the same width."""
    arr = bits.detach().cpu().numpy()
    return arr.view(_UINT_NP_BY_SIZE[arr.itemsize])


def tensor_bits(tensor: torch.Tensor) -> np.ndarray:
    """The flat bits of a tensor as unsigned ints of the same width (a view, no copy, for a contiguous CPU tensor)."""
    return bits_to_numpy(int_view(tensor.detach()))


def numpy_to_values(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret unsigned-int bit patterns as a 1-D tensor of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    signed = np.ascontiguousarray(bits).view(np.dtype(f"int{8 * size}"))
    out = torch.from_numpy(signed)
    return out.view(torch.bool) if dtype == torch.bool else out.view(dtype)


def uint_dtype(itemsize: int) -> np.dtype:
    """Numpy unsigned int dtype of ``itemsize`` bytes."""
    return np.dtype(_UINT_NP_BY_SIZE[itemsize])
