"""``classrice``'s decode kernel finds the changed elements of its ``dense`` classes a block of 64 at a
time (bit masks) and those of the other classes one at a time: whichever classes are dense, and
whether a class is coded inverted (most of its members changed) or not, the decode is the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlsync.codecs.classrice as classrice
from rlsync.codecs import DecodeTarget, get_codec
from rlsync.dtypes import bits_to_numpy, dtype_name, int_view


def _delta(numel: int, seed: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """A bf16 tensor whose small weights mostly change (inverted classes) and large ones rarely."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
    chance = torch.where(base.float().abs() < 0.004, 0.9, 0.02)
    index = torch.nonzero(torch.rand(numel, generator=g) < chance).squeeze(1)
    old = int_view(base).clone()
    new = old.clone()
    new[index] += 1
    old_bits, new_bits = bits_to_numpy(old), bits_to_numpy(new)
    changed = np.flatnonzero(old_bits != new_bits)
    return base, changed, old_bits, new_bits


@pytest.mark.parametrize("numel", [63, 64, 65, 4096, 100_003])
@pytest.mark.parametrize("dense", ["common", "rare", "one_at_a_time"])
def test_any_dense_classes_decode_the_same(monkeypatch, numel: int, dense: str) -> None:
    codec = get_codec("classrice")
    base, index, old_bits, new_bits = _delta(numel, seed=numel)
    encoded = codec.encode("w", index, old_bits[index], new_bits[index], base=base)
    flags = np.frombuffer(encoded.entries["w.pos"].numpy()[: encoded.params["classes"] * 7].tobytes(), classrice.TABLE)["flags"]
    assert (flags & classrice.INVERTED).any() and not (flags & classrice.INVERTED).all()  # both kinds of class
    common = classrice._dense_classes
    choice = {
        "common": lambda bits, field: common(bits, field),
        "rare": lambda bits, field: np.arange(140, 152, dtype=np.uint8),  # classes no weight here has
        "one_at_a_time": lambda bits, field: np.empty(0, np.uint8),
    }[dense]
    monkeypatch.setattr(classrice, "_dense_classes", choice)
    params = {**encoded.params, "dtype": dtype_name(base.dtype)}
    got_index, got_new, got_old = codec.decode(
        "w", encoded.entries, params, DecodeTarget(count=index.size, numel=numel, itemsize=2, bits_at=lambda i: old_bits[i], tensor=base)
    )
    assert np.array_equal(got_index, index)
    assert np.array_equal(got_new, new_bits[index]) and np.array_equal(got_old, old_bits[index])


def test_both_ways_of_depositing_bits_into_a_mask_agree() -> None:
    """The block kernel deposits a class's next changes at its members in a block with ``pdep`` where the CPU
    has it, by a binary search per change elsewhere: both put the low bits of ``x``, in order, at the set bits
    of the mask, for full, empty and random masks and any number of bits."""
    import numba

    from rlsync.codecs import class_kernels as kernels

    rng = np.random.default_rng(0)
    masks = [np.uint64(1), np.uint64(1 << 63), ~np.uint64(0)] + [np.uint64(m) for m in rng.integers(1, 2**63, 200, dtype=np.uint64)]
    ways = [kernels._deposit_by_search]
    if kernels.HAS_PDEP:
        ways.append(numba.njit(lambda x, m: kernels._deposit_by_pdep(x, m)))
    for mask in masks:
        members = [bit for bit in range(64) if int(mask) >> bit & 1]
        for x in (0, (1 << len(members)) - 1, int(rng.integers(0, 2**63)) & ((1 << len(members)) - 1)):
            expected = sum(1 << members[j] for j in range(len(members)) if x >> j & 1)
            for deposit in ways:
                assert int(deposit(np.uint64(x), mask)) == expected, (deposit, hex(int(mask)), hex(x))


def test_rice_bitmaps_lay_out_each_class_and_refuse_a_rank_past_the_words_before_writing_it() -> None:
    """The Rice ranks go straight into one bitmap per class, one after the other, each followed by two words
    where reads past its last rank land (zeros, or ones for a class coded inverted, whose bitmap is flipped:
    a set bit is a changed member). A rank whose word would not fit the array is refused before it is
    written, and the last two words, which the classes without ranks read, stay zero."""
    from rlsync.codecs import rice_kernels
    from rlsync.codecs.classrice import INVERTED, ClassRiceCodec

    def streams(groups):
        table, unary, rem = ClassRiceCodec._encode_classes(groups)
        return (unary, rem, (table["flags"] & 0x3F).astype(np.int64), table["count"].astype(np.int64),
                table["cls"].astype(np.int64), (table["flags"] & INVERTED) != 0)  # fmt: skip

    # class 3: 2 of 100 members changed; class 5: 5 of 6 changed, coded inverted as its one unchanged member
    unary, rem, ks, counts, classes, inverted = streams([(3, np.array([0, 2]), 100), (5, np.array([0, 1, 2, 3, 5]), 6)])
    assert inverted.tolist() == [False, True] and counts.tolist() == [2, 1]
    words, first_word, ends = np.zeros(9, np.uint64), np.full(8, 7, np.int64), np.zeros(8, np.int64)
    at_unary, at_rem = rice_kernels.rice_bitmaps(unary, rem, ks, counts, classes, inverted, 1000, words, first_word, ends)
    assert (at_unary + 7) // 8 == unary.size and (at_rem + 7) // 8 == rem.size
    full = 2**64 - 1
    assert [int(w) for w in words] == [0b101, 0, 0, full ^ (1 << 4), full, full, 0, 0, 0]
    assert first_word.tolist() == [7, 7, 7, 0, 7, 3, 7, 7] and ends.tolist() == [0, 0, 0, 3, 0, 5, 0, 0]

    # a rank far past the words: refused, and nothing written from its word on
    unary, rem, ks, counts, classes, inverted = streams([(0, np.array([1, 5, 7, 1000]), 2000)])
    words, first_word, ends = np.zeros(8, np.uint64), np.full(1, 6, np.int64), np.zeros(1, np.int64)
    assert rice_kernels.rice_bitmaps(unary, rem, ks, counts, classes, inverted, 2000, words, first_word, ends) == (-1, -1)
    assert int(words[0]) == (1 << 1) | (1 << 5) | (1 << 7) and not words[1:].any()
