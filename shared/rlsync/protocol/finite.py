"""The refusal of publishes that would turn finite published values into NaN or Inf."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..dtypes import EXPONENT_FIELDS, dtype_name, numpy_to_values
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
    field = EXPONENT_FIELDS.get(dtype_name(change.dtype))
    if change.dtype.itemsize > 1 and field is not None:  # IEEE: NaN and Inf are the values whose exponent bits are all set
        shift, mask = field
        top = change.new_bits.dtype.type(mask << shift)
        return int(np.count_nonzero(((change.new_bits & top) == top) & ((change.old_bits & top) != top)))
    new = numpy_to_values(change.new_bits, change.dtype)  # fp8 (E4M3 has no Inf, and exponent bits set are finite there)
    old = numpy_to_values(change.old_bits, change.dtype)
    new, old = new.float(), old.float()  # torch has no isfinite for the fp8 dtypes; fp32 holds every fp8 value
    return int((~torch.isfinite(new) & torch.isfinite(old)).sum())
