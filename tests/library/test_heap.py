"""A subscriber gives the freed pages of a large decoded update back before it decodes the next."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlsync.heap import trim_heap
from rlsync.protocol import FixedInterval, Publisher, Subscriber

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")

_FREED_HEAP = r"""
import ctypes
from pathlib import Path
from rlsync.heap import trim_heap

libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 1 MB blocks come from the heap, as a delta's tensors do
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() never gives pages back by itself
libc.malloc.restype = ctypes.c_void_p
rss = lambda: next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")) << 10
blocks = [libc.malloc(1 << 20) for _ in range(256)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
top = libc.malloc(64)  # keeps the heap's top in use: only a trim reaches the freed pages below it
for b in blocks:
    libc.free(ctypes.c_void_p(b))
before = rss()
released = trim_heap()
print(released, before - rss())
"""


def test_trim_heap_returns_freed_heap_pages_to_the_system():
    out = subprocess.run([sys.executable, "-c", _FREED_HEAP], capture_output=True, text=True, check=True)
    released, dropped = out.stdout.split()
    assert released == "True" and int(dropped) > 200 << 20  # of the 256 MB freed


def test_the_subscriber_trims_before_an_update_once_a_large_decoded_delta_is_freed(bucket, monkeypatch):
    """A trim before a delta that needs less than half of the freed one (AdamW's first dense deltas, then
    sparser ones); none before one that reuses the freed pages (as large), none after tiny deltas."""
    import rlsync.heap as heap

    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or trim_heap())
    state = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    pub = Publisher(bucket, policy=FixedInterval(100))
    pub.publish(0, state)
    for step, changed in ((1, 40), (2, 2), (3, 2), (4, 5)):
        state["w"][:changed] += 1.0
        pub.publish(step, state)
    assert [u.kind for u in Subscriber(bucket).sync()] == ["anchor", "delta", "delta", "delta", "delta"] and calls == []  # tiny
    monkeypatch.setattr(heap, "TRIM_AFTER_BYTES", 1)
    sub = Subscriber(bucket)
    sub.sync()
    assert len(calls) == 1  # before the second delta (2 changed after 40), not the third (2 after 2) or fourth (5 after 2)
    sub.sync()  # up to date: nothing decoded, nothing trimmed
    assert len(calls) == 1
