"""Whole-state hashes: the bit-exactness check of every sync.

The hash of a state is SHA-256 over the tensors in sorted name order, each
contributing its name and a per-tensor digest. It depends only on bits, never
on float values.

Per-tensor digest, format version 2 (current): SHA-256 of the tensor's dtype,
shape and the root of a Merkle tree over its raw bytes (row-major) cut into
fixed :data:`LEAF_BYTES` leaves. Leaves are ``SHA-256(0x00 || bytes)``, inner
nodes ``SHA-256(0x01 || left || right)``; a node over leaves ``[lo, hi)`` splits
at ``lo`` plus the largest power of two below ``hi - lo`` (BLAKE3's shape), so
every aligned power-of-two block of leaves is a node. A holder of any flat slice
of a tensor (one FSDP2 ``Shard(0)`` rank, one tensor-parallel rank) computes the
roots of the blocks inside its slice plus the raw bytes of at most two partial
leaves at its edges (:func:`slice_record`); :func:`merge_records` combines the
records of all slices into the same digest, whatever the sharding. Nothing
larger than two leaves per slice ever moves.

Format version 1 hashed each tensor's bytes with one flat SHA-256
(:func:`tensor_digest` with ``version=1``); it is kept only for reading
version-1 chains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Iterable, Mapping

import torch

from .dtypes import dtype_name, int_view

HASH_ALGORITHM = "sha256-tree16k"
HASH_VERSION = 2
LEAF_BYTES = 16 * 1024
_LEAF, _NODE = b"\x00", b"\x01"


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bits (row-major) as a flat byte view (copied to CPU, made contiguous, if needed)."""
    if not tensor.numel():
        return memoryview(b"")
    data = int_view(tensor.detach()).cpu().contiguous()
    return memoryview(data.view(torch.uint8).numpy()).cast("B")


def _leaf(data: memoryview | bytes) -> bytes:
    h = hashlib.sha256(_LEAF)
    h.update(data)  # hashlib releases the GIL on large buffers
    return h.digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def leaf_count(nbytes: int) -> int:
    """Leaves of a tensor of ``nbytes`` bytes (an empty tensor has one empty leaf)."""
    return max(1, -(-nbytes // LEAF_BYTES))


def _split(lo: int, hi: int) -> int:
    """Where the node over leaves ``[lo, hi)`` (at least two) splits."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def _aligned_blocks(lo: int, hi: int) -> Iterable[tuple[int, int]]:
    """Maximal aligned power-of-two blocks of leaves covering ``[lo, hi)``, in order."""
    while lo < hi:
        size = lo & -lo if lo else 1 << (hi.bit_length())
        while lo + size > hi:
            size >>= 1
        yield lo, lo + size
        lo += size


@dataclasses.dataclass(frozen=True)
class SliceRecord:
    """What the holder of one flat byte slice of a tensor contributes to its digest.

    Attributes:
        start: First byte of the slice in the full tensor (row-major).
        end: One past its last byte.
        roots: ``(lo, hi, digest)`` of the complete tree nodes inside the slice.
        pieces: ``(offset, bytes)`` of the partial leaves at its edges (at most two).
    """

    start: int
    end: int
    roots: tuple[tuple[int, int, bytes], ...]
    pieces: tuple[tuple[int, bytes], ...]


def slice_record(data: memoryview | bytes, start: int, total_bytes: int) -> SliceRecord:
    """The record of ``data``, the bytes ``[start, start + len(data))`` of a tensor of ``total_bytes``.

    Args:
        data: The slice's raw bytes.
        start: Its byte offset in the full tensor.
        total_bytes: The full tensor's size in bytes.

    Returns:
        The record for :func:`merge_records`.
    """
    data = memoryview(data).cast("B")
    end = start + len(data)
    if not 0 <= start <= end <= total_bytes:
        raise ValueError(f"slice {start}..{end} outside a tensor of {total_bytes} bytes")
    n = leaf_count(total_bytes)
    first = -(-start // LEAF_BYTES)  # first leaf starting inside the slice
    last = n if end == total_bytes else end // LEAF_BYTES  # leaves [first, last) are complete
    if first >= last:  # no complete leaf: at most two partial ones, cut at the leaf boundary
        cuts = sorted({start, end} | ({first * LEAF_BYTES} if start < first * LEAF_BYTES < end else set()))
        pieces = tuple((a, bytes(data[a - start : b - start])) for a, b in zip(cuts, cuts[1:]))
        return SliceRecord(start, end, (), pieces)
    pieces = []
    if start < first * LEAF_BYTES:
        pieces.append((start, bytes(data[: first * LEAF_BYTES - start])))
    if last * LEAF_BYTES < end:
        pieces.append((last * LEAF_BYTES, bytes(data[last * LEAF_BYTES - start :])))
    roots = []
    for lo, hi in _aligned_blocks(first, last):
        level = [_leaf(data[i * LEAF_BYTES - start : min((i + 1) * LEAF_BYTES, end) - start]) for i in range(lo, hi)]
        while len(level) > 1:
            level = [_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        roots.append((lo, hi, level[0]))
    return SliceRecord(start, end, tuple(roots), tuple(pieces))


def merge_records(records: Iterable[SliceRecord], dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Combine the records of slices covering a whole tensor into its digest.

    Raises:
        ValueError: the records do not cover the tensor exactly once.
    """
    total = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    records = sorted(records, key=lambda r: (r.start, r.end))
    covered = 0
    for r in records:
        if r.start != covered:
            raise ValueError(f"slices leave bytes {covered}..{r.start} uncovered or overlap")
        covered = r.end
    if covered != total:
        raise ValueError(f"slices cover {covered} of {total} bytes")
    nodes = {(lo, hi): digest for r in records for lo, hi, digest in r.roots}
    partial: dict[int, list[tuple[int, bytes]]] = {}
    for r in records:
        for offset, piece in r.pieces:
            partial.setdefault(offset // LEAF_BYTES, []).append((offset, piece))
    for leaf, parts in partial.items():
        data = b"".join(p for _, p in sorted(parts))
        if len(data) != min((leaf + 1) * LEAF_BYTES, total) - leaf * LEAF_BYTES:
            raise ValueError(f"leaf {leaf} is not covered by its pieces")
        nodes[(leaf, leaf + 1)] = _leaf(data)
    if total == 0:
        nodes[(0, 1)] = _leaf(b"")
    return _header_digest(dtype, shape, _root(nodes, 0, leaf_count(total)))


def _root(nodes: dict[tuple[int, int], bytes], lo: int, hi: int) -> bytes:
    known = nodes.get((lo, hi))
    if known is not None:
        return known
    if hi - lo == 1:
        raise ValueError(f"leaf {lo} is missing")
    mid = _split(lo, hi)
    return _node(_root(nodes, lo, mid), _root(nodes, mid, hi))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _header_digest(dtype: torch.dtype, shape: tuple[int, ...], content: bytes | memoryview) -> bytes:
    h = hashlib.sha256()
    h.update(dtype_name(dtype).encode())
    h.update(struct.pack(f"<{len(shape) + 1}q", len(shape), *shape))
    h.update(content)
    return h.digest()


def tensor_digest(tensor: torch.Tensor, *, version: int = HASH_VERSION) -> bytes:
    """Digest of a whole tensor's dtype, shape and raw bytes.

    Args:
        tensor: The tensor (any device).
        version: The format version whose hash to compute (1: flat SHA-256, 2: tree).

    Raises:
        ValueError: an unknown version.
    """
    data = raw_bytes(tensor)
    shape = tuple(tensor.shape)
    if version == 1:
        return _header_digest(tensor.dtype, shape, data)
    if version != HASH_VERSION:
        raise ValueError(f"unknown state hash version {version}")
    return merge_records([slice_record(data, 0, len(data))], tensor.dtype, shape)


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """Combine per-tensor digests (see :func:`tensor_digest`) into a state hash."""
    h = hashlib.sha256()
    for name in sorted(digests):
        encoded = name.encode()
        h.update(struct.pack("<q", len(encoded)))
        h.update(encoded)
        h.update(digests[name])
    return h.hexdigest()


def state_hash(state: Mapping[str, torch.Tensor], *, version: int = HASH_VERSION) -> str:
    """Hex SHA-256 of a whole state (names, dtypes, shapes and bytes)."""
    return combine_digests({name: tensor_digest(t, version=version) for name, t in state.items()})
