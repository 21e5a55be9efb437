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


from typing import Iterable, Iterator, Mapping

import numpy as np
import torch

from .device_changes import ComparePath, device_changes
from .dtypes import bits_to_numpy, int_view
from .errors import SyncError
from .format import Change
from .workers import worker_pool

DEFAULT_CHUNK_ELEMENTS = 1 << 24
CPU_CHUNK_ELEMENTS = 1 << 20  # 2 MB of bf16 per state: large enough to amortise the per-chunk work, cache-friendly


def cast_chunk(chunk: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast a floating-point chunk to the serving dtype; leave other tensors as they are."""
    if dtype is None or not chunk.is_floating_point() or chunk.dtype == dtype:
        return chunk
    return chunk.to(dtype)


def serving_dtype_of(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def serving_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in its serving dtype, on its own device (a cast already copies)."""
    cast = cast_chunk(tensor.detach(), dtype)
    if cast.data_ptr() == tensor.data_ptr():
        cast = cast.clone()
    return cast.contiguous()


def changed_elements(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, old bits and new bits of the elements whose bits differ (1-D uint arrays).

    Narrow dtypes are compared 8 bytes at a time first: at RL densities most
    64-bit words are unchanged, so the scan for changes touches 4 (bf16) or 8
    (fp8) times fewer entries, and only changed words are split into elements.
    """
    lanes = 8 // old.itemsize
    usable = old.size - old.size % lanes
    if lanes == 1 or usable == 0:
        idx = np.flatnonzero(old != new)
        return idx, old[idx], new[idx]
    old_words, new_words = old[:usable].view(np.uint64), new[:usable].view(np.uint64)
    words = np.flatnonzero(old_words != new_words)
    old_lanes = old_words[words].view(old.dtype).reshape(-1, lanes)
    new_lanes = new_words[words].view(old.dtype).reshape(-1, lanes)
    hits = np.flatnonzero(old_lanes != new_lanes)
    shift = lanes.bit_length() - 1  # lanes is 2, 4 or 8
    idx = (words[hits >> shift] << shift) | (hits & (lanes - 1))
    old_bits, new_bits = old_lanes.reshape(-1)[hits], new_lanes.reshape(-1)[hits]
    if usable < old.size:  # the last few elements that do not fill a word
        tail = np.flatnonzero(old[usable:] != new[usable:])
        idx = np.concatenate([idx, tail + usable])
        old_bits = np.concatenate([old_bits, old[usable:][tail]])
        new_bits = np.concatenate([new_bits, new[usable:][tail]])
    return idx, old_bits, new_bits


class ChangeDetector:
    """Finds elements whose serving-dtype bits differ from the last published state.

    Args:
        dtype: Serving dtype for floating-point tensors (e.g. ``torch.bfloat16``);
            ``None`` publishes tensors in their own dtype.
        chunk_elements: Elements compared at once; bounds temporary memory.
        compare_path: Where bits are compared (:class:`~rlsync.device_changes.ComparePath`): by default numpy
            for CPU tensors and torch on the device for the others (only the changed elements cross to the host).
    """

    def __init__(
        self, dtype: torch.dtype | None = torch.bfloat16, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        compare_path: ComparePath = ComparePath.AUTO,
    ) -> None:  # fmt: skip
        self.dtype = dtype
        self.chunk_elements = chunk_elements
        self.compare_path = ComparePath(compare_path)
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
        CPU tensors are compared with numpy in cache-sized chunks, tensors spread over
        the worker threads; tensors on an accelerator are compared there with torch.

        Raises:
            SyncError: nothing published yet, or ``state`` is not :meth:`compatible`.
        """
        if not self.compatible(state):
            raise SyncError("state does not match the published state's names, shapes and dtypes; publish an anchor")
        assert self.published is not None
        names = list(state)
        found = worker_pool().map(lambda n: self._diff_tensor(self.published[n], state[n].detach().reshape(-1)), names)
        changes = {name: change for name, change in zip(names, found) if change is not None}
        return changes

    def _diff_tensor(self, published: torch.Tensor, current: torch.Tensor) -> Change | None:
        shadow = int_view(published)
        on_cpu = current.device.type == "cpu" and self.compare_path is ComparePath.AUTO
        step = min(self.chunk_elements, CPU_CHUNK_ELEMENTS) if on_cpu else self.chunk_elements
        parts = []
        for start in range(0, shadow.numel(), step):
            old_bits, new_bits = shadow[start : start + step], int_view(cast_chunk(current[start : start + step], self.dtype))
            if on_cpu:
                idx, old, new = changed_elements(bits_to_numpy(old_bits), bits_to_numpy(new_bits))
            else:
                idx, old, new = device_changes(old_bits, new_bits)
            if idx.size:
                parts.append((idx + start, old, new))
        if not parts:
            return None
        return Change(
            index=np.concatenate([p[0] for p in parts]).astype(np.int64, copy=False),
            old_bits=np.concatenate([p[1] for p in parts]),
            new_bits=np.concatenate([p[2] for p in parts]),
            dtype=published.dtype,
            shape=tuple(published.shape),
            base=published,
        )

    def diff_tensor(self, name: str, tensor: torch.Tensor) -> Change | None:
        """Changed elements of one tensor relative to its published copy (``None``: unchanged).

        Raises:
            SyncError: ``name`` is not published, or its shape or serving dtype differ.
        """
        published = (self.published or {}).get(name)
        if published is None or tensor.shape != published.shape or serving_dtype_of(tensor, self.dtype) != published.dtype:
            raise SyncError(f"{name!r} does not match the published state's names, shapes and dtypes; publish an anchor")
        return self._diff_tensor(published, tensor.detach().reshape(-1))

    def diff_stream(self, tensors: Iterable[tuple[str, torch.Tensor]], *, what: str = "the state") -> dict[str, Change]:
        """:meth:`diff` of ``(name, tensor)`` pairs compared as they arrive (each released after), which must
        name every published tensor once.

        Args:
            tensors: The pairs.
            what: What the pairs are, for the error messages.

        Raises:
            SyncError: a name is sent twice or not published, a tensor's shape or serving dtype differs,
                or a published tensor is missing.
        """
        changes: dict[str, Change] = {}
        seen: set[str] = set()
        for name, tensor in tensors:
            if name in seen:
                raise SyncError(f"{name!r} was sent twice in one publish")
            seen.add(name)
            change = self.diff_tensor(name, tensor)
            if change is not None:
                changes[name] = change
            del tensor
        missing = (self.published or {}).keys() - seen
        if missing:
            raise SyncError(f"{what} lacks {len(missing)} published tensor(s), e.g. {sorted(missing)[0]!r}")
        return changes

    def commit(self, changes: Mapping[str, Change]) -> None:
        """Write published changes into the shadow copy."""
        assert self.published is not None
        for name, ch in changes.items():
            apply_change(self.published[name], ch)


def apply_change(tensor: torch.Tensor, change: Change) -> None:
    """Write a change's new bits into ``tensor`` (in place)."""
    flat = int_view(tensor)
    idx = torch.from_numpy(change.index).to(flat.device)
    new = torch.from_numpy(change.new_bits.view(np.dtype(f"int{8 * change.new_bits.itemsize}"))).to(flat.device)
    flat[idx] = new


class PatchedState(Mapping[str, torch.Tensor]):
    """A published state with changes applied, built one tensor at a time on access.

    Args:
        published: The shadow copy (not modified).
        changes: Changes to apply, by tensor name.
    """

    def __init__(self, published: Mapping[str, torch.Tensor], changes: Mapping[str, Change]) -> None:
        self.published = published
        self.changes = changes

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.published[name]
        if name not in self.changes:
            return tensor
        patched = tensor.clone()
        apply_change(patched, self.changes[name])
        return patched

    def __iter__(self) -> Iterator[str]:
        return iter(self.published)

    def __len__(self) -> int:
        return len(self.published)
