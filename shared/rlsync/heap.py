"""Giving a decoded update's freed memory back to the operating system before the next one.

A delta decodes into many tensors of a few to a few tens of MB (positions, new and old values).
glibc's allocator serves most of them from its heaps, and once they are freed keeps the pages
resident for reuse: after AdamW's first steps, whose deltas change several times more elements than
later ones, a replica's RSS would stay at the first delta's high-water mark for the rest of the run
(Qwen3-0.6B at lr 3e-6: +0.7 GB). :func:`trim_heap` (glibc's ``malloc_trim(0)``) returns every free
whole page of every heap; a subscriber calls it (:func:`trim_heap_after`) before it decodes the next
update, off the pause, when the last one decoded at least :data:`TRIM_AFTER_BYTES` and more than
twice what the next needs. Otherwise the next decode reuses the freed pages: pages given back are
faulted in again, zeroed, by the next decode (about a tenth of a 0.6B model's decode at 2% changed). A trim walks every
free chunk of every heap, holding that heap's lock while it does: in a large, fragmented heap of a busy
process (a test session, a trainer beside its replica) that can hold up every other thread's
allocations, so it runs only where it returns pages that matter. It does nothing off glibc.
"""

from __future__ import annotations

import ctypes
import sys

#: A decoded update of at least this many bytes is followed by a trim; smaller ones leave too little behind.
TRIM_AFTER_BYTES = 64 << 20

_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only (musl has none)


def trim_heap() -> bool:
    """Return the allocator's free pages to the operating system.

    Returns:
        Whether any memory was released (``False`` also off glibc).
    """
    return bool(_malloc_trim(0)) if _malloc_trim is not None else False


def trim_heap_after(decoded_bytes: int, *, needed_bytes: int = 0) -> bool:
    """:func:`trim_heap` once an update of ``decoded_bytes`` (its positions, new and old values) is freed,
    if it was at least :data:`TRIM_AFTER_BYTES` and more than twice ``needed_bytes``, what the next
    update will decode (as estimated by the caller; 0 for one that does not reuse them, e.g. an anchor).

    Returns:
        Whether any memory was released.
    """
    return trim_heap() if decoded_bytes >= max(TRIM_AFTER_BYTES, 2 * needed_bytes + 1) else False
