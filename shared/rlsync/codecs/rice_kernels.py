"""Compiled kernels of the ``classrice`` codec (numba, CPU): Golomb-Rice coding of gaps, and the values.

The passes over a tensor's exponent classes are :mod:`.class_kernels`'. Each kernel is one pass over
its input and allocates nothing it was not given, so the codec's memory stays bounded by its
arguments. They are compiled on first use and cached on disk (``NUMBA_CACHE_DIR`` picks the folder
where the package's own is not writable).
"""

from __future__ import annotations

import numba
import numpy as np

from ..bitops import leading_zeros as _leading_zeros
from ..bitops import load_be64 as _load_be64

_JIT = dict(cache=True, nogil=True, boundscheck=False)
#: The largest Rice parameter the decoder reads: a remainder of up to 56 bits at any bit offset fits one 64-bit window.
MAX_K = 56


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
        negative = np.uint64((signs[s >> 3] >> (s & 7)) & 1)  # signs are random: negated without a branch
        step = ((magnitude + np.uint64(1)) ^ (np.uint64(0) - negative)) + negative
        out[i] = np.uint64(olds[i]) + step  # wraps, and keeps the low bits of the dtype's width
    return 0


@numba.njit(**_JIT)
def value_streams(olds, news, order, planes, signs):  # pragma: no cover - compiled
    """``classgap``'s value streams, the inverse of :func:`add_differences`: for the ``i``-th element of
    ``order``, the magnitude minus one of its wrapping difference (new bits minus old) as byte planes
    (low byte first) and its sign as bit ``i`` of ``signs`` (set where negative).

    Args:
        olds, news: Old and new bit patterns (unsigned ints of one width).
        order: The elements in the order their values are stored.
        planes: Out: ``olds.itemsize`` planes of ``order.size`` bytes.
        signs: Out, zeroed: one bit per element, low bit first.
    """
    count = order.size
    width = olds.itemsize
    bits = np.uint64(8 * width)
    ones = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * width)
    top = np.uint64(1) << (bits - np.uint64(1))
    for i in range(count):
        j = order[i]
        diff = (np.uint64(news[j]) - np.uint64(olds[j])) & ones
        negative = (diff & top) >> (bits - np.uint64(1))  # signs are random: negated without a branch
        signs[i >> 3] |= np.uint8(negative << np.uint64(i & 7))
        magnitude = (((diff ^ (np.uint64(0) - negative)) + negative) - np.uint64(1)) & ones
        for plane in range(width):
            planes[plane * count + i] = np.uint8((magnitude >> np.uint64(8 * plane)) & np.uint64(0xFF))


@numba.njit(**_JIT)
def group_by_class(classes, order, starts):  # pragma: no cover - compiled
    """A stable counting sort: ``order`` lists the indices of ``classes`` class by class (ascending
    index within a class), and class ``c``'s slice of it is ``starts[c]:starts[c + 1]``.

    Args:
        classes: Each element's class, below ``starts.size - 1``.
        order: Out, one slot per element.
        starts: Out, zeroed, one slot per class and one more.
    """
    for c in classes:
        starts[c + 1] += 1
    for c in range(1, starts.size):
        starts[c] += starts[c - 1]
    at = starts[:-1].copy()
    for i in range(classes.size):
        c = classes[i]
        order[at[c]] = i
        at[c] += 1


@numba.njit(**_JIT, inline="always")
def _rice_bits(gaps, lo, hi, k):  # pragma: no cover - compiled
    """Bits of ``gaps[lo:hi]`` Rice-coded with parameter ``k``."""
    total = np.int64(0)
    for i in range(lo, hi):
        total += np.int64(gaps[i] >> np.uint64(k))
    return total + (hi - lo) * (1 + k)


@numba.njit(**_JIT)
def rice_parameter(gaps, lo, hi, max_k):  # pragma: no cover - compiled
    """The smallest of the Rice parameters ``0..max_k`` that code ``gaps[lo:hi]`` in the fewest bits (0 for none).

    The cost is convex in the parameter (each step up saves the gaps' halved quotients, fewer at each step,
    and costs one bit a gap), so a walk from the mean's bit length finds the first minimum in a few passes.
    """
    if hi == lo:
        return 0
    mean = np.uint64(0)
    for i in range(lo, hi):
        mean += gaps[i]
    mean //= np.uint64(hi - lo)
    k = 0
    while k < max_k and (mean >> np.uint64(k + 1)) != 0:
        k += 1
    cost = _rice_bits(gaps, lo, hi, k)
    moved = False
    while k > 0:
        left = _rice_bits(gaps, lo, hi, k - 1)
        if left > cost:
            break
        k, cost, moved = k - 1, left, True
    while not moved and k < max_k:
        right = _rice_bits(gaps, lo, hi, k + 1)
        if right >= cost:
            break
        k, cost = k + 1, right
    return k


@numba.njit(**_JIT)
def rice_plan(ranks, order, bounds, members, max_k, gaps, ks, counts, inverted):  # pragma: no cover - compiled
    """The gaps and Rice parameter of every coded class of a tensor.

    Class ``j``'s changed elements have the increasing ranks ``ranks[order[bounds[j]:bounds[j + 1]]]``
    among its ``members[j]`` members. Where more than half the members changed, the class is coded
    inverted: the gaps are those of its unchanged members.

    Args:
        gaps: Out, one slot per changed element (an inverted class has fewer gaps than changes): every
            class's gaps, one class after the other.
        ks, counts, inverted: Out, per class: its Rice parameter (:func:`rice_parameter`), its number of
            gaps, and 1 where it is inverted.

    Returns:
        The bits of the unary stream and of the remainders.
    """
    at = 0
    unary_bits = rem_bits = np.int64(0)
    for j in range(bounds.size - 1):
        lo, hi, start = bounds[j], bounds[j + 1], at
        prev = -1
        if 2 * (hi - lo) > members[j]:
            inverted[j] = 1
            p = lo
            for r in range(members[j]):
                if p < hi and ranks[order[p]] == r:
                    p += 1
                    continue
                gaps[at] = r - prev - 1
                prev = r
                at += 1
        else:
            for p in range(lo, hi):
                r = ranks[order[p]]
                gaps[at] = r - prev - 1
                prev = r
                at += 1
        k = rice_parameter(gaps, start, at, max_k)
        ks[j], counts[j] = k, at - start
        unary_bits += _rice_bits(gaps, start, at, k) - (at - start) * k
        rem_bits += (at - start) * k
    return unary_bits, rem_bits


@numba.njit(**_JIT)
def rice_encode(gaps, k, unary, unary_bit, rem, rem_bit):  # pragma: no cover - compiled
    """Append ``gaps`` Rice-coded with parameter ``k`` (at most :data:`MAX_K`): quotients in unary
    (zeros ended by a one) to ``unary``, remainders (``k`` bits, high bit first) to ``rem``; both
    zeroed, bit offsets given.

    Returns:
        The two bit offsets after the last gap.
    """
    low = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    for g in gaps:
        unary_bit += np.int64(g >> np.uint64(k))
        unary[unary_bit >> 3] |= np.uint8(0x80 >> (unary_bit & 7))
        unary_bit += 1
        if k:  # the remainder's bits, high first, OR-ed into the bytes they span
            at, used = rem_bit >> 3, rem_bit & 7
            word = (g & low) << np.uint64(64 - k - used)
            for j in range((used + k + 7) >> 3):
                rem[at + j] |= np.uint8((word >> np.uint64(56 - 8 * j)) & np.uint64(0xFF))
            rem_bit += k
    return unary_bit, rem_bit


@numba.njit(**_JIT)
def rice_write(gaps, ks, counts, unary, rem):  # pragma: no cover - compiled
    """:func:`rice_encode` of every class of :func:`rice_plan`, one after the other, from bit 0."""
    unary_bit = rem_bit = np.int64(0)
    at = 0
    for j in range(ks.size):
        unary_bit, rem_bit = rice_encode(gaps[at : at + counts[j]], ks[j], unary, unary_bit, rem, rem_bit)
        at += counts[j]


@numba.njit(**_JIT, inline="always")
def _window(stream, bit):  # pragma: no cover - compiled
    """The 64 bits of ``stream`` from bit ``bit`` on (high bit first), as a ``uint64``: at least
    ``64 - 7`` of them read from the stream, zeros past its end and in the low ``bit % 8`` bits."""
    at = bit >> 3
    word = np.uint64(0)
    if at + 8 <= stream.size:
        word = _load_be64(stream, at)
    else:
        for j in range(8):
            word <<= np.uint64(8)
            if at + j < stream.size:
                word |= np.uint64(stream[at + j])
    return word << np.uint64(bit & 7)


@numba.njit(**_JIT, inline="always")
def _read_gap(unary, unary_bit, window, fresh, rem, rem_bit, k, qmax):  # pragma: no cover - compiled
    """One Rice-coded gap (see :func:`rice_encode`) read on from bit ``unary_bit`` of ``unary`` and bit
    ``rem_bit`` of ``rem``; ``window`` holds the unary bits from ``unary_bit`` on, ``fresh`` of them read.

    The quotient's zeros are counted by the window's leading zeros, and the window is kept while its
    bits last, so most quotients cost a count and a shift, not a read. A quotient above ``qmax`` is
    refused before ``q << k`` is formed, so every value stays in range and a hostile stream costs time
    linear in its size.

    Returns:
        ``(gap, unary_bit, window, fresh, rem_bit)`` after the gap; ``gap`` is -1 when the streams end
        early or the quotient is above ``qmax``.
    """
    zeros = _leading_zeros(window | np.uint64(1))  # the window's zeros before its first one
    if window != 0 and zeros < fresh:  # the common case: the quotient ends in the window
        q = np.int64(zeros)
        unary_bit += zeros + 1
        window = (window << np.uint64(zeros)) << np.uint64(1)
        fresh -= zeros + 1
    else:  # read on from the stream, 64 bits at a time
        q = np.int64(0)
        while True:
            if unary_bit >= unary.size * 8:
                return np.int64(-1), unary_bit, window, fresh, rem_bit
            window = _window(unary, unary_bit)
            fresh = 64 - (unary_bit & 7)
            if window == 0:  # the window's bits read from the stream are all zeros
                q += fresh
                unary_bit += fresh
                if q > qmax:
                    return np.int64(-1), unary_bit, window, fresh, rem_bit
                continue
            zeros = _leading_zeros(window)  # a one read from the stream ends the quotient
            q += zeros
            unary_bit += zeros + 1
            window = (window << np.uint64(zeros)) << np.uint64(1)
            fresh -= zeros + 1
            break
    if q > qmax or rem_bit + k > rem.size * 8:
        return np.int64(-1), unary_bit, window, fresh, rem_bit
    r = np.int64(0)
    if k:
        r = np.int64(_window(rem, rem_bit) >> np.uint64(64 - k)) & ((np.int64(1) << k) - 1)
        rem_bit += k
    return (q << k) | r, unary_bit, window, fresh, rem_bit


@numba.njit(**_JIT)
def rice_decode(unary, unary_bit, rem, rem_bit, k, count, bound, out):  # pragma: no cover - compiled
    """Read ``count`` Rice-coded gaps (:func:`_read_gap`) into ``out`` as increasing ranks below ``bound``
    (with ``k <= MAX_K`` and ``bound < 2**62``, every value stays in range).

    Returns:
        ``(unary_bit, rem_bit)`` after the last gap, or ``(-1, -1)`` when the streams end early,
        ``k`` is outside ``0..MAX_K`` or a rank reaches ``bound``.
    """
    if k < 0 or k > MAX_K:
        return -1, -1
    last = np.int64(-1)
    window, fresh = np.uint64(0), np.int64(0)
    for i in range(count):
        gap, unary_bit, window, fresh, rem_bit = _read_gap(unary, unary_bit, window, fresh, rem, rem_bit, k, bound >> k)
        if gap < 0:
            return -1, -1
        last = last + 1 + gap
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


@numba.njit(**_JIT)
def rice_bitmaps(unary, rem, ks, counts, classes, inverted, bound, words, first_word, ends):  # pragma: no cover - compiled
    """:func:`rice_decode_classes` straight into one bitmap per class, over its members: the coded rank
    ``r`` of class ``c`` is bit ``r % 64`` of ``words[first_word[c] + r // 64]``, read flipped where the
    class is coded inverted (so a set bit is always a changed member).

    The classes' bitmaps follow each other in ``words``, each as many words as its last rank needs and
    two more, zero (ones where inverted), where every read past its last rank lands. A rank that would
    be written past ``words.size - 2`` is refused before it is written: the last two words stay zero,
    for the classes with no coded ranks (``first_word`` points there, set by the caller).

    Args:
        ks, counts, classes, inverted: Per row of the class table: its Rice parameter, number of
            coded ranks, class and whether it is inverted.
        bound: The tensor's size: every rank is below it.
        words: Out, zeroed.
        first_word: Out, per class: its bitmap's first word (left as given for a class not in the table).
        ends: Out, zeroed, per class: its last coded rank plus one (0 for none).

    Returns:
        ``(unary_bit, rem_bit)`` after the last class, or ``(-1, -1)`` as :func:`rice_decode`, or when
        the bitmaps would not fit ``words``.
    """
    unary_bit = rem_bit = np.int64(0)
    at = np.int64(0)  # the next class's first word
    room = words.size - 2
    for j in range(ks.size):
        k = ks[j]
        if k < 0 or k > MAX_K:
            return -1, -1
        c = classes[j]
        last = np.int64(-1)
        window, fresh = np.uint64(0), np.int64(0)
        for _ in range(counts[j]):
            gap, unary_bit, window, fresh, rem_bit = _read_gap(unary, unary_bit, window, fresh, rem, rem_bit, k, bound >> k)
            if gap < 0:
                return -1, -1
            last = last + 1 + gap
            if last >= bound or at + (last >> 6) + 3 > room:  # the rank's word and the two after it
                return -1, -1
            words[at + (last >> 6)] |= np.uint64(1) << np.uint64(last & 63)
        span = (last + 64) >> 6  # words up to the last rank's
        if at + span + 2 > room:
            return -1, -1
        if inverted[j]:
            for w in range(at, at + span + 2):
                words[w] = ~words[w]
        first_word[c] = at
        ends[c] = last + 1
        at += span + 2
    return unary_bit, rem_bit
