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

from typing import Any, Mapping

import numpy as np
import torch
import zstandard

from ..dtypes import uint_dtype
from ..errors import FormatError
from ..registry import Kind, register
from .base import Codec, Decoded, DecodeTarget, EncodedTensor
from .checks import decompress_frame, require_entry

ZSTD_LEVEL = 1


def _byte_width(max_value: int) -> int:
    """Bytes per gap: 1, 2 or 4 if ``max_value`` fits, else 8 (gaps of int64 positions always fit)."""
    for width in (1, 2, 4):
        if max_value < 1 << (8 * width):
            return width
    return 8


def split_planes(values: np.ndarray) -> np.ndarray:
    """(n,) unsigned ints of width w -> (w * n,) bytes, plane by plane, low byte first."""
    w = values.itemsize
    return np.ascontiguousarray(values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w).T).reshape(-1)


def join_planes(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`split_planes`."""
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

    @staticmethod
    def _decompress(key: str, entry: torch.Tensor, expected: int) -> np.ndarray:
        return np.frombuffer(decompress_frame(entry.numpy().tobytes(), what=f"entry {key!r}", expected=expected), dtype=np.uint8)

    def encode(
        self, name: str, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray, *, base: torch.Tensor | None = None
    ) -> EncodedTensor:
        coded, order, params = self._coding_order(index, base)
        if order is not None:
            old_bits, new_bits = old_bits[order], new_bits[order]
        pos, width = self._encode_positions(coded)
        entries = {f"{name}.pos": pos, **self._encode_values(name, old_bits, new_bits)}
        return EncodedTensor(entries=entries, params={"gap_bytes": width, **params})

    def decode(self, name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], target: DecodeTarget) -> Decoded:
        coded = self._decode_positions(name, entries, params, target)
        diff = self._decode_values(name, entries, target)
        index, order = self._flat_positions(name, coded, params, target)
        return Decoded(index, target.bits_at(index) + (diff if order is None else diff[order]))

    def _coding_order(self, index: np.ndarray, base: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """The increasing numbers to gap-code for sorted positions ``index`` (here: the positions themselves).

        Returns:
            ``(coded, order, params)``: the numbers, which element of ``index`` each one
            stands for (``None``: the same order), and parameters the decoder needs.
        """
        return index, None, {}

    def _flat_positions(
        self, name: str, coded: np.ndarray, params: Mapping[str, Any], target: DecodeTarget
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Inverse of :meth:`_coding_order`: sorted positions and, unless ``None``, the coded element at each."""
        return coded, None

    def _encode_positions(self, index: np.ndarray) -> tuple[torch.Tensor, int]:
        """Gap-coded ``index`` as one zstd entry, and the gap width in bytes."""
        gaps = np.empty_like(index)
        if index.size:
            gaps[0] = index[0]
            np.subtract(index[1:], index[:-1], out=gaps[1:])
            gaps[1:] -= 1
        width = _byte_width(int(gaps.max())) if gaps.size else 1
        return self._compress(split_planes(gaps.astype(uint_dtype(width)))), width

    def _decode_positions(
        self, name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], target: DecodeTarget
    ) -> np.ndarray:
        """Strictly increasing positions in ``[0, target.numel)`` from ``{name}.pos``; raises FormatError otherwise."""
        count, numel = target.count, target.numel
        width = params.get("gap_bytes")
        if type(width) is not int or width not in (1, 2, 4, 8):
            raise FormatError(f"{name}: invalid gap_bytes {width!r}")
        pos_key = f"{name}.pos"
        gaps = join_planes(self._decompress(pos_key, require_entry(entries, pos_key, torch.uint8), count * width), width)
        if width == 8 and gaps.size and int(gaps.max()) >= numel:  # narrower gaps cannot overflow the sum
            raise FormatError(f"{name}: index out of range for a tensor of {numel} elements")
        index = np.cumsum(gaps.astype(np.int64) + 1) - 1  # strictly increasing by construction
        if index.size and index[-1] >= numel:
            raise FormatError(f"{name}: index out of range for a tensor of {numel} elements")
        return index

    def _encode_values(self, name: str, old_bits: np.ndarray, new_bits: np.ndarray) -> dict[str, torch.Tensor]:
        """The zigzag wrapping differences as ``{name}.val``."""
        return {f"{name}.val": self._compress(split_planes(_zigzag(new_bits - old_bits)))}

    def _decode_values(self, name: str, entries: Mapping[str, torch.Tensor], target: DecodeTarget) -> np.ndarray:
        """The wrapping differences (new bits minus old bits) stored by :meth:`_encode_values`."""
        val_key, width = f"{name}.val", target.itemsize
        raw = self._decompress(val_key, require_entry(entries, val_key, torch.uint8), target.count * width)
        return _unzigzag(join_planes(raw, width))


register(Kind.CODEC, "gapzz", "rlsync.codecs.gapzz:GapZigzagCodec", summary="gaps and zigzag varints, zstd-compressed")
