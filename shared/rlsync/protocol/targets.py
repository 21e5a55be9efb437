"""The tensors a subscriber writes: whether an anchor or a delta fits them.

A subscriber's state is its own, or the weights an engine hands it (:class:`~rlsync.protocol.Subscriber`'s
``weights``), where tied names share one storage. These checks run before anything is written.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..dtypes import int_view
from ..errors import FormatError
from ..patch import TensorPatch


def same_schema(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two states have the same names, shapes and dtypes."""
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (shape and dtype included)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(int_view(a.contiguous()), int_view(b.contiguous()).to(a.device)))


def _storage(tensor: torch.Tensor) -> tuple[int, torch.device]:
    return tensor.data_ptr(), tensor.device


def check_anchor(step: int, tensors: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor] | None) -> None:
    """Refuse an anchor that cannot become the state.

    Args:
        step: The anchor's step (for messages).
        tensors: Its tensors.
        state: The state held now (may be empty).
        weights: The weights to write into, or ``None`` (the subscriber's own state).

    Raises:
        FormatError: its names, shapes or dtypes differ from the model's (the weights, or the state
            held); it leaves a tensor of the weights out; names tied in the weights differ in it.
    """
    if weights is None:
        if state and not same_schema(state, tensors):
            raise FormatError(f"anchor {step}: tensor names, shapes or dtypes differ from the model")
        return
    unknown = [n for n in tensors if n not in weights]
    wrong = [n for n in tensors if n in weights and not same_schema({n: weights[n]}, {n: tensors[n]})]
    covered = {_storage(weights[n]) for n in tensors if n in weights}
    left_out = [n for n, t in weights.items() if _storage(t) not in covered]
    if unknown or wrong or left_out:
        raise FormatError(
            f"anchor {step}: tensor names, shapes or dtypes differ from the model's weights "
            f"(unknown {unknown[:3]}, other shape or dtype {wrong[:3]}, missing {left_out[:3]})"
        )
    by_storage: dict[tuple[int, torch.device], str] = {}
    for name in sorted(tensors):
        first = by_storage.setdefault(_storage(weights[name]), name)
        if first != name and weights[name].numel() and not same_bits(tensors[first], tensors[name]):
            raise FormatError(f"anchor {step}: {first!r} and {name!r} share one tensor here, the anchor gives them different values")


def check_tied(state: Mapping[str, torch.Tensor], patches: Mapping[str, TensorPatch]) -> None:
    """Refuse a delta that changes names sharing one storage in ``state`` differently (it can hold one).

    Raises:
        FormatError: it does.
    """
    groups: dict[tuple[int, torch.device], list[str]] = {}
    for name, tensor in state.items():
        if tensor.numel():
            groups.setdefault(_storage(tensor), []).append(name)
    for group in (sorted(g) for g in groups.values() if len(g) > 1):
        first = patches.get(group[0])
        for name in group[1:]:
            part = patches.get(name)
            same = (first is None and part is None) or (
                first is not None and part is not None and torch.equal(first.index, part.index) and same_bits(first.values, part.values)
            )  # fmt: skip
            if not same:
                raise FormatError(f"{group[0]!r} and {name!r} share one tensor here, the delta changes them differently")
