"""Change detection on the trainer side.

:class:`ChangeDetector` keeps a shadow copy of the last *published* state in the
serving dtype, on the parameters' own device, and compares bit patterns of the
current weights (cast to the serving dtype chunk by chunk) against it. Deltas
are therefore always relative to what replicas hold, so publishing every k
optimizer steps stays exact: sub-threshold updates accumulate in the fp32
master weights until they flip a bf16 bit.

On CPU the chunks (:data:`CPU_CHUNK_ELEMENTS`) of every tensor are spread over the
worker threads, and each is one pass of a compiled kernel that compares 64 elements
at once; on an accelerator torch compares them there.

Memory cost: the shadow holds one serving-dtype copy of every parameter (2 bytes
per parameter for bf16) on the parameters' device; detection adds, per worker
thread, at most a chunk x (serving itemsize for the cast + 12 bytes per changed
element: its index and its old and new bits) of temporary memory, and the changes
found, independent of model size.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Iterable, Iterator, Mapping, NamedTuple

import numba
import numpy as np
import torch

from .bitops import LANES, MASKS_IN_ORDER, differ_mask, lowest_bit
from .device_changes import ComparePath, device_changes
from .dtypes import bits_to_numpy, int_view, numpy_to_values
from .errors import SyncError
from .delta_format import Change
from .patch import scatter_
from .workers import worker_pool

DEFAULT_CHUNK_ELEMENTS = 1 << 24
CPU_CHUNK_ELEMENTS = 1 << 20  # 2 MB of bf16 per state: large enough to amortise the per-chunk work, cache-friendly
#: Tensors of a stream whose comparisons are queued at once (:meth:`ChangeDetector.diff_stream`).
STREAM_IN_FLIGHT = 2


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


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _changed(old, new, index, old_out, new_out):  # pragma: no cover - compiled
    """Write the positions, old and new bits of the elements whose bits differ; returns their number, or
    -1 when there are more than the outputs hold (what was written is then to be ignored).

    One vector comparison per :data:`~rlsync.bitops.LANES` elements (:func:`~rlsync.bitops.differ_mask`);
    at RL densities most blocks hold one change or none, so the scan runs at the speed of reading both.
    """
    k = 0
    room = index.size
    whole = old.size - old.size % LANES if MASKS_IN_ORDER else 0
    for block in range(0, whole, LANES):
        differ = differ_mask(old, new, block)
        while differ:
            if k == room:
                return -1
            i = block + lowest_bit(differ)
            differ &= differ - np.uint64(1)
            index[k], old_out[k], new_out[k] = i, old[i], new[i]
            k += 1
    for i in range(whole, old.size):
        if old[i] != new[i]:
            if k == room:
                return -1
            index[k], old_out[k], new_out[k] = i, old[i], new[i]
            k += 1
    return k


#: Changes of a chunk the first comparison has room for (:func:`changed_elements`): 6% of a CPU chunk, far
#: above RL densities, so the outputs stay small allocations; a denser chunk is compared again with room for all.
FIRST_ROOM = 1 << 16


def changed_elements(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, old bits and new bits of the elements whose bits differ (1-D contiguous uint arrays of one dtype)."""
    for room in dict.fromkeys((min(old.size, FIRST_ROOM), old.size)):
        index, old_out, new_out = np.empty(room, np.int64), np.empty(room, old.dtype), np.empty(room, new.dtype)
        count = _changed(old, new, index, old_out, new_out)
        if count >= 0:
            return index[:count].copy(), old_out[:count].copy(), new_out[:count].copy()
    raise AssertionError("a chunk has more changes than elements")  # pragma: no cover - room for all holds them


class _Task(NamedTuple):
    """One chunk of one tensor to compare."""

    name: str
    published: torch.Tensor
    current: torch.Tensor  # flat
    start: int
    step: int
    dtype: torch.dtype | None
    on_cpu: bool  # compared by the compiled kernel; else by torch on the tensor's device


def _compare(task: _Task) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The changed elements of one chunk: positions within it, old bits, new bits."""
    stop = task.start + task.step
    old_bits = int_view(task.published)[task.start : stop]
    new_bits = int_view(cast_chunk(task.current[task.start : stop], task.dtype))
    if task.on_cpu:
        return changed_elements(bits_to_numpy(old_bits), bits_to_numpy(new_bits))
    return device_changes(old_bits, new_bits)


class ChangeDetector:
    """Finds elements whose serving-dtype bits differ from the last published state.

    Args:
        dtype: Serving dtype for floating-point tensors (e.g. ``torch.bfloat16``);
            ``None`` publishes tensors in their own dtype.
        chunk_elements: Elements compared at once; bounds temporary memory.
        compare_path: Where bits are compared (:class:`~rlsync.device_changes.ComparePath`): by default the
            compiled kernel for CPU tensors and torch on the device for the others (only the changed elements
            cross to the host).
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
        CPU tensors are compared by a compiled kernel in cache-sized chunks, the chunks of
        every tensor spread over the worker threads; tensors on an accelerator are compared
        there with torch.

        Raises:
            SyncError: nothing published yet, or ``state`` is not :meth:`compatible`.
        """
        if not self.compatible(state):
            raise SyncError("state does not match the published state's names, shapes and dtypes; publish an anchor")
        assert self.published is not None
        tasks = [task for name in state for task in self._tasks(name, state[name])]
        return self._gather(tasks, worker_pool().map(_compare, tasks))

    def _tasks(self, name: str, tensor: torch.Tensor) -> list[_Task]:
        """The comparisons of one tensor: cache-sized chunks on CPU, large ones on an accelerator."""
        published, current = self.published[name], tensor.detach().reshape(-1)  # type: ignore[index]
        on_cpu = current.device.type == "cpu" and self.compare_path is ComparePath.AUTO
        step = min(self.chunk_elements, CPU_CHUNK_ELEMENTS) if on_cpu else self.chunk_elements
        starts = range(0, published.numel(), step)
        return [_Task(name, published, current, start, step, self.dtype, on_cpu) for start in starts]

    @staticmethod
    def _gather(tasks: list[_Task], found: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Change]:
        """Each tensor's :class:`Change` from its chunks' changes (in flat order), for the tensors that changed."""
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for task, (idx, old, new) in zip(tasks, found):
            if idx.size:
                parts.setdefault(task.name, []).append((idx + task.start, old, new))
        published = {task.name: task.published for task in tasks}
        return {
            name: Change(
                index=np.concatenate([p[0] for p in found_parts]).astype(np.int64, copy=False),
                old_bits=np.concatenate([p[1] for p in found_parts]),
                new_bits=np.concatenate([p[2] for p in found_parts]),
                dtype=published[name].dtype,
                shape=tuple(published[name].shape),
                base=published[name],
            )
            for name, found_parts in parts.items()
        }

    def diff_tensor(self, name: str, tensor: torch.Tensor) -> Change | None:
        """Changed elements of one tensor relative to its published copy (``None``: unchanged).

        Raises:
            SyncError: ``name`` is not published, or its shape or serving dtype differ.
        """
        tasks = self._checked_tasks(name, tensor)
        return self._gather(tasks, worker_pool().map(_compare, tasks)).get(name)

    def _checked_tasks(self, name: str, tensor: torch.Tensor) -> list[_Task]:
        """:meth:`_tasks` of a tensor checked against its published copy."""
        published = (self.published or {}).get(name)
        if published is None or tensor.shape != published.shape or serving_dtype_of(tensor, self.dtype) != published.dtype:
            raise SyncError(f"{name!r} does not match the published state's names, shapes and dtypes; publish an anchor")
        return self._tasks(name, tensor)

    def diff_stream(self, tensors: Iterable[tuple[str, torch.Tensor]], *, what: str = "the state") -> dict[str, Change]:
        """:meth:`diff` of ``(name, tensor)`` pairs compared as they arrive, which must name every published
        tensor once. A tensor's chunks are queued on the worker threads as it arrives, and its changes
        gathered once the next one has been queued too, so the threads do not wait at each tensor's
        end; each tensor is released once gathered (at most :data:`STREAM_IN_FLIGHT` are held).

        Args:
            tensors: The pairs.
            what: What the pairs are, for the error messages.

        Raises:
            SyncError: a name is sent twice or not published, a tensor's shape or serving dtype differs,
                or a published tensor is missing.
        """
        changes: dict[str, Change] = {}
        seen: set[str] = set()
        queued: collections.deque[tuple[list[_Task], list[concurrent.futures.Future]]] = collections.deque()

        def gather_oldest() -> None:
            tasks, futures = queued.popleft()
            changes.update(self._gather(tasks, (future.result() for future in futures)))

        try:
            for name, tensor in tensors:
                if name in seen:
                    raise SyncError(f"{name!r} was sent twice in one publish")
                seen.add(name)
                tasks = self._checked_tasks(name, tensor)
                queued.append((tasks, [worker_pool().submit(_compare, task) for task in tasks]))
                del tensor, tasks
                while len(queued) >= STREAM_IN_FLIGHT:
                    gather_oldest()
            while queued:
                gather_oldest()
        finally:
            for _, futures in queued:  # a refused pair: nothing more is compared
                for future in futures:
                    future.cancel()
        missing = (self.published or {}).keys() - seen
        if missing:
            raise SyncError(f"{what} lacks {len(missing)} published tensor(s), e.g. {sorted(missing)[0]!r}")
        return changes

    def commit(self, changes: Mapping[str, Change]) -> None:
        """Write published changes into the shadow copy (tensors spread over the worker threads)."""
        published = self.published
        assert published is not None
        list(worker_pool().map(lambda name: apply_change(published[name], changes[name]), changes))


def apply_change(tensor: torch.Tensor, change: Change) -> None:
    """Write a change's new bits into ``tensor`` (in place)."""
    scatter_(tensor, torch.from_numpy(change.index), numpy_to_values(change.new_bits, tensor.dtype))


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
