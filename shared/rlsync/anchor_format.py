"""Anchors in the wire format (:mod:`rlsync.format`): the full state under Hugging Face names, readable by any
safetensors reader, large states in shards with a ``model.safetensors.index.json`` as Hugging Face checkpoints are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import safetensors.torch
import torch

from .aliases import aliases_to_metadata
from .errors import FormatError
from .files import read_regular
from .format import FORMAT_NAME, FORMAT_VERSION, check_format, read_header_file
from .jsonlimits import loads_bounded
from .limits import MAX_HEADER_BYTES

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3



def anchor_metadata(*, step: int, state_hash: str, total: int, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """Metadata strings written into every shard of an anchor (``aliases``: tied names, see :mod:`rlsync.aliases`)."""
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kind": "anchor",
        "sparse": "False",
        "step": str(step),
        "state_hash": state_hash,
        "total": str(total),
        **aliases_to_metadata(aliases or {}),
    }


def plan_shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[list[str]]:
    """Group tensor names (sorted) into shards of at most ``max_shard_bytes`` (one oversized tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """File names of an anchor with ``count`` shards, Hugging Face style."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_anchor_shard(tensors: Mapping[str, torch.Tensor], path: str | Path, *, metadata: Mapping[str, str]) -> Path:
    """Write one shard file of an anchor: whole tensors (on any device) with the anchor metadata.

    Returns:
        ``path``.
    """
    cpu = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    safetensors.torch.save_file(cpu, str(path), metadata=dict(metadata))
    return Path(path)


def write_anchor(
    state: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    step: int,
    state_hash: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    aliases: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write an anchor into ``folder`` (shards plus, if sharded, an index file).

    Args:
        aliases: Names tied to a tensor of ``state`` (recorded in the metadata, see :mod:`rlsync.aliases`).

    Returns:
        The written files, index file last.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() for t in state.values())
    metadata = anchor_metadata(step=step, state_hash=state_hash, total=total, aliases=aliases)
    groups = plan_shards(state, max_shard_bytes)
    files = []
    weight_map = {}
    for names, fname in zip(groups, shard_names(len(groups))):
        files.append(write_anchor_shard({n: state[n] for n in names}, folder / fname, metadata=metadata))
        weight_map.update({n: fname for n in names})
    if len(groups) > 1:
        total_size = sum(f.stat().st_size for f in files)
        (folder / INDEX_FILE).write_bytes(anchor_index(weight_map, metadata, total_size=total_size))
        files.append(folder / INDEX_FILE)
    return files


def anchor_index(weight_map: Mapping[str, str], metadata: Mapping[str, str], *, total_size: int) -> bytes:
    """The ``model.safetensors.index.json`` of a sharded anchor.

    Args:
        weight_map: Tensor name -> shard file name.
        metadata: The anchor metadata (as in every shard).
        total_size: Bytes of all shard files together.

    Returns:
        The index file's bytes.
    """
    index = {"metadata": {**metadata, "total_size": total_size}, "weight_map": dict(weight_map)}
    return json.dumps(index, indent=2, sort_keys=True).encode()


def load_anchor(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read an anchor's shards; an index file, if any, must be exactly the one
    :func:`anchor_index` writes for them (the shards carry the metadata).

    Returns:
        ``(state, metadata)``.

    Raises:
        FormatError: a shard is malformed, not an anchor, or disagrees with the others; the
            index names other tensors, files, sizes or metadata than the shards, or is garbage.
    """
    state: dict[str, torch.Tensor] = {}
    first: dict[str, str] | None = None
    weight_map: dict[str, str] = {}
    index: Path | None = None
    for path in files:
        if path.name == INDEX_FILE:
            index = path
            continue
        _, metadata = read_header_file(path)
        check_format(metadata, "anchor")
        if first is None:
            first = metadata
        elif metadata != first:
            raise FormatError(f"{path.name}: shard metadata disagrees with the other shards")
        try:
            tensors = safetensors.torch.load_file(path)
        except Exception as exc:
            raise FormatError(f"{path.name}: unreadable safetensors data: {exc}") from None
        overlap = state.keys() & tensors.keys()
        if overlap:
            raise FormatError(f"{path.name}: tensors appear in two shards: {sorted(overlap)[:3]}")
        state.update(tensors)
        weight_map.update(dict.fromkeys(tensors, path.name))
    if first is None:
        raise FormatError("anchor has no shard files")
    if index is not None:
        shards_size = sum(p.stat().st_size for p in files if p.name != INDEX_FILE)
        expected = json.loads(anchor_index(weight_map, first, total_size=shards_size))
        try:
            data = read_regular(index, max_bytes=MAX_HEADER_BYTES)
        except OSError as exc:
            raise FormatError(f"{INDEX_FILE}: {exc}") from None
        if loads_bounded(data, what=INDEX_FILE, max_bytes=MAX_HEADER_BYTES) != expected:
            raise FormatError(f"{INDEX_FILE} names other tensors, shard files, sizes or metadata than the anchor's shards")
    return state, first
