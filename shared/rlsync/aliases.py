"""Tied weights: one tensor under two names, published once.

A model with tied embeddings (Qwen3-0.6B ties ``lm_head.weight`` to
``model.embed_tokens.weight``) lists the shared tensor under both names in its
``state_dict()``. Publishing both would store it twice in every anchor and code its
changes twice in every delta. :func:`split_aliases` keeps the first name of each
tensor (the state dict's order: ``model.embed_tokens.weight`` for Qwen3, as
``save_pretrained`` does) and maps the other names to it; the publisher records that
map in every anchor's metadata (:data:`ALIASES_KEY`), and a subscriber restores the
names (:func:`with_aliases`) on the same tensor objects, so a patch of one is a patch
of both. The state hash covers each tensor once, under its first name.
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

from .errors import FormatError
from .jsonlimits import loads_bounded
from .limits import MAX_METADATA_BYTES

#: Anchor metadata key of the alias map (a JSON object: alias name -> published name).
ALIASES_KEY = "aliases"


def split_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each tensor once, under its first name, and the other names of each.

    Two names are one tensor when they view the same elements: same device, data pointer,
    dtype, shape and strides (empty tensors are never aliases).

    Args:
        state: Tensors by name, in the state dict's order.

    Returns:
        ``(unique, aliases)``: the state without the later names, and ``alias -> first name``.
    """
    unique: dict[str, torch.Tensor] = {}
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = alias_key(tensor)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        first.setdefault(key, name)
        unique[name] = tensor
    return unique, aliases


def alias_key(tensor: torch.Tensor) -> tuple | None:
    """What two names of one tensor share (``None`` for an empty tensor, never an alias)."""
    if not tensor.numel():
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def with_aliases(state: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state`` plus every alias name, bound to the very tensor it aliases (not a copy)."""
    return {**state, **{alias: state[name] for alias, name in aliases.items()}}


def aliases_to_metadata(aliases: Mapping[str, str]) -> dict[str, str]:
    """The anchor metadata entry of ``aliases`` (none when there are none)."""
    return {ALIASES_KEY: json.dumps(dict(sorted(aliases.items())), separators=(",", ":"))} if aliases else {}


def aliases_from_metadata(metadata: Mapping[str, str], names: Mapping[str, object]) -> dict[str, str]:
    """The alias map an anchor's metadata records, checked against its tensor ``names``.

    Raises:
        FormatError: not a JSON object of names, an alias that is itself a stored tensor, or
            one that names a tensor the anchor does not hold.
    """
    raw = metadata.get(ALIASES_KEY)
    if raw is None:
        return {}
    aliases = loads_bounded(raw, what=f"metadata {ALIASES_KEY!r}", max_bytes=MAX_METADATA_BYTES)
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise FormatError(f"metadata {ALIASES_KEY!r} is not an object of tensor names")
    for alias, name in aliases.items():
        if alias in names or name not in names:
            raise FormatError(f"alias {alias[:80]!r} -> {name[:80]!r}: an alias must name no stored tensor, and a stored one")
    return aliases
