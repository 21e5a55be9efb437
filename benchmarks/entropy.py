"""Entropy bounds of one delta: what any coder of positions and values could reach.

Positions are bounded by the binary entropy of "changed or not" per element,
either context-free (one probability per tensor) or given each element's old
exponent (one probability per exponent class, which the receiver can compute
from the weights it holds). Values are bounded by the order-0 entropy of the
zigzag bit-pattern differences per tensor, or per (tensor, exponent class).
All figures are bytes per changed element over the whole model; tensors without
an exponent field count with their context-free figures in both.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from rlsync.dtypes import EXPONENT_FIELDS, bits_to_numpy, dtype_name, int_view


def _binary_bits(changed: np.ndarray, total: np.ndarray) -> float:
    """Sum over groups of ``total * H(changed / total)`` in bits."""
    keep = (changed > 0) & (changed < total)
    p = changed[keep] / total[keep]
    return float(-(total[keep] * (p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def _conditional_bits(values: np.ndarray, groups: np.ndarray) -> float:
    """``len(values) * H(values | groups)`` in bits (order-0, empirical)."""
    joint = np.unique(np.stack([groups.astype(np.int64), values.astype(np.int64)]), axis=1, return_counts=True)[1]
    marginal = np.unique(groups, return_counts=True)[1]
    return float(-(joint * np.log2(joint)).sum() + (marginal * np.log2(marginal)).sum())


def delta_entropy(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Entropy bounds of the delta from ``old`` to ``new``, in bytes per changed element.

    Returns:
        ``positions_free``, ``positions_exponent``, ``values_free``, ``values_exponent``,
        and the sums ``bound_free`` (positions and values context-free) and
        ``bound_exponent`` (both given the old exponent).
    """
    bits = dict.fromkeys(("positions_free", "positions_exponent", "values_free", "values_exponent"), 0.0)
    changed_total = 0
    for name, before in old.items():
        o, n = bits_to_numpy(int_view(before)), bits_to_numpy(int_view(new[name]))
        changed = np.flatnonzero(o != n)
        if not changed.size:
            continue
        changed_total += changed.size
        width = 8 * o.itemsize
        diff = (n[changed] - o[changed]).view(np.dtype(f"int{width}"))
        zigzag = ((diff << 1) ^ (diff >> (width - 1))).view(o.dtype)
        free_pos = _binary_bits(np.array([changed.size]), np.array([o.size]))
        free_val = _conditional_bits(zigzag, np.zeros(changed.size, np.int64))
        bits["positions_free"] += free_pos
        bits["values_free"] += free_val
        field = EXPONENT_FIELDS.get(dtype_name(before.dtype))
        if field is None:
            bits["positions_exponent"] += free_pos
            bits["values_exponent"] += free_val
            continue
        shift, mask = field
        classes = (o.astype(np.int64) >> shift) & mask
        per_class = np.bincount(classes[changed], minlength=mask + 1)
        bits["positions_exponent"] += _binary_bits(per_class, np.bincount(classes, minlength=mask + 1))
        bits["values_exponent"] += _conditional_bits(zigzag, classes[changed])
    out = {key: value / 8 / max(changed_total, 1) for key, value in bits.items()}
    out["bound_free"] = out["positions_free"] + out["values_free"]
    out["bound_exponent"] = out["positions_exponent"] + out["values_exponent"]
    return out
