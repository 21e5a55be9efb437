"""Validation shared by codec decoders: reject hostile input before any write."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import zstandard

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


def check_decoded(name: str, index: np.ndarray, new_bits: np.ndarray, *, count: int, numel: int) -> None:
    """Check what a codec decoded, whatever the codec: ``count`` positions, strictly increasing and
    inside ``[0, numel)`` (see :func:`check_index`), and one new value per position.

    Raises:
        FormatError: a count, a position or the values do not fit.
    """
    if index.ndim != 1 or index.size != count or new_bits.shape != index.shape:
        raise FormatError(f"{name}: decoded {index.size} positions and {new_bits.size} values, the metadata declares {count}")
    check_index(name, index, numel)


def decompress_frame(blob: bytes, *, what: str, expected: int | None = None, max_size: int | None = None) -> bytes:
    """Decompress exactly one zstd frame with bounded output.

    The frame must declare its content size, and that size must be ``expected``
    (or at most ``max_size``) before anything is decompressed; nothing may follow
    the frame (no second frame, skippable frame or trailing bytes).

    Raises:
        FormatError: not a zstd frame, no or a wrong declared size, corrupt data,
            or bytes after the frame.
    """
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: not a zstd frame ({exc})") from None
    if declared < 0:
        raise FormatError(f"{what}: the zstd frame does not declare its size")
    if (expected is not None and declared != expected) or (max_size is not None and declared > max_size):
        bound = f"expected {expected}" if expected is not None else f"at most {max_size}"
        raise FormatError(f"{what}: declares {declared} bytes, {bound}")
    reader = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = reader.decompress(blob)  # libzstd stops a frame that outgrows its declared size
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd data ({exc})") from None
    if not reader.eof:
        raise FormatError(f"{what}: corrupt zstd data (the frame is cut short)")
    if reader.unused_data:
        raise FormatError(f"{what}: {len(reader.unused_data)} bytes after the zstd frame")
    if len(raw) != declared:
        raise FormatError(f"{what}: decompressed to {len(raw)} bytes, the frame declares {declared}")
    return raw
