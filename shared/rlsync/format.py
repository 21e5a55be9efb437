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

This module: the format's name and versions, and reading a header (:func:`parse_header`, the metadata's
checks). Deltas: :mod:`rlsync.delta_format`; anchors: :mod:`rlsync.anchor_format`.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import torch

from .dtypes import dtype_from_name
from .errors import FormatError
from .files import open_regular
from .jsonlimits import loads_bounded
from .limits import MAX_HEADER_BYTES

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


def metadata_str(metadata: Mapping[str, str], key: str) -> str:
    """A metadata string; raises FormatError when it is missing."""
    if key not in metadata:
        raise FormatError(f"metadata has no {key!r}")
    return metadata[key]


def metadata_int(metadata: Mapping[str, str], key: str) -> int:
    """A non-negative decimal integer of at most 19 digits from the metadata.

    Raises:
        FormatError: missing, or not such an integer.
    """
    value = metadata_str(metadata, key)
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
