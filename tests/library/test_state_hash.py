"""The additive state hash (rlsync.hashing): bits, not values; the same however a state is sliced
among holders; updated from the changed elements alone to exactly the hash of the new state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlsync.dtypes import bits_to_numpy, int_view
from rlsync.hashing import StateLanes, add_lanes, change_lanes, slice_lanes, state_hash, tensor_lanes

# up to 32 bits: elements keyed as index << width | bits; 64-bit dtypes: through a mixed index (both forms)
DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float64, torch.uint8]


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=torch.int64)
    size = torch.empty((), dtype=dtype).element_size()
    raw = bits.view(torch.uint8)[: numel * size] if size < 8 else bits.view(torch.uint8)
    if dtype == torch.bool:
        return (bits & 1).bool()
    return raw.view(dtype).clone()


@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(0, 5000),
    cuts=st.lists(st.floats(0, 1), max_size=8),
    seed=st.integers(0, 2**31),
)
def test_slices_add_up_to_the_whole_tensor_however_it_is_cut(dtype, numel, cuts, seed):
    """Any holder of a flat slice (an FSDP2 or tensor-parallel rank) contributes the sum over its
    elements; the parts add up to the single-process hash, in any order."""
    tensor = _tensor(dtype, numel, seed)
    bounds = sorted({0, numel, *(int(c * numel) for c in cuts)})
    flat = tensor.reshape(-1)
    parts = [slice_lanes("w", flat[a:b], a, numel) for a, b in zip(bounds, bounds[1:])]
    assert np.array_equal(add_lanes(reversed(parts)), tensor_lanes("w", tensor))
    sharded = StateLanes(StateLanes.of({"w": tensor}).structure, {"w": add_lanes(parts)})
    assert sharded.hexdigest() == state_hash({"w": tensor})


@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(1, 3000),
    picks=st.lists(st.integers(0, 2**31), min_size=1, max_size=50),
    seed=st.integers(0, 2**31),
)
def test_an_update_from_the_changed_elements_alone_equals_a_full_rehash(dtype, numel, picks, seed):
    state = {"a": _tensor(dtype, numel, seed), "b": _tensor(torch.bfloat16, 64, seed + 1)}
    lanes = StateLanes.of(state)
    index = np.unique(np.array([p % numel for p in picks], dtype=np.int64))
    flat = bits_to_numpy(int_view(state["a"]))
    old = flat[index].copy()
    new = old ^ np.array([(p >> 3) % 255 + 1 for p in picks[: index.size]], dtype=old.dtype)  # every bit pattern changes
    if dtype == torch.bool:
        new = old ^ 1
    flat[index] = new
    updated = lanes.updated({"a": change_lanes("a", state["a"].element_size(), numel, index, old, new)})
    assert updated.hexdigest() == state_hash(state) != lanes.hexdigest()
    assert updated.tensors["b"] is lanes.tensors["b"] or np.array_equal(updated.tensors["b"], lanes.tensors["b"])


def test_bits_not_values():
    """-0.0 and 0.0, and two NaN payloads, are equal or alike as floats and different as bits."""
    zero, negative_zero = torch.tensor([0.0]), torch.tensor([-0.0])
    assert state_hash({"w": zero}) != state_hash({"w": negative_zero})
    nan_a = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    assert state_hash({"w": nan_a}) != state_hash({"w": nan_b})


@pytest.mark.parametrize(
    "other",
    [
        {"v": torch.arange(6, dtype=torch.bfloat16)},  # another name
        {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},  # another shape
        {"w": torch.arange(6, dtype=torch.float16)},  # another dtype (the same bits would differ anyway)
        {"w": torch.arange(6, dtype=torch.bfloat16).flip(0)},  # the same values at other positions
        {"w": torch.arange(6, dtype=torch.bfloat16), "e": torch.zeros(0)},  # one more (empty) tensor
        {"w": torch.arange(5, dtype=torch.bfloat16)},  # one element fewer
    ],
)
def test_structure_and_positions_count(other):
    assert state_hash({"w": torch.arange(6, dtype=torch.bfloat16)}) != state_hash(other)


def test_swapping_two_tensors_contents_changes_the_hash():
    a, b = torch.randn(100).to(torch.bfloat16), torch.randn(100).to(torch.bfloat16)
    assert state_hash({"a": a, "b": b}) != state_hash({"a": b, "b": a})


def test_slices_outside_the_tensor_are_refused():
    with pytest.raises(ValueError, match="outside a tensor of 10 elements"):
        slice_lanes("w", torch.zeros(4), 8, 10)


def test_the_hash_of_a_fixed_state_is_pinned():
    """The hash is part of format version 3: any change to f, the lanes or the structure digest
    breaks every chain already written, so it needs a new format version, not a silent change.
    Both key forms: 8-, 16- and 32-bit tensors pack index and bits, the 64-bit one mixes the index."""
    state = {
        "w": torch.arange(-8, 8, dtype=torch.float32).to(torch.bfloat16).reshape(4, 4),
        "b": torch.tensor([True, False]),
        "i": torch.arange(3, dtype=torch.int64),
        "f": torch.tensor([0.5, -0.0]),
    }
    assert state_hash(state) == "6605bf3cfff080d6e60f4aadcb42334d3e46d60eecf9fd6baae77304b73352fc"
