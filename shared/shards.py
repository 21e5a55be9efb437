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
