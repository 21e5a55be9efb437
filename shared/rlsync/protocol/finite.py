"""The refusal of publishes that would turn finite published values into NaN or Inf."""

from __future__ import annotations

from typing import Mapping

import torch

from ..dtypes import numpy_to_values
from ..errors import NonFiniteError
from ..delta_format import Change
from ..workers import worker_pool


def check_finite_changes(changes: Mapping[str, Change], *, allowed: bool = False) -> None:
    """Refuse changes that turn a finite published value into NaN or Inf.

    Only the changed elements are looked at, so the cost follows the delta, not the model; tensors are
    checked on the worker threads.

    Args:
        changes: The changes of a publish.
        allowed: Let them through (a publisher's ``allow_non_finite``): nothing is checked.

    Raises:
        NonFiniteError: naming the first tensor concerned and how many values.
    """
    if allowed:
        return
    names = [name for name, change in changes.items() if change.dtype.is_floating_point and change.index.size]
    for name, introduced in zip(names, worker_pool().map(lambda name: _introduced(changes[name]), names)):
        if introduced:
            raise NonFiniteError(
                f"{name}: {introduced} finite published values would become NaN or Inf; refusing to publish "
                "(the trainer diverged or was fed bad data)"
            )


def _introduced(change: Change) -> int:
    """How many of a change's finite old values become NaN or Inf."""
    new = numpy_to_values(change.new_bits, change.dtype)
    old = numpy_to_values(change.old_bits, change.dtype)
    if change.dtype.itemsize == 1:  # torch has no isfinite for the fp8 dtypes; fp32 holds every fp8 value
        new, old = new.float(), old.float()
    return int((~torch.isfinite(new) & torch.isfinite(old)).sum())
