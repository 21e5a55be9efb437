"""In-memory form of a sparse weight update: what a decoded delta hands to an engine."""

from __future__ import annotations

import dataclasses

import torch

_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


@dataclasses.dataclass(frozen=True)
class TensorPatch:
    """New values for some elements of one tensor, in checkpoint coordinates.

    Attributes:
        index: Sorted, unique flat (row-major) element positions, ``int64``, 1-D.
        values: The new values at those positions, 1-D, in the tensor's own dtype.
        shape: The full tensor's shape.
    """

    index: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of changed elements."""
        return int(self.index.numel())

    def apply_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Write the patch into ``tensor`` in place (any device) and return it."""
        flat = tensor.view(-1)
        values = self.values.to(flat.device)
        if flat.dtype in _SIGNED_TWIN and values.dtype == flat.dtype:
            # torch has no index_put for uint16/32/64: write the same bits through signed views
            flat, values = flat.view(_SIGNED_TWIN[flat.dtype]), values.view(_SIGNED_TWIN[flat.dtype])
        flat[self.index.to(flat.device)] = values
        return tensor
