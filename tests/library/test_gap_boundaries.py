"""Position coding at the exact byte-width boundaries, and a tensor over 2**32 elements.

gapzz stores gaps (``index[i] - index[i-1] - 1``, the first gap is ``index[0]``) in
the fewest bytes that hold the largest gap: 1 byte up to 2**8 - 1, 2 bytes up to
2**16 - 1, 4 bytes up to 2**32 - 1, 8 bytes beyond. An off-by-one in that choice
truncates gaps of exactly 2**8, 2**16 or 2**32, so each boundary is tested on both
sides, as the first gap and as a later one. The tensor over 2**32 elements is a
stride-0 view of one element (nothing large is allocated); only positions are coded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlsync.codecs import DecodeTarget, get_codec
from rlsync.dtypes import bits_to_numpy, int_view
from rlsync.errors import FormatError
from rlsync.delta_format import Change, decode_delta, encode_delta

# (gap, bytes per gap that must hold it)
BOUNDARY_GAPS = [(2**8 - 1, 1), (2**8, 2), (2**16 - 1, 2), (2**16, 4), (2**32 - 1, 4), (2**32, 8)]
CODECS = ["gapzz", "trl"]


def _bits(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Old and new bf16 bit patterns at ``index``: +1, -1 and wrapping differences."""
    old = (np.arange(index.size, dtype=np.uint16) * np.uint16(40_503)) | np.uint16(1)
    new = old.copy()
    new[0::3] += np.uint16(1)
    new[1::3] -= np.uint16(1)
    new[2::3] ^= np.uint16(0x8001)
    return old, new


def _decode_positions(codec_name: str, index: np.ndarray, numel: int, *, params: dict | None = None):
    old, new = _bits(index)
    encoded = get_codec(codec_name).encode("w", index, old, new)

    def old_bits_at(idx: np.ndarray) -> np.ndarray:
        np.testing.assert_array_equal(idx, index)  # the decoder reads the old bits at exactly the decoded positions
        return old

    got_index, got_bits, _ = get_codec(codec_name).decode(
        "w", encoded.entries, encoded.params if params is None else params,
        DecodeTarget(count=index.size, numel=numel, itemsize=2, bits_at=old_bits_at),
    )  # fmt: skip
    return encoded, got_index, got_bits, new


@pytest.mark.parametrize("gap, width", BOUNDARY_GAPS, ids=[f"gap={g}" for g, _ in BOUNDARY_GAPS])
@pytest.mark.parametrize("where", ["first", "later", "between_small_gaps"])
def test_gapzz_gap_at_byte_width_boundary_round_trips(gap: int, width: int, where: str) -> None:
    """A gap of exactly 2**k - 1 fits k/8 bytes; exactly 2**k needs the next width; both decode exactly."""
    if where == "first":
        index = np.array([gap], dtype=np.int64)
    elif where == "later":
        index = np.array([7, 7 + gap + 1], dtype=np.int64)
    else:
        index = np.array([0, 1, 2 + gap, 3 + gap, 5 + gap], dtype=np.int64)  # gaps 0, 0, gap, 0, 1
    numel = int(index[-1]) + 1
    encoded, got_index, got_bits, new = _decode_positions("gapzz", index, numel)
    assert encoded.params["gap_bytes"] == width
    assert got_index.dtype == np.int64
    np.testing.assert_array_equal(got_index, index)
    np.testing.assert_array_equal(got_bits, new)
    with pytest.raises(FormatError, match="out of range"):  # the last position is exactly one past a smaller tensor
        _decode_positions("gapzz", index, numel - 1)


@pytest.mark.parametrize("gap, _width", BOUNDARY_GAPS, ids=[f"gap={g}" for g, _ in BOUNDARY_GAPS])
def test_trl_positions_at_gap_boundaries_round_trip(gap: int, _width: int) -> None:
    """The baseline codec stores positions, not gaps, and decodes the same boundary positions exactly."""
    index = np.array([7, 7 + gap + 1], dtype=np.int64)
    _, got_index, got_bits, new = _decode_positions("trl", index, int(index[-1]) + 1)
    np.testing.assert_array_equal(got_index, index)
    np.testing.assert_array_equal(got_bits, new)


@pytest.mark.parametrize("codec", CODECS)
def test_delta_for_a_tensor_over_2_32_elements_with_every_boundary_gap(codec: str) -> None:
    """A delta of a bf16 tensor of more than 2**33 elements, with every boundary gap in one tensor and the last
    element changed, goes through encode_delta/decode_delta exactly; nothing is allocated at the tensor's size."""
    index = [0]
    for gap, _ in BOUNDARY_GAPS:
        index.append(index[-1] + gap + 1)
    numel = index[-1] + 1
    assert numel > 2**33
    index_arr = np.array(index, dtype=np.int64)
    base = torch.full((1,), -2.5, dtype=torch.bfloat16).expand(numel)  # 2 bytes of storage
    old = np.full(index_arr.size, bits_to_numpy(int_view(base[:1].contiguous()))[0], dtype=np.uint16)
    new = old + np.arange(1, index_arr.size + 1, dtype=np.uint16)
    change = Change(index=index_arr, old_bits=old, new_bits=new, dtype=torch.bfloat16, shape=(numel,))
    data = encode_delta({"big": change}, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=numel, codec=codec)
    assert len(data) < 4096
    patch = decode_delta(data, {"big": base}).patches["big"]
    assert patch.index.dtype == torch.int64 and patch.shape == (numel,)
    np.testing.assert_array_equal(patch.index.numpy(), index_arr)
    np.testing.assert_array_equal(bits_to_numpy(int_view(patch.values)), new)
