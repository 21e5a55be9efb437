"""The wire format: anchors and deltas as safetensors files with string metadata.

Anchor: the full state under Hugging Face parameter names in the serving dtype,
readable by any safetensors reader; large states split into shards with a
``model.safetensors.index.json`` as Hugging Face checkpoints are. Metadata:
``format``, ``format_version``, ``kind=anchor``, ``sparse=False``, ``step``,
``state_hash``, ``total`` (elements).

Delta: only changed tensors, encoded by a codec (:mod:`rlsync.codecs`). Metadata:
``kind=delta``, ``sparse=True``, ``step``, ``base_step``, ``base_hash``,
``state_hash`` (result), ``codec``, ``codec_version``, ``changed``/``total``
element counts over the whole model, and ``tensors``: a JSON object giving each
changed tensor's dtype, shape, changed count and codec parameters.

Readers parse and check the header themselves before handing bytes to
safetensors, so hostile files fail with :class:`~rlsync.errors.FormatError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import safetensors.torch
import torch

from .aliases import aliases_to_metadata
from .codecs import DEFAULT_CODEC, DecodeTarget, get_codec
from .codecs.checks import check_decoded, check_index
from .dtypes import bits_to_numpy, dtype_from_name, dtype_name, int_view, numpy_to_values
from .errors import FormatError
from .files import open_regular, read_regular
from .jsonlimits import loads_bounded
from .limits import MAX_HEADER_BYTES, MAX_METADATA_BYTES
from .patch import TensorPatch, gather
from .workers import worker_pool

_DECIMAL = re.compile(r"[0-9]{1,19}")
MAX_METADATA_INT = 10**19 - 1  # what _DECIMAL accepts
FORMAT_NAME = "rlsync"
FORMAT_VERSION = 3  # 3: additive state hash (rlsync.hashing), updated from the changes alone
READABLE_FORMAT_VERSIONS = (3,)  # 1 and 2 hashed with SHA-256 trees that cost O(state) per sync: refused
#: What a reader of an older chain must do (its hashes cannot be checked against this reader's).
OLD_VERSION_ADVICE = "re-publish an anchor with this rlsync version, or start a new run (new bucket or prefix)"
MAX_DIMS = 64
# JSON objects in a header (its entries, plus any "{" inside metadata strings, such as a delta's
# tensor table): a model of 100,000 tensors needs a few per tensor; more is a header built to cost
# time and memory to parse (each entry becomes Python objects: ~2.5 KB and ~10 us apiece).
MAX_HEADER_ENTRIES = 1 << 19
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


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


# ---------------------------------------------------------------------------
# header parsing


def parse_header(data: bytes | memoryview, *, file_size: int | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and check a safetensors header without trusting any declared size.

    Args:
        data: The file's bytes, or at least its first 8 + header-length bytes.
        file_size: The whole file's size when ``data`` holds only its start.

    Returns:
        ``(entries, metadata)``: entry name -> ``{"dtype", "shape", "data_offsets"}``,
        and the ``__metadata__`` strings.

    Raises:
        FormatError: truncated file, oversized or malformed header, more than
            ``MAX_HEADER_ENTRIES`` JSON objects in it, offsets past the end of the
            file, overlapping or mis-sized entries.
    """
    size = len(data) if file_size is None else file_size
    if min(size, len(data)) < 8:
        raise FormatError(f"not a safetensors file: {min(size, len(data))} bytes is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if header_len > MAX_HEADER_BYTES or header_len > size - 8:
        raise FormatError(f"safetensors header declares {header_len} bytes but the file has {size} bytes")
    if len(data) < 8 + header_len:
        raise FormatError("safetensors header is truncated")
    objects = bytes(data[8 : 8 + header_len]).count(b"{")  # every entry is one, so this bounds entries before parsing
    if objects > MAX_HEADER_ENTRIES:
        raise FormatError(f"safetensors header has up to {objects:,} entries, more than the {MAX_HEADER_ENTRIES:,} allowed")
    header = loads_bounded(data[8 : 8 + header_len], what="safetensors header", max_bytes=MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise FormatError("malformed safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("malformed safetensors metadata: values must be strings")
    body = size - 8 - header_len
    spans = []
    for name, info in header.items():
        try:
            dtype = dtype_from_name(info["dtype"])
            shape = [_json_int(d) for d in info["shape"]]
            start, end = (_json_int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"malformed safetensors entry {name!r}: {exc}") from None
        if not 0 <= start <= end <= body:
            raise FormatError(f"entry {name!r}: data offsets {start}..{end} outside the {body}-byte data section")
        if shaped_nbytes(shape, torch.empty((), dtype=dtype).element_size(), limit=body) != end - start:
            raise FormatError(f"entry {name!r}: {end - start} bytes do not match shape {str(shape)[:80]} of {info['dtype']}")
        spans.append((start, end))
    spans.sort()
    for (_, end_a), (start_b, _) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise FormatError("safetensors entries overlap")
    return header, metadata


def shaped_nbytes(shape: list[int], itemsize: int, *, limit: int) -> int | None:
    """Bytes of a tensor of ``shape``, or ``None`` when that exceeds ``limit``.

    Every dimension is bounded before any product is taken, and the product stops
    as soon as it passes ``limit``, so hostile shapes (many huge dimensions) cost
    linear time.

    Raises:
        FormatError: more than ``MAX_DIMS`` dimensions or a negative one.
    """
    if len(shape) > MAX_DIMS:
        raise FormatError(f"shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise FormatError(f"shape {str(shape)[:80]} has a negative dimension")
    if 0 in shape:
        return 0
    nbytes = itemsize
    for d in shape:
        if d > limit:
            return None
        nbytes *= d
        if nbytes > limit:
            return None
    return nbytes


def _json_int(value: Any) -> int:
    """``value`` if it is a JSON integer; raises TypeError for floats (1.5), bools and the rest."""
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def read_header_file(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """:func:`parse_header` for a regular file on disk, reading only its header.

    Raises:
        FormatError: see :func:`parse_header`.
        OSError: missing, or not a regular file (a FIFO is refused without blocking).
    """
    fd, size = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= MAX_HEADER_BYTES and n <= size - 8:
                head += f.read(n)
    return parse_header(head, file_size=size)


def _require(metadata: Mapping[str, str], key: str) -> str:
    if key not in metadata:
        raise FormatError(f"metadata has no {key!r}")
    return metadata[key]


def metadata_int(metadata: Mapping[str, str], key: str) -> int:
    """A non-negative decimal integer of at most 19 digits from the metadata.

    Raises:
        FormatError: missing, or not such an integer.
    """
    value = _require(metadata, key)
    if not _DECIMAL.fullmatch(value):
        raise FormatError(f"metadata {key!r} is not a non-negative integer: {value[:40]!r}")
    return int(value)


def check_format(metadata: Mapping[str, str], kind: str) -> None:
    """Check format name, version and kind.

    Raises:
        FormatError: another format, an unknown version or the wrong kind.
    """
    if metadata.get("format") != FORMAT_NAME:
        raise FormatError(f"not an {FORMAT_NAME} file (format={metadata.get('format')!r})")
    check_version(metadata.get("format_version"), "file")
    if metadata.get("kind") != kind:
        raise FormatError(f"expected a {kind}, got kind={metadata.get('kind')!r}")


def check_version(version: Any, what: str) -> None:
    """Refuse a format version this reader cannot read.

    Args:
        version: The version as found (a string in file metadata, an int in the pointer).
        what: What carries it, for the message ("file", "pointer").

    Raises:
        FormatError: the version is not in :data:`READABLE_FORMAT_VERSIONS`; the message
            names it and says what to do.
    """
    if type(version) not in (str, int) or str(version) not in {str(v) for v in READABLE_FORMAT_VERSIONS}:
        raise FormatError(
            f"unsupported {FORMAT_NAME} {what} format version {str(version)[:40]!r}: this reader reads version(s) "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}; {OLD_VERSION_ADVICE}"
        )


def file_kind(metadata: Mapping[str, str]) -> str:
    """``"anchor"`` or ``"delta"`` for one of our files; raises FormatError otherwise."""
    kind = metadata.get("kind")
    if kind not in ("anchor", "delta"):
        raise FormatError(f"unknown file kind {kind!r}")
    check_format(metadata, kind)
    return kind


# ---------------------------------------------------------------------------
# deltas


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
    coder = get_codec(_require(metadata, "codec"))
    if _require(metadata, "codec_version") != str(coder.version):
        raise FormatError(f"unsupported {coder.name} codec version {metadata['codec_version']!r}")
    table = loads_bounded(_require(metadata, "tensors"), what="metadata 'tensors'", max_bytes=MAX_METADATA_BYTES)
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
        base_hash=_require(metadata, "base_hash"),
        state_hash=_require(metadata, "state_hash"),
        codec=coder.name,
        changed=changed,
        total=metadata_int(metadata, "total"),
        patches=patches,
        old_bits=old,
        nbytes=len(data),
    )


# ---------------------------------------------------------------------------
# anchors


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
