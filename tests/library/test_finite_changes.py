"""The refusal of changes that make finite values NaN or Inf, read from the bits, for every float dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlsync.delta_format import Change
from rlsync.dtypes import uint_dtype
from rlsync.errors import NonFiniteError
from rlsync.protocol.finite import _introduced, check_finite_changes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def _non_finite(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The reference: torch's own ``isfinite`` of the values (through fp32 for fp8, which it lacks)."""
    values = torch.from_numpy(bits.view(f"int{8 * bits.itemsize}")).view(dtype)
    return (~torch.isfinite(values.float() if dtype.itemsize == 1 else values)).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_count_of_finite_values_made_non_finite_matches_torch(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    unsigned = uint_dtype(dtype.itemsize)
    n = 20_000
    old = rng.integers(0, np.iinfo(unsigned).max, n, dtype=unsigned, endpoint=True)
    new = rng.integers(0, np.iinfo(unsigned).max, n, dtype=unsigned, endpoint=True)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1.0], dtype=torch.float32).to(dtype)
    special_bits = special.view(getattr(torch, f"int{8 * dtype.itemsize}")).numpy().view(unsigned)
    new[: 5 * 400] = np.repeat(special_bits, 400)  # every special value, over finite and non-finite old ones
    old[: 5 * 400] = np.tile(special_bits, 400)
    expected = int(np.count_nonzero(_non_finite(new, dtype) & ~_non_finite(old, dtype)))
    change = Change(index=np.arange(n), old_bits=old, new_bits=new, dtype=dtype, shape=(n,))
    assert expected > 0 and _introduced(change) == expected
    with pytest.raises(NonFiniteError, match=f"w: {expected} finite published values"):
        check_finite_changes({"w": change})
    check_finite_changes({"w": change}, allowed=True)
