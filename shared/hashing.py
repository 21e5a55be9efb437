"""Whole-state hashes: the bit-exactness check of every sync.

The hash of a state is SHA-256 over the tensors in sorted name order, each
contributing its name, safetensors dtype name, shape and a SHA-256 of its raw
bytes (row-major). It depends only on bits, never on float values.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Mapping

import torch

from .dtypes import dtype_name, int_view

HASH_ALGORITHM = "sha256"


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's dtype, shape and raw bytes."""
    h = hashlib.sha256()
    h.update(dtype_name(tensor.dtype).encode())
    h.update(struct.pack(f"<{tensor.dim() + 1}q", tensor.dim(), *tensor.shape))
    if tensor.numel():
        data = int_view(tensor.detach()).cpu().contiguous()
        h.update(data.view(torch.uint8).numpy().data)
    return h.digest()


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """Combine per-tensor digests (see :func:`tensor_digest`) into a state hash."""
    h = hashlib.sha256()
    for name in sorted(digests):
        encoded = name.encode()
        h.update(struct.pack("<q", len(encoded)))
        h.update(encoded)
        h.update(digests[name])
    return h.hexdigest()


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """Hex SHA-256 of a whole state (names, dtypes, shapes and bytes)."""
    return combine_digests({name: tensor_digest(t) for name, t in state.items()})
