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
from ..bitops import lowest_bit as _lowest_bit
from ..bitops import popcount as _popcount

_JIT = dict(cache=True, nogil=True, boundscheck=False)
NEVER = np.int64(1) << 62  # "no further coded rank in this class"


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


@intrinsic
def _deposit(typingctx, x, m):  # pragma: no cover - compiled
    """BMI2's ``pdep``: the low bits of ``x`` placed, in order, at the set bits of ``m`` (both ``uint64``)."""

    def codegen(context, builder, signature, args):
        pdep = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        return builder.call(builder.module.declare_intrinsic("llvm.x86.bmi.pdep.64", fnty=pdep), args)

    return types.uint64(types.uint64, types.uint64), codegen


@numba.njit(**_JIT, inline="always")
def _select_by_deposit(members, k):  # pragma: no cover - compiled
    """:func:`_select_by_search` in one instruction, where the CPU has ``pdep``."""
    return _deposit(np.uint64(1) << np.uint64(k), members)


_select = _select_by_deposit if HAS_PDEP else _select_by_search


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
def _next_gap(coded, nxt, ends, c):  # pragma: no cover - compiled
    """Move class ``c`` (not inverted) past its current coded rank; returns the members to pass before
    its next one (:data:`NEVER` after its last), or -1 when its ranks do not increase."""
    p = nxt[c] + 1
    nxt[c] = p
    if p < ends[c]:
        return coded[p] - coded[p - 1] - 1  # -1 or less: not increasing
    return NEVER


@numba.njit(**_JIT, inline="always")
def _record(c, bit, changed, event_class, event_ordinal):  # pragma: no cover - compiled
    """Note a change of class ``c`` at ``bit`` of the block (its ordinal: the class's changes before it)."""
    event_class[bit] = c
    event_ordinal[bit] = changed[c]
    changed[c] += 1


@numba.njit(**_JIT, inline="always")
def _changes_of_class(members, todo, c, coded, nxt, ends, changed, event_class, event_ordinal):  # pragma: no cover
    """The changed ones among ``members`` (a block's members of class ``c``, not inverted), the first
    after ``todo`` others; returns them and the members to pass after the block (-1: ranks not increasing)."""
    found = np.uint64(0)
    count = _popcount(members)
    while todo < count:
        member = _select(members, todo)
        members &= ~(member - np.uint64(1))  # it and the members after it
        members ^= member
        found |= member
        _record(c, _lowest_bit(member), changed, event_class, event_ordinal)
        todo = _next_gap(coded, nxt, ends, c)
        if todo < 0:
            return found, np.int64(-1)
        count = _popcount(members)
    return found, todo - count


@numba.njit(**_JIT, inline="always")
def _changes_of_inverted(members, c, seen, coded, nxt, ends, changed, event_class, event_ordinal):  # pragma: no cover
    """The changed ones among ``members`` (a block's members of class ``c``, inverted: every member but
    the coded ranks); returns them and whether the coded ranks increase."""
    count = _popcount(members)
    first = seen[c]  # rank of the block's first member of the class
    seen[c] = first + count
    p, rank, kept = nxt[c], first, members
    while p < ends[c] and coded[p] < first + count:  # an unchanged member in this block
        if coded[p] < rank:
            return np.uint64(0), False  # not increasing, or a rank already passed
        unchanged = _select(kept, coded[p] - rank)
        members ^= unchanged
        kept &= ~(unchanged - np.uint64(1))  # the members after it
        kept ^= unchanged
        rank = coded[p] + 1
        p += 1
    nxt[c] = p
    found = members
    while members:
        _record(c, _lowest_bit(members), changed, event_class, event_ordinal)
        members &= members - np.uint64(1)
    return found, True


@numba.njit(**_JIT, inline="always")
def _changes_one_at_a_time(  # pragma: no cover - compiled
    todo_bits, block, bits, shift, mask, left, seen, inverted, coded, nxt, ends, changed, event_class, event_ordinal
):
    """The changed ones among the elements ``todo_bits`` of a block, taken one at a time; returns them,
    and whether the coded ranks increase."""
    found = np.uint64(0)
    while todo_bits:
        bit = _lowest_bit(todo_bits)
        todo_bits &= todo_bits - np.uint64(1)
        c = (bits[block + bit] >> shift) & mask
        todo = left[c]
        if todo > 0:
            left[c] = todo - 1
            continue
        if inverted[c] != 0:  # a coded rank is an unchanged member, any other member changed
            r = seen[c]
            seen[c] = r + 1
            p = nxt[c]
            if p < ends[c] and coded[p] == r:
                nxt[c] = p + 1
                continue
        else:  # the class's next coded rank
            todo = _next_gap(coded, nxt, ends, c)
            if todo < 0:
                return found, False
            left[c] = todo
        found |= np.uint64(1) << np.uint64(bit)
        _record(c, bit, changed, event_class, event_ordinal)
    return found, True


@numba.njit(**_JIT)
def class_positions(  # pragma: no cover - compiled
    bits, shift, mask, dense, starts, ends, coded, inverted, positions, olds, classes, slots, changed
):
    """Inverse of :func:`class_ranks`: flat positions of the changed elements, in flat order.

    One pass over the old bits, :data:`LANES` elements at a time. The block's members of each of
    the ``dense`` classes come as one bit mask (:func:`_class_masks`), so a class whose next coded
    rank is not in the block costs one count of its members; the members of every other class are
    taken one at a time. Per class, ``left`` counts the members still to pass before its next
    coded rank; a class whose coded ranks list its unchanged members ("inverted") makes every
    other member a change.

    Args:
        bits: The old bit patterns of the whole tensor (signed ints).
        shift, mask: The dtype's exponent field.
        dense: :data:`DENSE` distinct classes (``uint8``; speed only: any distinct classes give the
            same result), or an empty array to take every element one at a time (``mask > 0xFF``).
        starts, ends: Per class, the slice of ``coded`` holding its strictly increasing ranks.
        coded: Per class the ranks of its changed elements, or of its unchanged ones where
            ``inverted`` is set.
        inverted: Per class, 1 when ``coded`` lists the unchanged elements.
        positions: Out: flat positions, increasing.
        olds: Out: the old bit pattern at each position.
        classes: Out: work space, one per position.
        slots: Out: the slot of each position's value (values are stored class by class, in flat
            order within a class).
        changed: Out, zeroed, one slot per class: its number of changed elements.

    Returns:
        The number of positions written, or -1 when the ranks do not fit the tensor (a rank
        beyond its class, ranks not increasing, or more changed elements than ``positions`` holds).
    """
    n_classes = starts.size
    left = np.full(n_classes, NEVER, np.int64)  # members to pass before the class's next change
    seen = np.zeros(n_classes, np.int64)  # members seen, kept for inverted classes only
    nxt = starts.copy()
    for c in range(n_classes):
        if inverted[c] != 0:
            left[c] = 0  # every member of an inverted class is a change, but for its coded ranks
        elif starts[c] < ends[c]:
            left[c] = coded[starts[c]]
    # a dense class's ``left`` is kept by its slot in ``dense`` while whole blocks are read; an
    # inverted one's is below zero whatever the block, so that every block looks at its members
    dense_left = np.zeros(SLOTS, np.int64)
    for d in range(dense.size):
        dense_left[d] = -NEVER if inverted[dense[d]] != 0 else left[dense[d]]
    masks = np.zeros(SLOTS, np.uint64)
    event_class = np.zeros(LANES, np.int64)  # per bit of a block's changes: class and ordinal in it
    event_ordinal = np.zeros(LANES, np.int64)
    one = np.uint64(1)
    k = 0
    limit = positions.size
    whole = bits.size - bits.size % LANES if dense.size else 0  # elements read a block of masks at a time
    for block in range(0, bits.size, LANES):
        if block < whole:
            # the common case: the dense classes' members counted, no change among them
            hits = _class_masks(bits, block, shift, mask, dense, masks, dense_left)
            others = masks[DENSE]
            events = np.uint64(0)
            while hits:
                d = _lowest_bit(hits)
                hits &= hits - one
                c = np.int64(dense[d])
                if inverted[c] == 0:
                    todo = dense_left[d] + _popcount(masks[d])
                    found, todo = _changes_of_class(
                        masks[d], todo, c, coded, nxt, ends, changed, event_class, event_ordinal
                    )
                    if todo < 0:
                        return -1
                    dense_left[d] = todo
                else:
                    found, ok = _changes_of_inverted(
                        masks[d], c, seen, coded, nxt, ends, changed, event_class, event_ordinal
                    )
                    if not ok:
                        return -1
                    dense_left[d] = -NEVER
                events |= found
            if block + LANES == whole:  # the last whole block: the classes' state leaves the slots
                for d in range(DENSE):
                    if inverted[dense[d]] == 0:
                        left[dense[d]] = dense_left[d]
        else:
            others = (one << np.uint64(bits.size - block)) - one if bits.size - block < LANES else ~np.uint64(0)
            events = np.uint64(0)
        if others:
            found, ok = _changes_one_at_a_time(
                others, block, bits, shift, mask, left, seen, inverted, coded, nxt, ends, changed,
                event_class, event_ordinal,
            )  # fmt: skip
            if not ok:
                return -1
            events |= found
        # the block's changes, in flat order: mostly none, one or two, written without a branch on their
        # number (a slot past the last change is written and then overwritten), then any others
        if _popcount(events) > limit - k:
            return -1
        if limit - k >= 2:
            for _ in range(2):
                bit = _lowest_bit(events) & (LANES - 1)
                positions[k] = block + bit
                olds[k] = bits[block + bit]
                classes[k] = event_class[bit]
                slots[k] = event_ordinal[bit]
                k += np.int64(events != 0)
                events &= events - one
        while events:
            bit = _lowest_bit(events)
            events &= events - one
            positions[k] = block + bit
            olds[k] = bits[block + bit]
            classes[k] = event_class[bit]
            slots[k] = event_ordinal[bit]
            k += 1
    for c in range(n_classes):
        if nxt[c] != ends[c]:
            return -1
    first_slot = np.cumsum(changed) - changed  # a class's first slot: the changes of the classes before it
    for i in range(k):
        slots[i] += first_slot[classes[i]]
    return k
