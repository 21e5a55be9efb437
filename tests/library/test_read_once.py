"""An anchor's file pages leave the replica's RSS as they are hashed and copied, and the bytes stay the same."""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.protocol.subscriber import SCRATCH_PREFIX
from rlsync.read_once import FileMappings, read_once
from tests.helpers import bf16

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are released on Linux only")

ELEMENTS = 1 << 23  # 16 MB of bf16


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s pages mapped in this process now (present bits of /proc/self/pagemap)."""
    page, lo = mmap.PAGESIZE, tensor.data_ptr()
    first, last = lo // page, (lo + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    return page * sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", data))


def _scratch_rss() -> int:
    """Resident bytes of this process's mappings of anchor scratch files (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and SCRATCH_PREFIX in fields[5]
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_read_once_releases_a_file_view_and_its_bytes_read_back_the_same(tmp_path):
    original = torch.randn(ELEMENTS).to(torch.bfloat16)
    path = tmp_path / "a.safetensors"
    safetensors.torch.save_file({"a": original}, path)
    view = safetensors.torch.load_file(path)["a"]
    assert torch.equal(view, original)  # every page read: resident
    assert _resident_bytes(view) >= view.numel() * 2 - 2 * mmap.PAGESIZE
    mappings = FileMappings()
    assert mappings.contains(view)
    for _start, _part in read_once(view, mappings, elements=1 << 20):
        pass
    assert _resident_bytes(view) <= 2 * mmap.PAGESIZE  # at most the two partial pages at its ends
    assert torch.equal(view, original)  # faulted back in from the file: the same bytes


def test_anonymous_memory_is_never_released():
    tensor = torch.randn(ELEMENTS).to(torch.bfloat16)
    before = tensor.clone()
    mappings = FileMappings()
    assert not mappings.contains(tensor)
    for _start, _part in read_once(tensor, mappings, elements=1 << 20):
        pass
    assert torch.equal(tensor, before)  # MADV_DONTNEED on anonymous memory would have zeroed it


def test_subscriber_anchor_keeps_no_resident_copy_of_its_files(bucket, tmp_path):
    state = {f"w{i}": torch.randn(1 << 21) * 0.02 for i in range(8)}  # 32 MB in bf16
    Publisher(bucket, policy=FixedInterval(1000)).publish(0, state)
    weights = {name: torch.zeros(t.shape, dtype=torch.bfloat16) for name, t in state.items()}
    sub = Subscriber(bucket, weights=weights, workdir=tmp_path)
    update = sub.fetch()
    assert update.kind == "anchor"
    anchor_bytes = sum(t.numel() * t.element_size() for t in update.tensors.values())
    assert _scratch_rss() < anchor_bytes / 8  # hashed: the file's pages left as they were read
    views = dict(update.tensors)  # keeps the files mapped past apply, to see what the copy left resident
    sub.apply(update)
    assert _scratch_rss() < anchor_bytes / 8  # copied into the weights the same way
    del views
    assert state_hash(weights) == state_hash(bf16(state)) == sub.state_hash
