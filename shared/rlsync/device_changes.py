"""Change detection on the tensors' own device (a GPU trainer's path), in three stages.

:class:`~rlsync.detect.ChangeDetector` compares a chunk of the published bits with the current ones
here when the weights live on an accelerator (or when asked to, :class:`ComparePath`, which is how
the tests run this path on the CPU):

1. :func:`compare`: the element-wise bit comparison, on the device;
2. :func:`extract_positions`: the changed positions (``nonzero``) and their old and new bits gathered,
   on the device; positions are 32-bit (a chunk holds fewer than 2^31 elements);
3. :func:`copy_to_host`: only those changed elements cross to the host (4 bytes of position and two
   serving-dtype values per changed element), as the numpy arrays the codecs take.

The stages are separate functions so that a benchmark can time each one
(``benchmarks/gpu_scale_sync.py``); :func:`device_changes` runs them in order.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from .dtypes import bits_to_numpy

__all__ = ["ComparePath", "compare", "copy_to_host", "device_changes", "extract_positions"]

#: Most elements of one compared chunk (its positions are 32-bit).
MAX_CHUNK_ELEMENTS = (1 << 31) - 1


class ComparePath(str, enum.Enum):
    """Where :class:`~rlsync.detect.ChangeDetector` compares bits."""

    #: numpy on the host for CPU tensors; torch on their device for the others (:func:`device_changes`).
    AUTO = "auto"
    #: torch on the tensors' own device whatever it is: the path a GPU trainer takes, also on the CPU.
    DEVICE = "device"


def compare(old_bits: torch.Tensor, new_bits: torch.Tensor) -> torch.Tensor:
    """Stage 1: the mask of the elements whose bits differ (on the bits' device)."""
    return old_bits != new_bits


def extract_positions(
    mask: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2: the changed positions (32-bit) and their old and new bits, still on the device."""
    found = torch.nonzero(mask).squeeze(1)
    return found.to(torch.int32), old_bits[found], new_bits[found]


def copy_to_host(
    positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage 3: the changed elements on the host: positions (int64) and old and new bits (unsigned ints)."""
    return positions.cpu().numpy().astype(np.int64), bits_to_numpy(old_bits), bits_to_numpy(new_bits)


def device_changes(old_bits: torch.Tensor, new_bits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, old bits and new bits of the elements whose bits differ, found on the bits' device.

    Args:
        old_bits: A chunk of the published state's bits (1-D integer view, at most
            :data:`MAX_CHUNK_ELEMENTS` elements).
        new_bits: The same chunk of the current state's bits, on the same device.

    Returns:
        As :func:`rlsync.detect.changed_elements`: 1-D numpy arrays, positions relative to the chunk.
    """
    if old_bits.numel() > MAX_CHUNK_ELEMENTS:
        raise ValueError(f"a chunk of {old_bits.numel()} elements: at most {MAX_CHUNK_ELEMENTS} (32-bit positions)")
    return copy_to_host(*extract_positions(compare(old_bits, new_bits), old_bits, new_bits))
