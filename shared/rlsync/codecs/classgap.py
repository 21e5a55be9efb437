"""``classgap``: ``gapzz`` taken in an order the receiver rebuilds from the old weights.

Whether an element changes depends strongly on its own magnitude: a step flips a
bf16 bit only when it is at least about ``|w| / 256``, so small weights change far
more often than large ones. The receiver holds the old weights, so both sides can
sort every element by a *class* computed from its old bits, the exponent field of
its float dtype, and code the changed elements in that order: within one class
changes are about equally likely, so the gaps there are short and regular where
changes are dense and long where they are rare, which zstd codes much better than
gaps in flat order (the context-free position entropy is the floor for those).

The coding order is class by class over the whole tensor, flat order within a
class; both sides build it chunk by chunk (:data:`CHUNK` elements: a stable sort
per chunk and a chunks x classes table of counts), so the work memory beyond one
byte of class per element stays bounded. The changed elements' ranks in that
order are gap-coded as :mod:`~rlsync.codecs.gapzz` codes positions. Their values,
in the same order, are split into the sign of the wrapping difference (one raw
bit each: RL steps go up and down about equally often) and its magnitude minus
one (byte planes, zstd; mostly 0, as most changes are one unit in the last place).

Tensors whose dtype has no exponent field (integers, bool) or that are encoded
without their base tensor use flat order (``"order": "flat"``; positions exactly
as ``gapzz``). The order is computed with torch on the base tensor's device, so
on a GPU trainer the sorts run there and only the changed elements' ranks come back.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from ..dtypes import EXPONENT_FIELDS, dtype_name, int_view
from ..errors import FormatError
from ..registry import Kind, register
from .base import DecodeTarget
from .checks import require_entry
from .gapzz import GapZigzagCodec, join_planes

#: Elements per class-ordering chunk; part of the format (changing it needs a new version).
CHUNK = 1 << 20

def signed_view(bits: np.ndarray) -> np.ndarray:
    """Unsigned bit patterns as signed ints of the same width (torch has no wide unsigned arithmetic)."""
    return bits.view(np.dtype(f"int{8 * bits.itemsize}"))


def exponent_classes(chunks: Iterable[torch.Tensor], numel: int, field: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Exponent class of every element, from the old bits given chunk by chunk.

    Args:
        chunks: 1-D signed int views of the old bits, :data:`CHUNK` elements each (the last may be shorter).
        numel: Elements in all.
        field: ``(shift, mask)`` of the dtype's exponent field.
        device: Where the classes are kept.

    Returns:
        ``uint8`` classes (``int16`` for dtypes with more than 256 exponents), one byte or two per element.
    """
    shift, mask = field
    classes = torch.empty(numel, dtype=torch.uint8 if mask <= 0xFF else torch.int16, device=device)
    for start, bits in zip(range(0, numel, CHUNK), chunks):
        classes[start : start + bits.numel()] = (bits.to(device) >> shift) & mask
    return classes


class ClassOrder:
    """The coding order of one tensor: class by class over the whole tensor, flat order within a class.

    Only per-chunk sorts and a (chunks x classes) table of counts are needed, so
    the work memory beyond the classes themselves is bounded by :data:`CHUNK`.

    Args:
        classes: Every element's class (from :func:`exponent_classes`).
        n_classes: Number of possible classes (``mask + 1``).
    """

    def __init__(self, classes: torch.Tensor, n_classes: int) -> None:
        self.classes = classes
        self.numel = classes.numel()
        counts = torch.stack(
            [torch.bincount(classes[s : s + CHUNK].long(), minlength=n_classes) for s in range(0, self.numel, CHUNK)]
        )  # (chunks, classes)
        totals = counts.sum(0)
        self.class_start = torch.cumsum(totals, 0) - totals  # first rank of each class
        self.before_chunk = torch.cumsum(counts, 0) - counts  # class members in earlier chunks
        self.in_chunk_start = torch.cumsum(counts, 1) - counts  # first slot of each class in a chunk's sorted order
        self.upto_chunk = torch.cumsum(counts, 0)  # class members up to and including each chunk

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, field: tuple[int, int]) -> "ClassOrder":
        """The coding order of ``tensor``'s current bits, built on its own device."""
        flat = int_view(tensor.detach())
        chunks = (flat[s : s + CHUNK] for s in range(0, flat.numel(), CHUNK))
        return cls(exponent_classes(chunks, flat.numel(), field, flat.device), field[1] + 1)

    def _chunk_order(self, chunk: int) -> torch.Tensor:
        """Positions within chunk ``chunk``, sorted stably by class."""
        part = self.classes[chunk * CHUNK : (chunk + 1) * CHUNK]
        if part.device.type == "cpu":  # numpy's stable sort of small ints is a radix sort, several times torch's
            return torch.from_numpy(np.argsort(part.numpy(), kind="stable"))
        return torch.sort(part, stable=True).indices

    def ranks_of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ranks of the elements at sorted positions ``index``; returns ``(ranks, positions)``, both in rank order."""
        bounds = torch.searchsorted(index, torch.arange(0, self.numel + CHUNK, CHUNK, device=index.device)).tolist()
        ranks, positions = [], []
        for chunk, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if lo == hi:
                continue
            start = chunk * CHUNK
            order = self._chunk_order(chunk)
            changed = torch.zeros(order.numel(), dtype=torch.bool, device=order.device)
            changed[index[lo:hi] - start] = True
            slot = torch.nonzero(changed[order]).squeeze(1)
            cls = self.classes[order[slot] + start].long()
            ranks.append(self.class_start[cls] + self.before_chunk[chunk, cls] + slot - self.in_chunk_start[chunk, cls])
            positions.append(order[slot] + start)
        rank, position = torch.cat(ranks), torch.cat(positions)
        by_rank = torch.argsort(rank)
        return rank[by_rank], position[by_rank]

    def positions_of(self, ranks: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`ranks_of`: flat positions of strictly increasing ranks in ``[0, numel)``, in rank order."""
        cls = torch.searchsorted(self.class_start, ranks, right=True) - 1
        within = ranks - self.class_start[cls]
        n_chunks = self.upto_chunk.shape[0]
        # The chunk holding the within-class member: search each class's cumulative counts at once,
        # offsetting class c's column by c * (numel + 1) so that the flattened table stays sorted.
        column_offset = torch.arange(self.upto_chunk.shape[1], device=ranks.device).unsqueeze(1) * (self.numel + 1)
        keys = (self.upto_chunk.T + column_offset).reshape(-1)
        chunk = torch.searchsorted(keys, cls * (self.numel + 1) + within, right=True) - cls * n_chunks
        slot = self.in_chunk_start[chunk, cls] + within - self.before_chunk[chunk, cls]
        by_chunk = torch.argsort(chunk, stable=True)
        bounds = torch.searchsorted(chunk[by_chunk], torch.arange(n_chunks + 1, device=ranks.device)).tolist()
        positions = torch.empty_like(ranks)
        for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if lo == hi:
                continue
            here = by_chunk[lo:hi]
            order = self._chunk_order(c)
            positions[here] = order[slot[here]] + c * CHUNK
        return positions


class ClassGapCodec(GapZigzagCodec):
    """Ranks in the old weights' exponent-class order, gap-coded; value magnitudes zstd-coded, signs as raw bits."""

    name = "classgap"
    version = 1
    changes_nonzero = True  # a difference is stored as its magnitude minus one, below half the dtype's range

    def entry_names(self, name: str) -> list[str]:
        return [f"{name}.pos", f"{name}.val", f"{name}.sign"]

    def _coding_order(self, index: np.ndarray, base: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        if base is None or index.size == 0 or dtype_name(base.dtype) not in EXPONENT_FIELDS:
            return index, None, {"order": "flat"}
        order = ClassOrder.of_tensor(base, EXPONENT_FIELDS[dtype_name(base.dtype)])
        rank, position = order.ranks_of(torch.from_numpy(index).to(base.device))
        return rank.cpu().numpy(), np.searchsorted(index, position.cpu().numpy()), {"order": "exponent"}

    def _flat_positions(
        self, name: str, coded: np.ndarray, params: Mapping[str, Any], target: DecodeTarget
    ) -> tuple[np.ndarray, np.ndarray | None]:
        order, dtype = params.get("order"), params.get("dtype")
        field = EXPONENT_FIELDS.get(dtype) if isinstance(dtype, str) else None
        if order == "flat":
            return coded, None
        if order != "exponent" or field is None:
            raise FormatError(f"{name}: invalid order {order!r} for dtype {dtype!r}")
        if target.tensor is not None:  # the class order is built where the old weights are (a GPU replica's device)
            coding_order = ClassOrder.of_tensor(target.tensor, field)
        else:
            chunks = (
                torch.from_numpy(signed_view(target.bits_at(np.arange(s, min(s + CHUNK, target.numel), dtype=np.int64))))
                for s in range(0, target.numel, CHUNK)
            )
            coding_order = ClassOrder(exponent_classes(chunks, target.numel, field, torch.device("cpu")), field[1] + 1)
        positions = coding_order.positions_of(torch.from_numpy(coded).to(coding_order.classes.device)).cpu().numpy()
        flat_order = np.argsort(positions, kind="stable")
        return positions[flat_order], flat_order

    def _encode_values(
        self, name: str, old_bits: np.ndarray, new_bits: np.ndarray, order: np.ndarray | None = None
    ) -> dict[str, torch.Tensor]:
        """Magnitude minus one of each wrapping difference as ``{name}.val`` (zstd), its sign as ``{name}.sign``,
        in the order ``order`` (default: as given).

        RL steps move values up and down about equally often, so a sign costs one
        bit whatever the coder; stored apart, the magnitudes (mostly 0: one unit in
        the last place) compress far better than zigzag codes mixing both.
        """
        from .rice_kernels import value_streams

        order = np.arange(old_bits.size) if order is None else order
        planes, signs = np.empty(order.size * old_bits.itemsize, np.uint8), np.zeros((order.size + 7) // 8, np.uint8)
        value_streams(old_bits, new_bits, order, planes, signs)
        return {f"{name}.val": self._compress(planes), f"{name}.sign": torch.from_numpy(signs)}

    def _value_streams(self, name: str, entries: Mapping[str, torch.Tensor], target: DecodeTarget) -> tuple[np.ndarray, np.ndarray]:
        """The magnitudes' byte planes (decompressed) and the packed signs, each checked for its size."""
        val_key, sign_key = f"{name}.val", f"{name}.sign"
        planes = self._decompress(val_key, require_entry(entries, val_key, torch.uint8), target.count * target.itemsize)
        return planes, require_entry(entries, sign_key, torch.uint8, (target.count + 7) // 8).numpy()

    def _decode_values(self, name: str, entries: Mapping[str, torch.Tensor], target: DecodeTarget) -> np.ndarray:
        count, itemsize = target.count, target.itemsize
        planes, packed = self._value_streams(name, entries, target)
        magnitude = join_planes(planes, itemsize)
        if magnitude.size and int(magnitude.max()) >= 1 << (8 * itemsize - 1):
            raise value_error(name, ValueFault.MAGNITUDE)
        negative = np.unpackbits(packed, count=None, bitorder="little").view(bool)
        if negative[count:].any():
            raise value_error(name, ValueFault.SIGN_PADDING)
        step = magnitude + magnitude.dtype.type(1)
        return np.where(negative[:count], magnitude.dtype.type(0) - step, step)


class ValueFault(enum.IntEnum):
    """What is wrong with a tensor's value streams (the codes :func:`~.rice_kernels.add_differences` returns)."""

    MAGNITUDE = 1
    SIGN_PADDING = 2


def value_error(name: str, fault: ValueFault) -> FormatError:
    """The refusal of tensor ``name``'s value streams for ``fault``."""
    if fault is ValueFault.MAGNITUDE:
        return FormatError(f"entry {name + '.val'!r}: a magnitude does not fit the dtype's signed range")
    return FormatError(f"entry {name + '.sign'!r}: padding bits after the last sign are set")


register(Kind.CODEC, "classgap", "rlsync.codecs.classgap:ClassGapCodec",
         summary="gapzz in an order the receiver rebuilds from the old weights")
