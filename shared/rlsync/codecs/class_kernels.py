"""Compiled passes over a tensor's exponent classes (numba, CPU), for the ``classrice`` codec: the ranks
of changed elements within their classes (the encoder's), and their flat positions back from the ranks
(the decoder's).

Both read the old bits :data:`~rlsync.bitops.LANES` elements at a time, the members of the most common
classes as bit masks (:func:`~rlsync.bitops.class_masks`). Each kernel allocates nothing it was not
given beyond a few per-class counters; they are compiled on first use and cached on disk.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..bitops import DENSE, HAS_PDEP, LANES, MASKS_IN_ORDER, SLOTS  # noqa: F401 - the codec reads the block geometry here
from ..bitops import class_masks as _class_masks
from ..bitops import class_members as _class_members
from ..bitops import funnel_shift_right as _funnel_shift_right
from ..bitops import lowest_bit as _lowest_bit
from ..bitops import popcount as _popcount

_JIT = dict(cache=True, nogil=True, boundscheck=False)


@numba.njit(**_JIT, inline="always")
def _select_by_search(members, k):  # pragma: no cover - compiled
    """The lowest set bit of ``members`` that has ``k`` set bits below it (``k`` below their count), as a
    one-bit mask: a binary search on the halves' bit counts, without a branch to mispredict."""
    at = np.int64(0)
    for width in (32, 16, 8, 4, 2, 1):
        low = _popcount((members >> np.uint64(at)) & ((np.uint64(1) << np.uint64(width)) - np.uint64(1)))
        up = k >= low
        k -= low if up else 0
        at += width if up else 0
    return np.uint64(1) << np.uint64(at)


@numba.njit(**_JIT, inline="always")
def _deposit_by_search(x, m):  # pragma: no cover - compiled
    """BMI2's ``pdep`` without it: the low bits of ``x`` placed, in order, at the set bits of ``m`` (as many
    as ``m`` has; the others are ignored), one :func:`_select_by_search` per set bit of ``x`` placed."""
    count = np.uint64(_popcount(m))
    x &= ((np.uint64(1) << (count & np.uint64(63))) - np.uint64(1)) | (np.uint64(0) - (count >> np.uint64(6)))
    out = np.uint64(0)
    while x:
        out |= _select_by_search(m, _lowest_bit(x))
        x &= x - np.uint64(1)
    return out


@intrinsic
def _deposit_by_pdep(typingctx, x, m):  # pragma: no cover - compiled
    """BMI2's ``pdep``: the low bits of ``x`` placed, in order, at the set bits of ``m`` (both ``uint64``)."""

    def codegen(context, builder, signature, args):
        pdep = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        return builder.call(builder.module.declare_intrinsic("llvm.x86.bmi.pdep.64", fnty=pdep), args)

    return types.uint64(types.uint64, types.uint64), codegen


_deposit = _deposit_by_pdep if HAS_PDEP else _deposit_by_search


@numba.njit(**_JIT, inline="always")
def _class_of(bits, i, shift, mask):  # pragma: no cover - compiled
    return (bits[i] >> shift) & mask


@numba.njit(**_JIT)
def class_ranks(bits, shift, mask, dense, index, ranks, classes, members):  # pragma: no cover - compiled
    """Rank within its class, and class, of each element at sorted flat positions ``index``.

    One pass over the old bits, :data:`LANES` elements at a time as :func:`class_positions` reads them:
    the block's members of each ``dense`` class come as one bit mask, so a changed element's rank is its
    class's count before the block plus the members below it in the mask, and the block adds each dense
    class's members at once; the members of the other classes are counted one at a time, in flat order
    with the changed elements.

    Args:
        bits: The old bit patterns of the whole tensor (signed ints).
        shift, mask: The dtype's exponent field.
        dense: :data:`DENSE` distinct classes (``uint8``; speed only), or an empty array to count every
            element one at a time.
        index: Strictly increasing flat positions.
        ranks: Out: each element's number of same-class elements before it.
        classes: Out: each element's class.
        members: Out, zeroed, one slot per class: the class sizes over the whole tensor.
    """
    slot = np.full(members.size, -1, np.int64)
    for d in range(dense.size):
        slot[dense[d]] = d
    masks = np.zeros(SLOTS, np.uint64)
    passed = np.zeros(SLOTS, np.int64)  # minus the members of each dense class up to the block's end
    one = np.uint64(1)
    k = 0
    whole = bits.size - bits.size % LANES if dense.size else 0
    for block in range(0, whole, LANES):
        _class_masks(bits, block, shift, mask, dense, masks, passed)
        others = masks[DENSE]
        while k < index.size and index[k] < block + LANES:
            bit = index[k] - block
            c = _class_of(bits, index[k], shift, mask)
            below = (one << np.uint64(bit)) - one
            todo = others & below  # the rare classes' members below it, counted once, in order
            others ^= todo
            while todo:
                members[_class_of(bits, block + _lowest_bit(todo), shift, mask)] += 1
                todo &= todo - one
            if slot[c] >= 0:  # the members up to the block's end, less those from this element on
                rank = -passed[slot[c]] - _popcount(masks[slot[c]] & ~below)
            else:
                rank = members[c]
            ranks[k] = rank
            classes[k] = c
            k += 1
        while others:
            members[_class_of(bits, block + _lowest_bit(others), shift, mask)] += 1
            others &= others - one
    for d in range(dense.size):
        members[dense[d]] -= passed[d]
    for i in range(whole, bits.size):
        c = _class_of(bits, i, shift, mask)
        if k < index.size and index[k] == i:
            ranks[k] = members[c]
            classes[k] = c
            k += 1
        members[c] += 1


@numba.njit(**_JIT, inline="always")
def _bitmap_at(words, at, stop):  # pragma: no cover - compiled
    """The 64 bits of ``words`` from bit ``at`` on (low bit first; ``uint64``), those of word ``stop`` on
    from the two words there (after a class's bitmap, where every read past its last rank lands)."""
    word = min(at >> np.uint64(6), stop)
    return _funnel_shift_right(words[word + np.uint64(1)], words[word], at)


@numba.njit(**_JIT, inline="always")
def _changes_one_at_a_time(todo_bits, block, bits, shift, mask, cursor, stop, words):  # pragma: no cover
    """The changed ones among the elements ``todo_bits`` of a block, taken one at a time."""
    found = np.uint64(0)
    while todo_bits:
        bit = _lowest_bit(todo_bits)
        todo_bits &= todo_bits - np.uint64(1)
        c = _class_of(bits, block + bit, shift, mask)
        at = cursor[c]
        cursor[c] = at + np.uint64(1)
        found |= (_bitmap_at(words, at, stop[c]) & np.uint64(1)) << np.uint64(bit)
    return found


@numba.njit(**_JIT, inline="always")
def _write_change(at, bits, shift, mask, k, positions, olds, classes, slots, changed, real):  # pragma: no cover
    """Write the ``k``-th change, at flat position ``at``: its position, old bits, class and ordinal in its
    class (counted only where ``real``: a slot written ahead of a change leaves the counts as they were)."""
    c = _class_of(bits, at, shift, mask)
    positions[k] = at
    olds[k] = bits[at]
    classes[k] = c
    slots[k] = changed[c]
    changed[c] += np.int64(real)


@numba.njit(**_JIT)
def class_positions(  # pragma: no cover - compiled
    bits, shift, mask, dense, bound, words, first_word, positions, olds, classes, slots, changed
):
    """Inverse of :func:`class_ranks`: flat positions of the changed elements, in flat order.

    One pass over the old bits, :data:`LANES` elements at a time, against each class's changed
    members as a bitmap over its members (:func:`~.rice_kernels.rice_bitmaps`). The block's members of
    each of the ``dense`` classes come as one bit mask (:func:`_class_members`); the class's next
    bits, as many as the block has members, are deposited at the mask's set bits (``pdep``): the
    block's changes of the class, with no branch on their number. The members of every other class
    are taken one at a time.

    Args:
        bits: The old bit patterns of the whole tensor (signed ints).
        shift, mask: The dtype's exponent field.
        dense: :data:`DENSE` distinct classes (``uint8``; speed only: any distinct classes give the
            same result), or an empty array to take every element one at a time (``mask > 0xFF``).
        bound: Per class, its last coded rank plus one (0 for none).
        words, first_word: The classes' bitmaps (:func:`~.rice_kernels.rice_bitmaps`).
        positions: Out: flat positions, increasing.
        olds: Out: the old bit pattern at each position.
        classes: Out: work space, one per position.
        slots: Out: the slot of each position's value (values are stored class by class, in flat
            order within a class).
        changed: Out, zeroed, one slot per class: its number of changed elements.

    Returns:
        The number of positions written, or -1 when the ranks do not fit the tensor (a rank
        beyond its class, or more changed elements than ``positions`` holds).
    """
    n_classes = bound.size
    # per class: the bit of ``words`` of its next member, and the word its bitmap's last two start at
    cursor, stop = np.empty(n_classes, np.uint64), np.empty(n_classes, np.uint64)
    for c in range(n_classes):
        cursor[c] = np.uint64(first_word[c]) << np.uint64(6)
        stop[c] = np.uint64(first_word[c] + ((bound[c] + 63) >> 6))
    # the same for the dense classes, by their slot, while whole blocks are read
    lanes = np.zeros(2 * SLOTS, np.uint64)  # cursor and stop of slot d from 2 * d
    for d in range(dense.size):
        lanes[2 * d], lanes[2 * d + 1] = cursor[dense[d]], stop[dense[d]]
    masks = np.zeros(SLOTS, np.uint64)
    one = np.uint64(1)
    k = 0
    limit = positions.size
    whole = bits.size - bits.size % LANES if dense.size else 0  # elements read a block of masks at a time
    for block in range(0, bits.size, LANES):
        if block < whole:
            _class_members(bits, block, shift, mask, dense, masks)
            events = np.uint64(0)
            for d in range(DENSE):
                at = lanes[2 * d]
                members = masks[d]
                events |= _deposit(_bitmap_at(words, at, lanes[2 * d + 1]), members)
                lanes[2 * d] = at + np.uint64(_popcount(members))
            others = masks[DENSE]
            if block + LANES == whole:  # the last whole block: the classes' cursors leave the slots
                for d in range(DENSE):
                    cursor[dense[d]] = lanes[2 * d]
        else:
            others = (one << np.uint64(bits.size - block)) - one if bits.size - block < LANES else ~np.uint64(0)
            events = np.uint64(0)
        if others:
            events |= _changes_one_at_a_time(others, block, bits, shift, mask, cursor, stop, words)
        # the block's changes, in flat order: mostly none, one or two, written without a branch on their
        # number (a slot past the last change is written and then overwritten), then any others
        if _popcount(events) > limit - k:
            return -1
        if limit - k >= 2:
            for _ in range(2):
                bit = _lowest_bit(events) & (LANES - 1)
                _write_change(block + bit, bits, shift, mask, k, positions, olds, classes, slots, changed, events != 0)
                k += np.int64(events != 0)
                events &= events - one
        while events:
            _write_change(block + _lowest_bit(events), bits, shift, mask, k, positions, olds, classes, slots, changed, True)
            k += 1
            events &= events - one
    for c in range(n_classes):
        if np.int64(cursor[c] - (np.uint64(first_word[c]) << np.uint64(6))) < bound[c]:  # members seen
            return -1  # a coded rank beyond the class's members
    first_slot = np.cumsum(changed) - changed  # a class's first slot: the changes of the classes before it
    for i in range(k):
        slots[i] += first_slot[classes[i]]
    return k
