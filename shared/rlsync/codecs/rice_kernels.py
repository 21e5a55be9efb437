"""Compiled kernels of the ``classrice`` codec (numba, CPU): ranks within exponent classes, and
Golomb-Rice coding of gaps.

Each kernel is one pass over its input and allocates nothing it was not given, so the codec's
memory stays bounded by its arguments. They are compiled on first use and cached on disk
(``NUMBA_CACHE_DIR`` picks the folder where the package's own is not writable).
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..cpu import CpuFeature, has_feature

_JIT = dict(cache=True, nogil=True, boundscheck=False)
#: The largest Rice parameter the decoder reads: a remainder of up to 56 bits at any bit offset fits one 64-bit window.
MAX_K = 56
#: Elements per block of :func:`class_positions`: one bit each in a ``uint64`` mask.
LANES = 64
#: Classes whose members :func:`class_positions` finds a block at a time (the rest one at a time).
DENSE = 12
#: Whether a vector of comparisons cast to an integer puts its first element in the lowest bit
#: (little-endian targets); elsewhere :func:`class_positions` takes every element one at a time.
MASKS_IN_ORDER = sys.byteorder == "little"
#: Whether the compiled code runs on this machine's x86-64 CPU with BMI2, whose ``pdep`` picks a mask's k-th set
#: bit in one instruction (:func:`_select_by_deposit`); elsewhere a branch-free binary search does.
HAS_PDEP = numba.config.CPU_NAME in (None, "host") and has_feature(CpuFeature.BMI2)
NEVER = np.int64(1) << 62  # "no further coded rank in this class"


@numba.njit(**_JIT)
def class_ranks(bits, shift, mask, index, ranks, classes, members):  # pragma: no cover - compiled
    """Rank within its class, and class, of each element at sorted flat positions ``index``.

    Args:
        bits: The old bit patterns of the whole tensor (signed ints).
        shift, mask: The dtype's exponent field.
        index: Strictly increasing flat positions.
        ranks: Out: each element's number of same-class elements before it.
        classes: Out: each element's class.
        members: Out, zeroed, one slot per class: the class sizes over the whole tensor.
    """
    # Four interleaved histograms: neighbours often share a class, and one histogram would make
    # every increment wait for the previous one.
    n_classes = members.size
    counts = np.zeros((4, n_classes), np.int64)
    start = 0
    for k in range(index.size + 1):
        stop = index[k] if k < index.size else bits.size
        i = start
        while i + 4 <= stop:
            counts[0, (bits[i] >> shift) & mask] += 1
            counts[1, (bits[i + 1] >> shift) & mask] += 1
            counts[2, (bits[i + 2] >> shift) & mask] += 1
            counts[3, (bits[i + 3] >> shift) & mask] += 1
            i += 4
        while i < stop:
            counts[0, (bits[i] >> shift) & mask] += 1
            i += 1
        if k < index.size:
            c = (bits[stop] >> shift) & mask
            ranks[k] = counts[0, c] + counts[1, c] + counts[2, c] + counts[3, c]
            classes[k] = c
            counts[0, c] += 1
            start = stop + 1
    for c in range(n_classes):
        members[c] = counts[0, c] + counts[1, c] + counts[2, c] + counts[3, c]


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - compiled
    """Set bits of a ``uint64``, as an ``int64``."""

    def codegen(context, builder, signature, args):
        return builder.call(builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)]), args)

    return types.int64(types.uint64), codegen


def _zero_count(name: str, llvm_name: str, doc: str):
    """An intrinsic that counts the zero bits of a nonzero ``uint64`` with LLVM's ``llvm_name``
    (``llvm.cttz``: below its lowest set bit, ``llvm.ctlz``: above its highest), as an ``int64``."""

    def typer(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            count = builder.module.declare_intrinsic(llvm_name, [ir.IntType(64), ir.IntType(1)])
            return builder.call(count, [args[0], ir.Constant(ir.IntType(1), 0)])

        return types.int64(types.uint64), codegen

    typer.__name__, typer.__qualname__, typer.__doc__ = name, name, doc
    return intrinsic(typer)


_lowest_bit = _zero_count("_lowest_bit", "llvm.cttz", "Index of the lowest set bit of a nonzero ``uint64``.")
_leading_zeros = _zero_count("_leading_zeros", "llvm.ctlz", "Zero bits above the highest set bit of a nonzero ``uint64``.")


@intrinsic
def _class_masks(typingctx, bits, start, shift, mask, dense, out):  # pragma: no cover - compiled
    """``out[k]``: bit ``j`` set where the class ``(bits[start + j] >> shift) & mask`` is ``dense[k]``,
    for the :data:`LANES` elements from ``start`` and each of the :data:`DENSE` classes (``mask <= 0xFF``).

    One vector load, shift and mask of the block, then one vector comparison per class: what a
    compiled loop over the elements did not vectorize.
    """
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (bits, dense, out)):
        return None  # the vector is read from the data pointer: contiguous arrays only

    def codegen(context, builder, signature, args):
        bits_type, _, _, _, dense_type, out_type = signature.args
        data = context.make_array(bits_type)(context, builder, args[0]).data
        classes = context.make_array(dense_type)(context, builder, args[4]).data
        masks = context.make_array(out_type)(context, builder, args[5]).data
        lane, i32, i64 = ir.IntType(bits_type.dtype.bitwidth), ir.IntType(32), ir.IntType(64)
        wide, narrow = ir.VectorType(lane, LANES), ir.VectorType(ir.IntType(8), LANES)

        def splat(value, vector):
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(i32, 0))
            first = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
            return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), first)

        block = builder.load(builder.bitcast(builder.gep(data, [args[1]]), wide.as_pointer()), align=1)
        block = builder.lshr(block, splat(builder.trunc(args[2], lane), wide))
        block = builder.and_(block, splat(builder.trunc(args[3], lane), wide))
        block = builder.trunc(block, narrow)
        for k in range(DENSE):
            cls = builder.load(builder.gep(classes, [ir.Constant(i64, k)]))
            equal = builder.icmp_unsigned("==", block, splat(cls, narrow))
            builder.store(builder.bitcast(equal, i64), builder.gep(masks, [ir.Constant(i64, k)]))
        return context.get_dummy_value()

    return types.void(bits, types.intp, types.intp, types.intp, dense, out), codegen


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
    dense_left = np.zeros(DENSE, np.int64)
    for d in range(dense.size):
        dense_left[d] = -NEVER if inverted[dense[d]] != 0 else left[dense[d]]
    masks = np.zeros(DENSE, np.uint64)
    event_class = np.zeros(LANES, np.int64)  # per bit of a block's changes: class and ordinal in it
    event_ordinal = np.zeros(LANES, np.int64)
    one = np.uint64(1)
    k = 0
    limit = positions.size
    whole = bits.size - bits.size % LANES if dense.size else 0  # elements read a block of masks at a time
    for block in range(0, bits.size, LANES):
        if block < whole:
            _class_masks(bits, block, shift, mask, dense, masks)
            others = ~np.uint64(0)
            hits = np.uint64(0)
            for d in range(DENSE):  # the common case: count the members, no change among them
                others &= ~masks[d]
                todo = dense_left[d] - _popcount(masks[d])
                dense_left[d] = todo
                hits |= np.uint64(todo < 0) << np.uint64(d)
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


@numba.njit(**_JIT)
def add_differences(planes, signs, olds, slots, out):  # pragma: no cover - compiled
    """New bit patterns from old ones and ``classgap``'s value streams, checked as they are read.

    Args:
        planes: The differences' magnitudes minus one, as byte planes (low byte first): ``out.itemsize``
            planes of ``slots.size`` bytes.
        signs: One bit per difference (low bit first), set where it is negative; zero padding after.
        olds: The old bit pattern at each position (ints of ``out``'s width).
        slots: Each position's difference (a permutation of ``0..slots.size - 1``).
        out: Out: each position's new bit pattern, the old one plus its wrapping difference.

    Returns:
        0, or the fault (:class:`~rlsync.codecs.classgap.ValueFault`): 1 where a magnitude does not fit
        the dtype's signed range, 2 where a padding bit after the last sign is set.
    """
    count = slots.size
    for b in range(count, signs.size * 8):
        if (signs[b >> 3] >> (b & 7)) & 1:
            return 2
    width = out.itemsize
    top = np.uint64(1) << np.uint64(8 * width - 1)
    for i in range(count):
        s = slots[i]
        magnitude = np.uint64(0)
        for plane in range(width):
            magnitude |= np.uint64(planes[plane * count + s]) << np.uint64(8 * plane)
        if magnitude >= top:
            return 1
        step = magnitude + np.uint64(1)
        if (signs[s >> 3] >> (s & 7)) & 1:
            step = np.uint64(0) - step
        out[i] = np.uint64(olds[i]) + step  # wraps, and keeps the low bits of the dtype's width
    return 0


@numba.njit(**_JIT)
def rice_cost(gaps, max_k):  # pragma: no cover - compiled
    """Bits of each Rice parameter ``0..max_k`` for ``gaps``, as an array."""
    cost = np.zeros(max_k + 1, np.int64)
    for g in gaps:
        for k in range(max_k + 1):
            cost[k] += (g >> k) + 1 + k
    return cost


@numba.njit(**_JIT)
def rice_encode(gaps, k, unary, unary_bit, rem, rem_bit):  # pragma: no cover - compiled
    """Append ``gaps`` Rice-coded with parameter ``k``: quotients in unary (zeros ended by a one)
    to ``unary``, remainders (``k`` bits, high bit first) to ``rem``; both zeroed, bit offsets given.

    Returns:
        The two bit offsets after the last gap.
    """
    low = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    for g in gaps:
        q = g >> np.uint64(k)
        unary_bit += np.int64(q)
        unary[unary_bit >> 3] |= np.uint8(0x80 >> (unary_bit & 7))
        unary_bit += 1
        r = g & low
        for j in range(k - 1, -1, -1):
            if (r >> np.uint64(j)) & np.uint64(1):
                rem[rem_bit >> 3] |= np.uint8(0x80 >> (rem_bit & 7))
            rem_bit += 1
    return unary_bit, rem_bit


@numba.njit(**_JIT, inline="always")
def _window(stream, bit):  # pragma: no cover - compiled
    """The 64 bits of ``stream`` from bit ``bit`` on (high bit first), as a ``uint64``: at least
    ``64 - 7`` of them read from the stream, zeros past its end and in the low ``bit % 8`` bits."""
    at = bit >> 3
    word = np.uint64(0)
    if at + 8 <= stream.size:
        for j in range(8):  # one load and a byte swap, once compiled
            word = (word << np.uint64(8)) | np.uint64(stream[at + j])
    else:
        for j in range(8):
            word <<= np.uint64(8)
            if at + j < stream.size:
                word |= np.uint64(stream[at + j])
    return word << np.uint64(bit & 7)


@numba.njit(**_JIT)
def rice_decode(unary, unary_bit, rem, rem_bit, k, count, bound, out):  # pragma: no cover - compiled
    """Read ``count`` Rice-coded gaps (see :func:`rice_encode`) into ``out`` as increasing ranks.

    Quotients and remainders are read from 64-bit windows (:func:`_window`; a quotient's zeros
    counted by the window's leading zeros). A quotient above ``bound >> k`` codes a rank beyond
    ``bound`` whatever its remainder, so it is refused before ``q << k`` is formed: with
    ``k <= MAX_K`` and ``bound < 2**62`` every value stays in range, and a hostile
    stream costs time linear in its size.

    Returns:
        ``(unary_bit, rem_bit)`` after the last gap, or ``(-1, -1)`` when the streams end early,
        ``k`` is outside ``0..MAX_K`` or a rank reaches ``bound``.
    """
    if k < 0 or k > MAX_K:
        return -1, -1
    n_unary = unary.size * 8
    n_rem = rem.size * 8
    last = np.int64(-1)
    qmax = bound >> k
    low = (np.int64(1) << k) - 1
    for i in range(count):
        q = np.int64(0)
        while True:
            if unary_bit >= n_unary:
                return -1, -1
            window = _window(unary, unary_bit)
            if window == 0:  # the window's bits read from the stream are all zeros
                q += 64 - (unary_bit & 7)
                unary_bit += 64 - (unary_bit & 7)
                if q > qmax:
                    return -1, -1
                continue
            zeros = _leading_zeros(window)  # a one read from the stream ends the quotient
            q += zeros
            unary_bit += zeros + 1
            break
        if q > qmax or rem_bit + k > n_rem:
            return -1, -1
        r = np.int64(0)
        if k:
            r = np.int64(_window(rem, rem_bit) >> np.uint64(64 - k)) & low
            rem_bit += k
        last = last + 1 + ((q << k) | r)
        if last >= bound:
            return -1, -1
        out[i] = last
    return unary_bit, rem_bit


@numba.njit(**_JIT)
def rice_decode_classes(unary, rem, ks, counts, bound, out):  # pragma: no cover - compiled
    """:func:`rice_decode` of every class of a tensor in one call: class ``c``'s ``counts[c]`` ranks,
    coded with parameter ``ks[c]``, follow the previous classes' in both streams and in ``out``.

    Returns:
        ``(unary_bit, rem_bit)`` after the last class, or ``(-1, -1)`` as :func:`rice_decode`.
    """
    unary_bit = rem_bit = np.int64(0)
    offset = 0
    for c in range(ks.size):
        unary_bit, rem_bit = rice_decode(unary, unary_bit, rem, rem_bit, ks[c], counts[c], bound, out[offset : offset + counts[c]])
        if unary_bit < 0:
            return -1, -1
        offset += counts[c]
    return unary_bit, rem_bit
