"""Change detection on the trainer side.

:class:`ChangeDetector` keeps a shadow copy of the last *published* state in the
serving dtype, on the parameters' own device, and compares bit patterns of the
current weights (cast to the serving dtype chunk by chunk) against it. Deltas
are therefore always relative to what replicas hold, so publishing every k
optimizer steps stays exact: sub-threshold updates accumulate in the fp32
master weights until they flip a bf16 bit.

Memory cost: the shadow holds one serving-dtype copy of every parameter (2 bytes
per parameter for bf16) on the parameters' device; detection adds at most
``chunk_elements`` x (serving itemsize + 1 byte mask + 8 bytes per changed index)
of temporary memory, independent of model size.
"""

from __future__ import annotations


from typing import Mapping

import numpy as np
import torch

from .dtypes import bits_to_numpy, int_view
from .errors import SyncError
from .format import Change
from .workers import worker_pool

DEFAULT_CHUNK_ELEMENTS = 1 << 24
CPU_CHUNK_ELEMENTS = 1 << 18  # fits in L2 cache: compare, scan and gather touch memory once


def cast_chunk(chunk: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast a floating-point chunk to the serving dtype; leave other tensors as they are."""
    if dtype is None or not chunk.is_floating_point() or chunk.dtype == dtype:
        return chunk
    return chunk.to(dtype)


def serving_dtype_of(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def serving_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in its serving dtype, on its own device."""
    return cast_chunk(tensor.detach(), dtype).clone().contiguous()


class ChangeDetector:
    """Finds elements whose serving-dtype bits differ from the last published state.

    Args:
        dtype: Serving dtype for floating-point tensors (e.g. ``torch.bfloat16``);
            ``None`` publishes tensors in their own dtype.
        chunk_elements: Elements compared at once; bounds temporary memory.
    """

    def __init__(self, dtype: torch.dtype | None = torch.bfloat16, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        self.dtype = dtype
        self.chunk_elements = chunk_elements
        self.published: dict[str, torch.Tensor] | None = None

    def reset(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take ``state`` (cast to the serving dtype) as the published state."""
        self.published = {name: serving_copy(t, self.dtype) for name, t in state.items()}

    def compatible(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``state`` has the published state's names, shapes and serving dtypes."""
        if self.published is None or state.keys() != self.published.keys():
            return False
        return all(
            t.shape == self.published[n].shape and serving_dtype_of(t, self.dtype) == self.published[n].dtype
            for n, t in state.items()
        )

    def diff(self, state: Mapping[str, torch.Tensor]) -> dict[str, Change]:
        """Changed elements of ``state`` relative to the published state.

        Does not modify the published state; call :meth:`commit` once the delta is published.
        CPU tensors are compared with numpy in cache-sized chunks on a thread pool;
        tensors on an accelerator are compared there with torch.

        Raises:
            SyncError: nothing published yet, or ``state`` is not :meth:`compatible`.
        """
        if not self.compatible(state):
            raise SyncError("state does not match the published state's names, shapes and dtypes; publish an anchor")
        assert self.published is not None
        tasks = []
        for name, tensor in state.items():
            numel = tensor.numel()
            step = self.chunk_elements if tensor.device.type != "cpu" else min(self.chunk_elements, CPU_CHUNK_ELEMENTS)
            tasks += [(name, start, min(start + step, numel)) for start in range(0, numel, step)]

        def run(task):
            name, start, stop = task
            shadow = int_view(self.published[name])[start:stop]
            current = int_view(cast_chunk(state[name].detach().reshape(-1)[start:stop], self.dtype))
            if current.device.type == "cpu":
                old, new = bits_to_numpy(shadow), bits_to_numpy(current)
                idx = np.flatnonzero(old != new)
                return name, idx + start, old[idx], new[idx]
            idx = torch.nonzero(shadow != current).squeeze(1)
            return name, idx.cpu().numpy() + start, bits_to_numpy(shadow[idx]), bits_to_numpy(current[idx])

        parts: dict[str, list] = {}
        for name, idx, old, new in worker_pool().map(run, tasks):
            if idx.size:
                parts.setdefault(name, []).append((idx, old, new))
        changes = {}
        for name, chunks in parts.items():
            shadow = self.published[name]
            changes[name] = Change(
                index=np.concatenate([c[0] for c in chunks]).astype(np.int64, copy=False),
                old_bits=np.concatenate([c[1] for c in chunks]),
                new_bits=np.concatenate([c[2] for c in chunks]),
                dtype=shadow.dtype,
                shape=tuple(shadow.shape),
            )
        return changes

    def commit(self, changes: Mapping[str, Change]) -> None:
        """Write published changes into the shadow copy."""
        assert self.published is not None
        for name, ch in changes.items():
            flat = int_view(self.published[name])
            idx = torch.from_numpy(ch.index).to(flat.device)
            new = torch.from_numpy(ch.new_bits.view(np.dtype(f"int{8 * ch.new_bits.itemsize}"))).to(flat.device)
            flat[idx] = new
