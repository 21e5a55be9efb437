"""Whole-state hashes: the bit-exactness check of every sync, maintained in O(changed).

A state is a multiset of elements ``(tensor, flat index, raw bits)``. Its hash adds, over all
elements, a 128-bit value ``f(tensor, index, bits)`` in :data:`LANES` lanes of 64 bits, each
modulo 2^64 (an additive multiset hash, LtHash's construction with a fast non-cryptographic
``f``), and ends with SHA-256 over a digest of the structure (names, dtypes, shapes) and the
lanes. Only bits are read, never float values: NaN payloads, -0.0 and subnormals count as they
are stored.

Because the lanes are a sum, they are updated from the changed elements alone: a delta adds
``f(new) - f(old)`` at each changed position (:func:`change_lanes`); and any holder of a flat
slice of a tensor (an FSDP2 ``Shard(0)`` rank, a tensor-parallel rank, a thread hashing one
chunk) computes the sum over its slice (:func:`slice_lanes`); the parts add up to the whole,
whatever the slicing.

``f``: with ``w`` the dtype's width in bits and ``s`` a 64-bit seed taken from the tensor's name,
the element's key is ``s + (index << w | bits)`` when every index of the tensor fits above the
bits (``numel <= 2^(64 - w)``: every 8- and 16-bit tensor below 2^48 elements), else
``mix(s + index * G) ^ bits``; the lanes add ``mix(key)`` and ``mix2(key)``, two bijective
64-bit finalisers (SplitMix64's and another set of constants). Within a tensor the key is
injective in (index, bits) in the first form.

What it protects against, and what not: see ``docs/library.md``, "The state hash".
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Iterable, Mapping

import numba
import numpy as np
import torch

from .dtypes import dtype_name, tensor_bits
from .workers import worker_pool

LANES = 2
#: Elements hashed per task (bounds the bits copied off a device at once, and splits work between threads).
CHUNK_ELEMENTS = 1 << 22

_G = 0x9E3779B97F4A7C15
_GROUPS = 8  # tasks one update is split into
_DOMAIN = b"rlsync-lthash-2x64\x00"
_JIT = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")


@numba.njit(inline="always")
def _mix(z):  # pragma: no cover - compiled
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(inline="always")
def _mix2(z):  # pragma: no cover - compiled
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x3C79AC492BA7B653)
    z = (z ^ (z >> np.uint64(33))) * np.uint64(0x1C69B3F74AC4AE35)
    return z ^ (z >> np.uint64(27))


@numba.njit(inline="always")
def _key(seed, index, bits, width):  # pragma: no cover - compiled
    if width < 64:
        return seed + ((np.uint64(index) << np.uint64(width)) | np.uint64(bits))
    return _mix(seed + np.uint64(index) * np.uint64(_G)) ^ np.uint64(bits)


@numba.njit(**_JIT)
def _range_lanes(bits, start, seed, width, out):  # pragma: no cover - compiled
    """Add ``f`` of ``bits[k]`` at flat index ``start + k``, for every k, to ``out``."""
    a = np.uint64(0)
    b = np.uint64(0)
    for k in range(bits.size):
        key = _key(seed, start + k, bits[k], width)
        a += _mix(key)
        b += _mix2(key)
    out[0] += a
    out[1] += b


@numba.njit(**_JIT)
def _diff_lanes(index, old, new, seed, width, out):  # pragma: no cover - compiled
    """Add ``f(new[k]) - f(old[k])`` at flat index ``index[k]``, for every k, to ``out``."""
    a = np.uint64(0)
    b = np.uint64(0)
    for k in range(index.size):
        kn = _key(seed, index[k], new[k], width)
        ko = _key(seed, index[k], old[k], width)
        a += _mix(kn) - _mix(ko)
        b += _mix2(kn) - _mix2(ko)
    out[0] += a
    out[1] += b


def zero_lanes() -> np.ndarray:
    """The lanes of nothing (the identity of the sum)."""
    return np.zeros(LANES, np.uint64)


def add_lanes(parts: Iterable[np.ndarray]) -> np.ndarray:
    """The sum of lane vectors, modulo 2^64 per lane."""
    total = zero_lanes()
    for p in parts:
        total += p  # uint64 arrays wrap
    return total


def tensor_seed(name: str) -> np.uint64:
    """The 64-bit seed of a tensor's elements, from its name."""
    return np.uint64(int.from_bytes(hashlib.sha256(b"rlsync-tensor\x00" + name.encode()).digest()[:8], "little"))


def _width(itemsize: int, numel: int) -> np.uint64:
    """Bits of the dtype when every index fits above them in a 64-bit key, else 64 (see the module docstring)."""
    width = 8 * itemsize
    return np.uint64(width if width < 64 and numel <= 1 << (64 - width) else 64)


def slice_lanes(name: str, flat: torch.Tensor, start: int, numel: int) -> np.ndarray:
    """Lanes of the elements ``[start, start + flat.numel())`` of a tensor of ``numel`` elements.

    Args:
        name: The tensor's name.
        flat: The slice's elements (any device; copied to CPU a chunk at a time).
        start: Flat index of its first element in the whole tensor.
        numel: Elements of the whole tensor.

    Raises:
        ValueError: the slice is not inside the tensor.
    """
    flat = flat.detach().reshape(-1)
    if not 0 <= start <= start + flat.numel() <= numel:
        raise ValueError(f"{name}: slice {start}..{start + flat.numel()} outside a tensor of {numel} elements")
    seed, width = tensor_seed(name), _width(flat.element_size(), numel)

    def chunk(lo: int) -> np.ndarray:
        out = zero_lanes()
        _range_lanes(tensor_bits(flat[lo : lo + CHUNK_ELEMENTS].cpu()), start + lo, seed, width, out)
        return out

    return add_lanes(worker_pool().map(chunk, range(0, flat.numel(), CHUNK_ELEMENTS)))


def tensor_lanes(name: str, tensor: torch.Tensor) -> np.ndarray:
    """Lanes of a whole tensor's elements."""
    return slice_lanes(name, tensor.reshape(-1), 0, tensor.numel())


def change_lanes(name: str, itemsize: int, numel: int, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """What changing the elements at ``index`` from ``old_bits`` to ``new_bits`` adds to the lanes.

    Args:
        name: The tensor's name.
        itemsize: Bytes per element.
        numel: Elements of the whole tensor.
        index: Flat positions (any order, each once).
        old_bits, new_bits: Unsigned bit patterns at ``index``, before and after.
    """
    out = zero_lanes()
    if index.size:
        _diff_lanes(
            np.ascontiguousarray(index, dtype=np.int64), np.ascontiguousarray(old_bits), np.ascontiguousarray(new_bits),
            tensor_seed(name), _width(itemsize, numel), out,
        )  # fmt: skip
    return out


def changes_lanes(changes: Mapping[str, tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """:func:`change_lanes` of several tensors at once, spread over the worker threads.

    Args:
        changes: Tensor name -> ``(itemsize, numel, index, old_bits, new_bits)``.
    """
    by_size = sorted(changes, key=lambda n: -changes[n][2].size)
    groups = [by_size[i::_GROUPS] for i in range(_GROUPS)]  # a few balanced tasks, not one per tensor
    out: dict[str, np.ndarray] = {}
    for part in worker_pool().map(lambda group: {n: change_lanes(n, *changes[n]) for n in group}, groups):
        out.update(part)
    return out


def structure_digest(schema: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> bytes:
    """SHA-256 of the names, dtypes and shapes of a state (``name -> (dtype, shape)``), in name order."""
    h = hashlib.sha256(b"rlsync-structure\x00")
    for name in sorted(schema):
        dtype, shape = schema[name]
        encoded, dname = name.encode(), dtype_name(dtype).encode()
        h.update(struct.pack("<q", len(encoded)) + encoded + struct.pack("<q", len(dname)) + dname)
        h.update(struct.pack(f"<{len(shape) + 1}q", len(shape), *shape))
    return h.digest()


def schema_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``name -> (dtype, shape)`` of a state."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


def finish(structure: bytes, lanes: np.ndarray) -> str:
    """The state hash (hex SHA-256) of a structure digest and the lanes of all elements."""
    return hashlib.sha256(_DOMAIN + structure + lanes.astype("<u8").tobytes()).hexdigest()


@dataclasses.dataclass
class StateLanes:
    """A state's hash, kept per tensor so that it can be updated from changes and checked tensor by tensor.

    Attributes:
        structure: :func:`structure_digest` of the state.
        tensors: Lanes of each tensor.
    """

    structure: bytes
    tensors: dict[str, np.ndarray]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> StateLanes:
        """Hash a whole state in one pass."""
        return cls.of_items(state.items())

    @classmethod
    def of_items(cls, items: Iterable[tuple[str, torch.Tensor]]) -> StateLanes:
        """Hash a state given one ``(name, tensor)`` at a time (each can be released after its turn)."""
        schema, tensors = {}, {}
        for name, tensor in items:
            schema[name] = (tensor.dtype, tuple(tensor.shape))
            tensors[name] = tensor_lanes(name, tensor)
        return cls(structure_digest(schema), tensors)

    def hexdigest(self) -> str:
        """The state hash."""
        return finish(self.structure, add_lanes(self.tensors.values()))

    def updated(self, diffs: Mapping[str, np.ndarray]) -> StateLanes:
        """A copy with each tensor's lanes plus its entry of ``diffs`` (see :func:`change_lanes`)."""
        tensors = dict(self.tensors)
        for name, diff in diffs.items():
            tensors[name] = tensors[name] + diff
        return StateLanes(self.structure, tensors)


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """Hex state hash of a whole state (names, dtypes, shapes and bits)."""
    return StateLanes.of(state).hexdigest()
