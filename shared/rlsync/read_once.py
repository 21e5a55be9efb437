"""Reading a file-mapped tensor once without keeping it resident.

safetensors' ``load_file`` returns views of a private memory mapping of the file. Reading every
element of such a view (hashing an anchor, copying it into the weights) makes each page resident,
counted in the process's RSS until the mapping goes: reading a whole anchor would hold a second copy
of the model in RSS beside the weights it is copied into. :func:`read_once` walks a tensor a slice
at a time and, once the caller is done with a slice, tells the kernel its pages are no longer needed
(``madvise(MADV_DONTNEED)``): they leave the process. The file's pages stay in the page cache, and
reading the slice again faults the same bytes back in (a page of a private mapping that was never
written reverts to the file's contents; nothing here writes into the views).

Only whole pages inside a private file mapping are released (found in ``/proc/self/maps``);
anonymous memory, where ``MADV_DONTNEED`` would zero the data, is never touched, nor is anything
off Linux or off the CPU.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

#: Elements read between two releases (64 MB of bf16): the most of a file kept resident at a time.
SLICE_ELEMENTS = 1 << 25
_MAPS = Path("/proc/self/maps")
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class FileMappings:
    """This process's private file mappings (address ranges), as they are when created."""

    def __init__(self) -> None:
        ranges: list[tuple[int, int]] = []
        if _libc is not None and _MAPS.is_file():
            for line in _MAPS.read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1].endswith("p") and fields[4] != "0":  # private, backed by a file
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((lo, hi))
        ranges.sort()
        self._starts = [lo for lo, _ in ranges]
        self._ranges = ranges

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor``'s bytes lie inside one private file mapping."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return False
        lo = tensor.data_ptr()
        i = bisect.bisect_right(self._starts, lo) - 1
        return i >= 0 and lo + tensor.numel() * tensor.element_size() <= self._ranges[i][1]

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the resident whole pages of ``tensor`` (a view of a private file mapping that was never
        written), if it lies inside one; otherwise do nothing."""
        if not self.contains(tensor):
            return
        lo = tensor.data_ptr()
        start = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (lo + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)  # best effort


def read_once(
    tensor: torch.Tensor, mappings: FileMappings, elements: int = SLICE_ELEMENTS
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, slice)`` over ``tensor``'s flat elements, ``elements`` at a time; each slice's pages
    are released (:meth:`FileMappings.release`) when the caller asks for the next one.

    Args:
        tensor: The tensor to read (a view of a file mapping, or any tensor: then nothing is released).
        mappings: The process's file mappings, taken after the tensor was mapped.
        elements: Elements per slice.
    """
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), elements):
        part = flat[start : start + elements]
        yield start, part
        mappings.release(part)
