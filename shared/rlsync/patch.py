"""In-memory form of a sparse weight update: what a decoded delta hands to an engine."""

from __future__ import annotations

import dataclasses

import torch

from .dtypes import bits_to_numpy, int_view


def gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Elements of ``tensor`` (flattened) at ``index``, by bits, as a 1-D tensor of its dtype.

    On CPU this goes through numpy, whose gathers are several times faster than torch's.
    """
    flat = int_view(tensor.detach())
    if flat.device.type == "cpu":
        picked = torch.from_numpy(bits_to_numpy(flat)[index.numpy()].view(flat.numpy().dtype))
    else:
        picked = flat[index.to(flat.device)]
    return picked.view(torch.bool) if tensor.dtype == torch.bool else picked.view(tensor.dtype)


def scatter_(tensor: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write ``values`` (same dtype) at ``index`` of ``tensor`` (flattened), by bits, in place."""
    if not tensor.is_contiguous():
        raise ValueError("cannot patch a non-contiguous tensor in place")
    flat, bits = int_view(tensor.detach()), int_view(values.to(tensor.device))
    if flat.device.type == "cpu":
        flat.numpy()[index.numpy()] = bits.numpy()
    else:
        flat[index.to(flat.device)] = bits
    return tensor


@dataclasses.dataclass(frozen=True)
class TensorPatch:
    """New values for some elements of one tensor, in checkpoint coordinates.

    Attributes:
        index: Sorted, unique flat (row-major) element positions, ``int64``, 1-D, on CPU.
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
        """Write the patch into ``tensor`` in place (any device, bit for bit) and return it."""
        if self.values.dtype != tensor.dtype:
            raise TypeError(f"patch values are {self.values.dtype}, the tensor is {tensor.dtype}")
        return scatter_(tensor, self.index, self.values)
