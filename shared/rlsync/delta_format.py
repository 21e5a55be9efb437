"""Deltas in the wire format (:mod:`rlsync.format`): only changed tensors, encoded by a codec
(:mod:`rlsync.codecs`), with the metadata a replica checks before applying them (:func:`decode_delta`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np
import safetensors.torch
import torch

from .codecs import DEFAULT_CODEC, DecodeTarget, get_codec
from .codecs.checks import check_decoded, check_index
from .dtypes import bits_to_numpy, dtype_name, int_view, numpy_to_values
from .errors import FormatError
from .format import FORMAT_NAME, FORMAT_VERSION, MAX_METADATA_INT, check_format, metadata_int, metadata_str, parse_header
from .jsonlimits import loads_bounded
from .limits import MAX_METADATA_BYTES
from .patch import TensorPatch, gather
from .workers import worker_pool


@dataclasses.dataclass(frozen=True)
class Change:
    """The changed elements of one tensor, as found by change detection.

    Attributes:
        index: Sorted, unique flat positions (``int64`` numpy array).
        old_bits: Published bit patterns at ``index``.
        new_bits: New bit patterns at ``index``.
        dtype: The tensor's dtype.
        shape: The tensor's shape.
        base: The whole published tensor the change applies to, for codecs that
            code in an order derived from it (``None``: they fall back to flat order).
    """

    index: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]
    base: torch.Tensor | None = None


@dataclasses.dataclass
class Delta:
    """A decoded, validated delta.

    Attributes:
        patches: The new values per changed tensor.
        old_bits: The bits those elements had in the state it was decoded against (unsigned
            ints, in patch order): what the state hash update and a rollback need.
    """

    step: int
    base_step: int
    base_hash: str
    state_hash: str
    codec: str
    changed: int
    total: int
    patches: dict[str, TensorPatch]
    old_bits: dict[str, np.ndarray]
    nbytes: int



def encode_delta(
    changes: Mapping[str, Change],
    *,
    step: int,
    base_step: int,
    base_hash: str,
    state_hash: str,
    total: int,
    codec: str = DEFAULT_CODEC,
    extra_metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Serialize changed elements into a delta file.

    Args:
        changes: Changed tensors by name; tensors without changes must be left out.
        step: The step of the resulting state.
        base_step: The step of the state the delta applies to.
        base_hash: Hash of the base state.
        state_hash: Hash of the resulting state.
        total: Number of elements of the whole model.
        codec: Codec name (see :func:`rlsync.codecs.list_codecs`).
        extra_metadata: More metadata strings to store (may not replace ours).

    Returns:
        The delta file's bytes.

    Raises:
        FormatError: ``step`` or ``base_step`` is not an integer readers accept (0 to 10^19 - 1).
    """
    for key, value in (("step", step), ("base_step", base_step)):
        if type(value) is not int or not 0 <= value <= MAX_METADATA_INT:
            raise FormatError(f"{key} {value!r} is not an integer in [0, {MAX_METADATA_INT}] (readers refuse it)")
    coder = get_codec(codec)
    entries: dict[str, torch.Tensor] = {}
    table: dict[str, dict[str, Any]] = {}
    names = sorted(changes)
    encode = lambda n: coder.encode(n, changes[n].index, changes[n].old_bits, changes[n].new_bits, base=changes[n].base)  # noqa: E731
    for name, encoded in zip(names, worker_pool().map(encode, names)):
        ch = changes[name]
        entries.update(encoded.entries)
        table[name] = {"dtype": dtype_name(ch.dtype), "shape": list(ch.shape), "count": int(ch.index.size), **encoded.params}
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kind": "delta",
        "sparse": "True",
        "step": str(step),
        "base_step": str(base_step),
        "base_hash": base_hash,
        "state_hash": state_hash,
        "codec": coder.name,
        "codec_version": str(coder.version),
        "changed": str(sum(t["count"] for t in table.values())),
        "total": str(total),
        "tensors": json.dumps(table, separators=(",", ":")),
    }
    for key, value in (extra_metadata or {}).items():
        if key in metadata:
            raise ValueError(f"extra metadata may not replace {key!r}")
        metadata[key] = value
    return safetensors.torch.save(entries, metadata=metadata)


def decode_delta(data: bytes, state: Mapping[str, torch.Tensor]) -> Delta:
    """Decode and fully validate a delta against the state it will be applied to.

    Nothing is written: the result holds patches to apply later.

    Args:
        data: The delta file's bytes.
        state: The current state (only read).

    Returns:
        The decoded delta, with the old bits of the elements it changes.

    Raises:
        FormatError: malformed or hostile file, unknown codec or version, a
            tensor missing from the state, a dtype or shape that does not match,
            indices out of range or duplicated, or any other failure of the codec's decoder.
    """
    header, metadata = parse_header(data)
    check_format(metadata, "delta")
    coder = get_codec(metadata_str(metadata, "codec"))
    if metadata_str(metadata, "codec_version") != str(coder.version):
        raise FormatError(f"unsupported {coder.name} codec version {metadata['codec_version']!r}")
    table = loads_bounded(metadata_str(metadata, "tensors"), what="metadata 'tensors'", max_bytes=MAX_METADATA_BYTES)
    if not isinstance(table, dict):
        raise FormatError("metadata 'tensors' is not a JSON object")
    expected_entries = {e for name in table for e in coder.entry_names(name)}
    if set(header) != expected_entries:
        raise FormatError("delta entries do not match its tensor table")
    try:
        entries = safetensors.torch.load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types
        raise FormatError(f"unreadable safetensors data: {exc}") from None
    for name, info in table.items():  # the cheap checks first, before any tensor is decoded
        if name not in state:
            raise FormatError(f"delta patches {name!r}, which is not in the model")
        target = state[name]
        if not isinstance(info, dict):
            raise FormatError(f"{name}: tensor table entry is not an object")
        if info.get("dtype") != dtype_name(target.dtype) or info.get("shape") != list(target.shape):
            raise FormatError(
                f"{name}: delta is for {info.get('dtype')} {info.get('shape')}, model has "
                f"{dtype_name(target.dtype)} {list(target.shape)}"
            )
        count = info.get("count")
        if type(count) is not int or not 0 < count <= target.numel():
            raise FormatError(f"{name}: invalid changed count {count!r}")

    def decode_tensor(name: str) -> tuple[TensorPatch, np.ndarray]:
        """One tensor's patch and the old bits of the elements it changes."""
        target, count = state[name], table[name]["count"]

        def old_bits_at(idx: np.ndarray) -> np.ndarray:
            check_index(name, idx, target.numel())  # every position a codec reads at, before it reads
            return bits_to_numpy(int_view(gather(target, torch.from_numpy(idx))))

        patched = DecodeTarget(count=count, numel=target.numel(), itemsize=target.element_size(), bits_at=old_bits_at, tensor=target)
        try:
            index, new_bits, old_bits = coder.decode(name, {k: entries[k] for k in coder.entry_names(name)}, table[name], patched)
        except FormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a decoder failing on a hostile file refuses the file, whatever it raised
            raise FormatError(f"{name}: the {coder.name} decoder failed on this delta: {type(exc).__name__}: {exc}") from exc
        check_decoded(name, index, new_bits, count=count, numel=target.numel())
        if old_bits is None:  # the state hash's update needs them (and they show a zero difference)
            old_bits = old_bits_at(index)
        elif old_bits.shape != index.shape:
            raise FormatError(f"{name}: the {coder.name} decoder gave {old_bits.size} old values for {index.size} positions")
        if not coder.changes_nonzero and bool(np.any(new_bits == old_bits)):
            raise FormatError(f"{name}: the delta lists elements that do not change (a zero difference is no change)")
        patch = TensorPatch(index=torch.from_numpy(index), values=numpy_to_values(new_bits, target.dtype), shape=tuple(target.shape))
        return patch, old_bits

    # tensors decode on the worker threads (the codecs' kernels, numpy and zstd release the GIL), largest first
    names = sorted(table, key=lambda n: -state[n].numel())
    decoded = dict(zip(names, worker_pool().map(decode_tensor, names)))
    patches = {name: patch for name, (patch, _) in decoded.items()}
    old = {name: old_bits for name, (_, old_bits) in decoded.items()}
    changed = sum(table[n]["count"] for n in names)
    if changed != metadata_int(metadata, "changed"):
        raise FormatError(f"metadata says {metadata['changed']} changed elements, tensors hold {changed}")
    return Delta(
        step=metadata_int(metadata, "step"),
        base_step=metadata_int(metadata, "base_step"),
        base_hash=metadata_str(metadata, "base_hash"),
        state_hash=metadata_str(metadata, "state_hash"),
        codec=coder.name,
        changed=changed,
        total=metadata_int(metadata, "total"),
        patches=patches,
        old_bits=old,
        nbytes=len(data),
    )
