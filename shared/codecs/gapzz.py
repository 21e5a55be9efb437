"""``gapzz``: our lossless sparse codec, the smallest we know how to make.

Positions: sorted flat indices become gaps (``index[i] - index[i-1] - 1``), stored
with the fewest bytes that hold the largest gap, split into byte planes (all
low bytes, then all next bytes, ...) and zstd-compressed. At ~1% density gaps
average ~100, so the low plane carries the information and the high planes are
nearly all zero.

Values: the receiver holds the old bit pattern, so we store the wrapping integer
difference ``new_bits - old_bits`` zigzag-coded (0, -1, 1, -2 -> 0, 1, 2, 3),
again split into byte planes and zstd-compressed. An RL update mostly moves a
bf16 weight by one unit in the last place, so most values code to 1 or 2.
Everything works on bit patterns of the tensor's own width, so any dtype,
NaN payload, infinity, -0.0 or subnormal round-trips exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
import zstandard

from ..dtypes import uint_dtype
from ..errors import FormatError
from .base import Codec, EncodedTensor, register_codec
from .checks import decompress_frame, require_entry

ZSTD_LEVEL = 1


def _byte_width(max_value: int) -> int:
    for width in (1, 2, 4, 8):
        if max_value < 1 << (8 * width):
            return width
    raise AssertionError("unreachable")


def _split_planes(values: np.ndarray) -> np.ndarray:
    """(n,) unsigned ints of width w -> (w * n,) bytes, plane by plane, low byte first."""
    w = values.itemsize
    return np.ascontiguousarray(values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w).T).reshape(-1)


def _join_planes(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_split_planes`."""
    count = planes.size // width
    joined = np.ascontiguousarray(planes.reshape(width, count).T).reshape(-1)
    return joined.view(uint_dtype(width).newbyteorder("<")).astype(uint_dtype(width), copy=False)


def _zigzag(diff: np.ndarray) -> np.ndarray:
    bits = diff.itemsize * 8
    signed = diff.view(np.dtype(f"int{bits}"))
    return ((signed << 1) ^ (signed >> (bits - 1))).view(diff.dtype)


def _unzigzag(zz: np.ndarray) -> np.ndarray:
    one = zz.dtype.type(1)
    return (zz >> one) ^ (zz.dtype.type(0) - (zz & one))


class GapZigzagCodec(Codec):
    """Gap-coded positions and zigzag value differences, byte-split and zstd-compressed."""

    name = "gapzz"
    version = 1

    def __init__(self, level: int = ZSTD_LEVEL) -> None:
        self.level = level

    def entry_names(self, name: str) -> list[str]:
        return [f"{name}.pos", f"{name}.val"]

    def _compress(self, data: np.ndarray) -> torch.Tensor:
        blob = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data.tobytes())
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    def encode(self, name: str, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> EncodedTensor:
        gaps = np.empty_like(index)
        if index.size:
            gaps[0] = index[0]
            np.subtract(index[1:], index[:-1], out=gaps[1:])
            gaps[1:] -= 1
        width = _byte_width(int(gaps.max())) if gaps.size else 1
        gap_planes = _split_planes(gaps.astype(uint_dtype(width)))
        val_planes = _split_planes(_zigzag(new_bits - old_bits))
        return EncodedTensor(
            entries={f"{name}.pos": self._compress(gap_planes), f"{name}.val": self._compress(val_planes)},
            params={"gap_bytes": width},
        )

    def decode(
        self,
        name: str,
        entries: Mapping[str, torch.Tensor],
        params: Mapping[str, Any],
        *,
        count: int,
        numel: int,
        itemsize: int,
        old_bits_at: Callable[[np.ndarray], np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        width = params.get("gap_bytes")
        if type(width) is not int or width not in (1, 2, 4, 8):
            raise FormatError(f"{name}: invalid gap_bytes {width!r}")
        pos_key, val_key = self.entry_names(name)
        pos_blob = require_entry(entries, pos_key, torch.uint8).numpy().tobytes()
        val_blob = require_entry(entries, val_key, torch.uint8).numpy().tobytes()
        pos = np.frombuffer(decompress_frame(pos_blob, what=f"entry {pos_key!r}", expected=count * width), dtype=np.uint8)
        val = np.frombuffer(decompress_frame(val_blob, what=f"entry {val_key!r}", expected=count * itemsize), dtype=np.uint8)
        gaps = _join_planes(pos, width)
        if width == 8 and gaps.size and int(gaps.max()) >= numel:  # narrower gaps cannot overflow the sum
            raise FormatError(f"{name}: index out of range for a tensor of {numel} elements")
        index = np.cumsum(gaps.astype(np.int64) + 1) - 1  # strictly increasing by construction
        if index.size and index[-1] >= numel:
            raise FormatError(f"{name}: index out of range for a tensor of {numel} elements")
        new_bits = old_bits_at(index) + _unzigzag(_join_planes(val, itemsize))
        return index, new_bits


register_codec(GapZigzagCodec())
