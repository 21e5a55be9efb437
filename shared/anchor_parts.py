"""Sharded anchors: one safetensors file per trainer rank, assembled by readers.

A sharded trainer writes its anchor without gathering: each rank writes one
part file holding its flat slices, under the tensors' Hugging Face names, with
the usual anchor metadata plus ``part``/``parts`` and ``slices`` (JSON: each
entry's full shape and the flat offset of its first element). Every part is a
plain safetensors file; a reader places the slices into full tensors
(:func:`load_anchor_files`), so replicas still get full Hugging Face tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import safetensors.torch
import torch

from .dtypes import dtype_from_name
from .errors import FormatError
from .format import INDEX_FILE, anchor_metadata, check_format, load_anchor, read_header_file
from .shards import LocalSlice

PART_KEYS = ("part", "parts", "slices")


def write_anchor_part(
    slices: Mapping[str, LocalSlice], path: str | Path, *, step: int, state_hash: str, total: int, part: int, parts: int
) -> Path:
    """Write one rank's part of a sharded anchor.

    Args:
        slices: This rank's slices, already in the serving dtype.
        path: The file to write.
        step: The anchor's step.
        state_hash: Hash of the whole state.
        total: Elements of the whole model.
        part: This part's number (0-based).
        parts: How many parts the anchor has.

    Returns:
        ``path``.
    """
    table = {name: {"shape": list(s.shape), "offset": s.offset} for name, s in slices.items()}
    metadata = {
        **anchor_metadata(step=step, state_hash=state_hash, total=total),
        "part": str(part),
        "parts": str(parts),
        "slices": json.dumps(table, separators=(",", ":"), sort_keys=True),
    }
    tensors = {name: s.data.detach().cpu().contiguous() for name, s in slices.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return Path(path)


def load_anchor_files(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read an anchor, whole-tensor (:func:`shared.format.load_anchor`) or sharded.

    Returns:
        ``(state, metadata)``; the metadata without the per-part keys.

    Raises:
        FormatError: a file is malformed or not an anchor, parts are missing,
            duplicated or disagree, or slices overlap or leave holes.
    """
    shards = [p for p in files if p.name != INDEX_FILE]
    headers = [read_header_file(p) for p in shards]
    if not headers or "parts" not in headers[0][1]:
        return load_anchor(files)
    common = None
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    spans: dict[str, list[tuple[int, int, Path]]] = {}
    for position, (path, (entries, metadata)) in enumerate(zip(shards, headers)):
        check_format(metadata, "anchor")
        shared = {k: v for k, v in metadata.items() if k not in PART_KEYS}
        if common is None:
            common = shared
        elif shared != common:
            raise FormatError(f"{path.name}: part metadata disagrees with the other parts")
        if metadata.get("part") != str(position) or metadata.get("parts") != str(len(shards)):
            raise FormatError(f"{path.name}: declares part {metadata.get('part')!r} of {metadata.get('parts')!r}, "
                              f"expected {position} of {len(shards)}")  # fmt: skip
        table = _slice_table(path, metadata)
        if set(table) != set(entries):
            raise FormatError(f"{path.name}: slice table does not match its entries")
        for name, (shape, offset) in table.items():
            info = entries[name]
            dtype = dtype_from_name(info["dtype"])
            count = math.prod(info["shape"])
            if len(info["shape"]) != 1 or offset + count > math.prod(shape):
                raise FormatError(f"{path.name}: slice of {name!r} at {offset} does not fit shape {list(shape)}")
            if layout.setdefault(name, (dtype, shape)) != (dtype, shape):
                raise FormatError(f"{name}: parts disagree on its dtype or shape")
            spans.setdefault(name, []).append((offset, offset + count, path))
    for name, runs in spans.items():  # exact cover before allocating anything
        runs.sort(key=lambda r: r[:2])
        end = 0
        for start, stop, _ in runs:
            if start != end:
                raise FormatError(f"{name}: parts overlap or leave elements {end}..{start} unwritten")
            end = stop
        if end != math.prod(layout[name][1]):
            raise FormatError(f"{name}: parts cover {end} of {math.prod(layout[name][1])} elements")
    state = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in layout.items()}
    for path in shards:
        try:
            tensors = safetensors.torch.load_file(path)
        except Exception as exc:  # safetensors raises its own error types
            raise FormatError(f"{path.name}: unreadable safetensors data: {exc}") from None
        table = _slice_table(path, read_header_file(path)[1])
        for name, flat in tensors.items():
            offset = table[name][1]
            state[name].view(-1)[offset : offset + flat.numel()] = flat
    assert common is not None
    return state, common


def _slice_table(path: Path, metadata: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], int]]:
    try:
        raw: Any = json.loads(metadata.get("slices", ""))
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        table = {}
        for name, info in raw.items():
            shape = tuple(_nonneg(d) for d in info["shape"])
            table[name] = (shape, _nonneg(info["offset"]))
        return table
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise FormatError(f"{path.name}: malformed slice table: {exc}") from None


def _nonneg(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value
