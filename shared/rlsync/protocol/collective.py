"""The collective steps of a sharded publish (:mod:`rlsync.protocol.sharded`).

- :func:`collective_round`: every rank does its own work and sends a small record to rank 0, which
  answers with one broadcast. An error anywhere stops every rank in the same round, so no rank waits
  forever on a failed peer.
- :func:`gather_owned`: at an anchor, every rank sends its slices straight to each tensor's owner
  rank (point-to-point), which receives them in place into the whole tensors it writes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..detect import cast_chunk, serving_dtype_of
from ..errors import FencedError, NonFiniteError, RunLockedError, ShardedPublishError
from ..shards import LocalSlice, assign_owners, slice_placement

_PROPAGATED = {cls.__name__: cls for cls in (FencedError, NonFiniteError, RunLockedError)}  # raised as such on every rank


def collective_round(
    group: dist.ProcessGroup | None, local: Callable[[], Any], combine: Callable[[list[Any]], Any] | None = None
) -> Any:
    """Run ``local`` on every rank, ``combine`` (of all ranks' results) on rank 0; return its result everywhere.

    Args:
        group: The trainer's process group (``None``: the world).
        local: This rank's work.
        combine: Rank 0's, on every rank's result in rank order (``None``: the round returns ``None``).

    Raises:
        The rank's own exception, or :class:`ShardedPublishError` (or the lock or non-finite
        error rank 0 hit) when another rank failed.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own: BaseException | None = None
    try:
        mine: tuple[str, Any] = ("ok", local())
    except Exception as exc:
        own, mine = exc, ("error", (type(exc).__name__, f"rank {rank}: {exc}"))
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, group=group, group_dst=0)
    box: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        errors = [value for status, value in gathered if status == "error"]
        if errors:
            box[0] = ("error", errors[0] if len(errors) == 1 else ("SyncError", "; ".join(e[1] for e in errors)))
        else:
            try:
                box[0] = ("ok", combine([value for _, value in gathered]) if combine else None)
            except Exception as exc:
                own, box[0] = exc, ("error", (type(exc).__name__, f"rank 0: {exc}"))
    dist.broadcast_object_list(box, group=group, group_src=0)
    status, value = box[0]
    if status == "error":
        if own is not None:
            raise own
        raise _PROPAGATED.get(value[0], ShardedPublishError)(value[1])
    return value


def gather_owned(
    group: dist.ProcessGroup | None,
    slices: Mapping[str, LocalSlice],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Every tensor's owner rank (balanced by bytes), and the whole tensors (serving dtype) this rank owns.

    Rank 0 checks that the ranks' slices cover every tensor exactly once; then every rank sends each
    slice straight to the tensor's owner, which receives it in place (point-to-point, one message per
    slice), so a rank holds only its own slices and the tensors it owns.

    Args:
        group: The trainer's process group (``None``: the world).
        slices: This rank's slices.
        state: This rank's state dict (the tensors' shapes and dtypes).
        dtype: The serving dtype of floating-point tensors (``None``: their own).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtypes = {n: serving_dtype_of(t, dtype) for n, t in state.items()}
    numels = {n: t.numel() for n, t in state.items()}
    owners = assign_owners({n: numels[n] * _itemsize(t, dtype) for n, t in state.items()}, world)
    device = next((s.data.device for s in slices.values()), torch.device("cpu"))
    serving: dict[str, torch.Tensor] = {}
    owned: dict[str, torch.Tensor] = {}

    def prepare() -> dict[str, tuple[int, int]]:
        serving.update({n: cast_chunk(s.data, dtype).contiguous() for n, s in slices.items()})
        mine = [n for n, r in owners.items() if r == rank]
        owned.update({n: torch.empty(numels[n], dtype=dtypes[n], device=device) for n in mine})
        return {n: (s.offset, s.data.numel()) for n, s in slices.items()}

    placement = collective_round(group, prepare, lambda tables: slice_placement(tables, numels))
    works = []
    for tag, name in enumerate(sorted(placement)):
        owner = owners[name]
        for sender, offset, count in placement[name]:
            if sender == rank and owner == rank:
                owned[name][offset : offset + count] = serving[name]
            elif sender == rank:
                source = serving[name].view(torch.uint8)
                works.append(dist.isend(source, group=group, group_dst=owner, tag=tag))
            elif owner == rank:
                target = owned[name][offset : offset + count].view(torch.uint8)
                works.append(dist.irecv(target, group=group, group_src=sender, tag=tag))
    for work in works:
        work.wait()
    return owners, {n: t.view(tuple(state[n].shape)) for n, t in owned.items()}


def _itemsize(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=serving_dtype_of(tensor, dtype)).element_size()
