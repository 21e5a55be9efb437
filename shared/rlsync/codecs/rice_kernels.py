"""Compiled kernels of the ``classrice`` codec (numba, CPU): ranks within exponent classes, and
Golomb-Rice coding of gaps.

Each kernel is one pass over its input and allocates nothing it was not given, so the codec's
memory stays bounded by its arguments. They are compiled on first use and cached on disk
(``NUMBA_CACHE_DIR`` picks the folder where the package's own is not writable).
"""

from __future__ import annotations

import numba
import numpy as np

_JIT = dict(cache=True, nogil=True, boundscheck=False)
#: Bits of the window remainders are read from: a remainder of up to ``WINDOW_BITS - 8`` bits at any bit offset.
WINDOW_BITS = 48


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


@numba.njit(**_JIT)
def class_positions(bits, shift, mask, starts, ends, coded, inverted, positions, olds, classes, ordinals, changed):  # pragma: no cover
    """Inverse of :func:`class_ranks`: flat positions of the changed elements, in flat order.

    One pass over the old bits; per element one countdown of its class (the members still to
    pass before the class's next coded rank) and one branch that is rarely taken, so the pass
    costs about as much as a histogram of the classes.

    Args:
        bits: The old bit patterns of the whole tensor (signed ints).
        shift, mask: The dtype's exponent field.
        starts, ends: Per class, the slice of ``coded`` holding its strictly increasing ranks.
        coded: Per class the ranks of its changed elements, or of its unchanged ones where
            ``inverted`` is set.
        inverted: Per class, 1 when ``coded`` lists the unchanged elements.
        positions: Out: flat positions, increasing.
        olds: Out: the old bit pattern at each position.
        classes: Out: each position's class.
        ordinals: Out: each position's number of changed elements of its class before it.
        changed: Out, zeroed, one slot per class: its number of changed elements.

    Returns:
        The number of positions written, or -1 when the ranks do not fit the tensor (a rank
        beyond its class, ranks not increasing, or more changed elements than ``positions`` holds).
    """
    n_classes = starts.size
    never = np.int64(1) << 62
    left = np.full(n_classes, never, np.int64)  # members to pass before the class's next event
    seen = np.zeros(n_classes, np.int64)  # members seen, kept for inverted classes only
    nxt = starts.copy()
    for c in range(n_classes):
        if inverted[c] != 0:
            left[c] = 0  # every member of an inverted class is an event
        elif starts[c] < ends[c]:
            left[c] = coded[starts[c]]
    k = 0
    limit = positions.size
    for i in range(bits.size):
        c = (bits[i] >> shift) & mask
        countdown = left[c] - 1
        if countdown >= 0:
            left[c] = countdown
            continue
        if inverted[c] != 0:  # a coded rank is an unchanged member, any other member changed
            r = seen[c]
            seen[c] = r + 1
            p = nxt[c]
            if p < ends[c] and coded[p] == r:
                nxt[c] = p + 1
                continue
        else:  # the class's next coded rank
            p = nxt[c] + 1
            nxt[c] = p
            if p < ends[c]:
                gap = coded[p] - coded[p - 1] - 1
                if gap < 0:
                    return -1
                left[c] = gap
            else:
                left[c] = never
        if k == limit:
            return -1
        positions[k] = i
        olds[k] = bits[i]
        classes[k] = c
        ordinals[k] = changed[c]
        changed[c] += 1
        k += 1
    for c in range(n_classes):
        if nxt[c] != ends[c]:
            return -1
    return k


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


@numba.njit(**_JIT)
def rice_decode(unary, unary_bit, rem, rem_bit, k, count, bound, out):  # pragma: no cover - compiled
    """Read ``count`` Rice-coded gaps (see :func:`rice_encode`) into ``out`` as increasing ranks.

    Quotients are read a byte at a time (a zero byte is 8 units at once) and remainders from a
    :data:`WINDOW_BITS` window. A quotient above ``bound >> k`` codes a rank beyond ``bound``
    whatever its remainder, so it is refused before ``q << k`` is formed: with
    ``k <= WINDOW_BITS - 8`` and ``bound < 2**62`` every value stays in range, and a hostile
    stream costs time linear in its size.

    Returns:
        ``(unary_bit, rem_bit)`` after the last gap, or ``(-1, -1)`` when the streams end early,
        ``k`` is outside ``0..WINDOW_BITS - 8`` or a rank reaches ``bound``.
    """
    if k < 0 or k > WINDOW_BITS - 8:
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
            off = unary_bit & 7
            byte = (np.int64(unary[unary_bit >> 3]) << off) & 0xFF
            if byte == 0:  # the rest of this byte is zeros
                q += 8 - off
                unary_bit += 8 - off
                if q > qmax:
                    return -1, -1
                continue
            while byte < 0x80:
                byte <<= 1
                q += 1
                unary_bit += 1
            unary_bit += 1  # the terminating one
            break
        if q > qmax or rem_bit + k > n_rem:
            return -1, -1
        r = np.int64(0)
        if k:
            at = rem_bit >> 3
            window = np.int64(0)
            for j in range(WINDOW_BITS // 8):  # the bit offset (<= 7) and k bits
                window <<= 8
                if at + j < rem.size:
                    window |= np.int64(rem[at + j])
            r = (window >> (WINDOW_BITS - (rem_bit & 7) - k)) & low
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
