"""In-memory form of a sparse weight update: what a decoded delta hands to an engine."""

from __future__ import annotations

import dataclasses

import torch


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
        flat[self.index.to(flat.device)] = self.values.to(flat.device)
        return tensor
