"""The flat slices of a state that one rank of a sharded trainer holds.

FSDP2 (``torch.distributed.fsdp.fully_shard``) makes every parameter a DTensor
sharded on dim 0 (``Shard(0)``): a rank holds a contiguous run of rows, hence a
contiguous run of the row-major flat tensor. The sync works in those global flat
coordinates, so a replica never needs to know the trainer's sharding.

Placements whose local data is not one contiguous flat run (``Shard(d)`` with
``d > 0``, strided or partial placements) are refused. A replicated tensor (or a
plain tensor, which every rank holds in full) is published by one rank only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class LocalSlice:
    """One rank's flat slice of one tensor.

    Attributes:
        data: The slice's elements, flat (1-D), in the trainer's dtype.
        offset: Position of its first element in the full flat tensor.
        shape: The full tensor's shape.
    """

    data: torch.Tensor
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)


def local_slices(state: Mapping[str, torch.Tensor], rank: int) -> dict[str, LocalSlice]:
    """The slices of ``state`` that this rank publishes.

    Args:
        state: Tensors under Hugging Face names: DTensors (FSDP2 parameters) or
            plain tensors (held in full by every rank).
        rank: This process's rank in the publishing group; plain tensors are
            published by rank 0.

    Returns:
        Name -> slice, for the tensors this rank publishes (possibly none).

    Raises:
        ValueError: a DTensor's placements do not give a contiguous flat slice.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, LocalSlice] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            if rank == 0:
                out[name] = LocalSlice(tensor.detach().reshape(-1), 0, tuple(tensor.shape))
            continue
        placement = _dtensor_slice(name, tensor)
        if placement is not None:
            out[name] = placement
    return out


def _dtensor_slice(name: str, tensor) -> LocalSlice | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            if coordinate[dim] != 0:  # another rank of this replica group publishes it
                return None
        elif type(placement) is not Shard or placement.dim != 0:
            raise ValueError(
                f"{name}: placement {placement} does not give a contiguous flat slice; "
                "sharded publish supports Shard(0) and Replicate (FSDP2's default)"
            )
    shape = tuple(tensor.shape)
    _, global_offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    offset = global_offset[0] * row if shape else 0
    return LocalSlice(tensor.to_local().detach().reshape(-1), offset, shape)


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Give each tensor one owner rank, balanced by bytes and the same on every rank.

    Largest tensor first (ties by name) goes to the least-loaded rank (ties: the
    lowest), so the result depends only on the names and sizes.

    Args:
        sizes: Tensor name -> bytes.
        world: Ranks in the group.

    Returns:
        Name -> owner rank.
    """
    load = [0] * world
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


def slice_placement(
    tables: list[Mapping[str, tuple[int, int]]], numels: Mapping[str, int]
) -> dict[str, list[tuple[int, int, int]]]:
    """Check that the ranks' slices cover every tensor exactly once, and say who holds what.

    Args:
        tables: Per rank, name -> ``(offset, count)`` of its slice (flat elements).
        numels: Name -> elements of the full tensor.

    Returns:
        Name -> ``[(rank, offset, count), ...]`` of the non-empty slices, sorted by offset.

    Raises:
        ValueError: a tensor is not in ``numels``, or slices overlap or leave elements uncovered.
    """
    placement: dict[str, list[tuple[int, int, int]]] = {name: [] for name in numels}
    for rank, table in enumerate(tables):
        for name, (offset, count) in table.items():
            if name not in placement:
                raise ValueError(f"rank {rank} holds a slice of {name!r}, which is not in the state")
            if count:  # an empty slice (more ranks than rows) holds nothing to place
                placement[name].append((rank, offset, count))
    for name, runs in placement.items():
        runs.sort(key=lambda r: (r[1], r[2]))
        end = 0
        for rank, offset, count in runs:
            if offset != end:
                raise ValueError(
                    f"{name}: rank {rank}'s slice at {offset} overlaps or leaves elements {end}..{offset} uncovered"
                )
            end = offset + count
        if end != numels[name]:
            raise ValueError(f"{name}: the ranks' slices cover {end} of {numels[name]} elements")
    return placement
