"""``classrice``: positions Golomb-Rice coded per exponent class of the old weights.

Whether a bf16 element changes depends on its magnitude (a step flips a bit only when it is at
least about ``|w| / 256``), and the receiver holds the old weights. So both sides split a tensor's
elements into classes by the exponent field of their old bits, and within one class the changes
are close to independent: the gaps between changed elements, counted in class members, are
geometric. A Golomb-Rice code with one parameter per class is within a few percent of the entropy
of a geometric source, so the positions cost about the class-conditional entropy (the floor
:mod:`benchmarks.entropy` reports as "old exponent"), where zstd over gaps in flat order cannot
see the classes at all. A class where more than half the members changed lists its unchanged
members instead. Values are coded as in :mod:`~rlsync.codecs.classgap`: the sign of the wrapping
difference as a raw bit, its magnitude minus one zstd-coded (mostly 0: one unit in the last place).

Entries per tensor: ``{name}.pos`` holds the class table (per coded class: class, Rice parameter
and "inverted" flag, count; ``classes`` rows of :data:`TABLE`), then the unary quotients
(``unary_bytes`` bytes), then the remainders; ``{name}.val`` and ``{name}.sign`` the values.

Speed: the ranks within classes need one pass over the old weights on each side. On CPU that pass
is a compiled kernel (:mod:`.class_kernels`; both read 64 elements at a time, the common
classes' members as bit masks), a few times the cost of reading the tensor; on an accelerator
the ranks come from :class:`~rlsync.codecs.classgap.ClassOrder` on the tensor's own device, and only
the changed elements' ranks come back. Both give the same ranks, so the files are identical.
Tensors with no exponent field (integers, bool) or encoded without their base use one class of
all elements in flat order (``"order": "flat"``).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np
import torch

from ..dtypes import EXPONENT_FIELDS, dtype_name, int_view, uint_dtype
from ..errors import FormatError
from ..registry import Kind, register
from .base import Decoded, DecodeTarget, EncodedTensor
from .checks import require_entry
from .classgap import CHUNK, ClassGapCodec, ClassOrder, ValueFault, signed_view, value_error

def _kernels():
    """The compiled Rice kernels, imported (and numba with them) on first use."""
    import rlsync.codecs.rice_kernels as kernels

    return kernels


def _class_kernels():
    """The compiled passes over the exponent classes, imported on first use."""
    import rlsync.codecs.class_kernels as kernels

    return kernels


class _ClassTable(NamedTuple):
    """A tensor's class table (:data:`TABLE` rows) and Rice streams, checked; the rows' fields as ``int64``."""

    rows: np.ndarray
    classes: np.ndarray
    ks: np.ndarray
    counts: np.ndarray
    unary: np.ndarray
    rem: np.ndarray


#: One row of the class table: class, Rice parameter (bits 0-5) with the "inverted" flag (bit 7),
#: and the number of ranks coded.
TABLE = np.dtype([("cls", "<u2"), ("flags", "u1"), ("count", "<u4")])
MAX_RICE_K = 40
INVERTED = 0x80
FLAT = (0, 0)  # (shift, mask) of "one class of all elements"
DENSE_SAMPLE, SAMPLE_RUN = 4096, 256  # elements sampled (in runs) to pick the classes decoded a block at a time


def _class_ranks(base: torch.Tensor, index: np.ndarray, field: tuple[int, int], *, compiled: bool) -> tuple[np.ndarray, ...]:
    """Per changed element (flat order): its rank within its class and its class; and every class's size."""
    shift, mask = field
    if compiled:
        bits = int_view(base.detach()).cpu().numpy()
        ranks, classes = np.empty(index.size, np.int64), np.empty(index.size, np.int64)
        members = np.zeros(mask + 1, np.int64)
        _class_kernels().class_ranks(bits, shift, mask, _dense_classes(bits, field), index, ranks, classes, members)
        return ranks, classes, members
    order = ClassOrder.of_tensor(base, field)
    rank, position = order.ranks_of(torch.from_numpy(index).to(base.device))
    cls = order.classes[position].long()
    within = rank - order.class_start[cls]
    by_position = torch.argsort(position)
    members = order.upto_chunk[-1]  # a changed element means a tensor of at least one chunk
    return within[by_position].cpu().numpy(), cls[by_position].cpu().numpy(), members.cpu().numpy()


def _rice_code(
    classes: np.ndarray, ranks: np.ndarray, order: np.ndarray, bounds: np.ndarray, members: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The class table and the unary and remainder streams of the coded classes ``classes``: class
    ``classes[j]`` of ``members[j]`` members changed at the increasing ranks ``ranks[order[bounds[j]:bounds[j + 1]]]``."""
    kernels = _kernels()
    rows = classes.size
    gaps, ks = np.empty(ranks.size, np.uint64), np.zeros(rows, np.int64)
    counts, inverted = np.zeros(rows, np.int64), np.zeros(rows, np.uint8)
    unary_bits, rem_bits = kernels.rice_plan(ranks, order, bounds, members, MAX_RICE_K, gaps, ks, counts, inverted)
    unary, rem = np.zeros((unary_bits + 7) // 8, np.uint8), np.zeros((rem_bits + 7) // 8, np.uint8)
    kernels.rice_write(gaps, ks, counts, unary, rem)
    table = np.zeros(rows, TABLE)
    table["cls"], table["flags"], table["count"] = classes, ks | (inverted * INVERTED), counts
    return table, unary, rem


class ClassRiceCodec(ClassGapCodec):
    """Per-class Golomb-Rice ranks in the old weights' exponent classes; values as ``classgap``."""

    name = "classrice"
    version = 1

    def __init__(self, *, compiled: bool | None = None) -> None:
        super().__init__()
        #: Rank with the CPU kernel (``None``: whenever the base tensor is on the CPU).
        self.compiled = compiled

    def _use_kernel(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" if self.compiled is None else self.compiled

    def encode(
        self, name: str, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray, *, base: torch.Tensor | None = None
    ) -> EncodedTensor:
        field = EXPONENT_FIELDS.get(dtype_name(base.dtype)) if base is not None else None
        if field is None or index.size == 0:
            rows, streams = self._encode_classes([(0, index, 1 << 62)]), {"order": "flat"}
            order = None
        else:
            ranks, classes, members = _class_ranks(base, index, field, compiled=self._use_kernel(base))
            order, starts = np.empty(index.size, np.int64), np.zeros(field[1] + 2, np.int64)
            _kernels().group_by_class(classes, order, starts)  # class by class, flat (= rank) order within
            present = np.flatnonzero(np.diff(starts))
            bounds = np.append(starts[present], index.size)
            rows, streams = _rice_code(present, ranks, order, bounds, members[present]), {"order": "exponent"}
        table, unary, rem = rows
        pos = np.concatenate([table.view(np.uint8), unary, rem])
        entries = {f"{name}.pos": torch.from_numpy(pos), **self._encode_values(name, old_bits, new_bits, order)}
        return EncodedTensor(entries=entries, params={**streams, "classes": int(table.size), "unary_bytes": int(unary.size)})

    @staticmethod
    def _encode_classes(groups: list[tuple[int, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rice-code each ``(class, sorted ranks of its changed elements, class size)``."""
        ranks = np.concatenate([np.asarray(g[1], np.int64) for g in groups])
        bounds = np.cumsum([0, *(len(g[1]) for g in groups)])
        classes, members = np.array([g[0] for g in groups], np.int64), np.array([g[2] for g in groups], np.int64)
        return _rice_code(classes, ranks, np.arange(ranks.size), bounds, members)

    def decode(self, name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], target: DecodeTarget) -> Decoded:
        """See the base class; the old bits come with the result (the class order reads them anyway)."""
        order, dtype = params.get("order"), params.get("dtype")
        field = EXPONENT_FIELDS.get(dtype) if isinstance(dtype, str) else None
        if order not in ("flat", "exponent") or (order == "exponent" and field is None):
            raise FormatError(f"{name}: invalid order {order!r} for dtype {dtype!r}")
        n_classes = 1 if order == "flat" else field[1] + 1
        table = self._class_table(name, entries, params, n_classes=n_classes, numel=target.numel)
        planes, signs = self._value_streams(name, entries, target)
        if order == "flat":
            if table.rows.size and table.rows["flags"][0] & INVERTED:
                raise FormatError(f"{name}: a flat order cannot be inverted")
            coded, _, _ = self._ranks(name, table, n_classes=1, numel=target.numel)
            if coded.size != target.count:
                raise FormatError(f"{name}: {coded.size} positions, the metadata declares {target.count}")
            index, old, slots = coded, target.bits_at(coded), np.arange(coded.size, dtype=np.int64)
        elif target.tensor is not None and not self._use_kernel(target.tensor):
            coded, starts, ends = self._ranks(name, table, n_classes=n_classes, numel=target.numel)
            index, slots = self._positions_on_device(name, table, coded, starts, ends, field, target.count, target.tensor)
            old = target.bits_at(index)
        else:
            index, old, slots = self._positions(name, table, field, target)
        new = np.empty(index.size, uint_dtype(target.itemsize))
        fault = _kernels().add_differences(planes, signs, old, slots, new)
        if fault:
            raise value_error(name, ValueFault(fault))
        return Decoded(index, new, old)

    @staticmethod
    def _class_table(
        name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], *, n_classes: int, numel: int
    ) -> _ClassTable:
        """The class table and the Rice streams of a tensor's ``.pos`` entry, checked against the tensor's size."""
        rows, unary_bytes = params.get("classes"), params.get("unary_bytes")
        if type(rows) is not int or not 0 <= rows <= n_classes or type(unary_bytes) is not int or unary_bytes < 0:
            raise FormatError(f"{name}: invalid class table size {rows!r} or unary size {unary_bytes!r}")
        pos = require_entry(entries, f"{name}.pos", torch.uint8).numpy()
        table_bytes = rows * TABLE.itemsize
        if pos.size < table_bytes + unary_bytes:
            raise FormatError(f"entry {name + '.pos'!r}: {pos.size} bytes, shorter than its table and unary stream")
        table = pos[:table_bytes].view(TABLE)
        unary, rem = pos[table_bytes : table_bytes + unary_bytes], pos[table_bytes + unary_bytes :]
        cls, k, counts = table["cls"].astype(np.int64), table["flags"] & 0x3F, table["count"].astype(np.int64)
        if rows and (
            cls.max() >= n_classes or np.any(np.diff(cls) <= 0) or k.max() > MAX_RICE_K or np.any(table["flags"] & 0x40)
            or np.any(k[counts == 0])  # an empty class has no parameter: one set would be a bit nothing reads
        ):
            raise FormatError(f"{name}: invalid class table (classes not increasing or out of range, or a bad parameter)")
        if int(counts.sum()) > min(numel, 8 * unary_bytes):  # every coded rank is distinct and ends a unary code
            raise FormatError(f"{name}: the class table codes more ranks than the tensor or the stream holds")
        return _ClassTable(table, cls, k.astype(np.int64), counts, unary, rem)

    @staticmethod
    def _check_streams_end(name: str, table: _ClassTable, at_unary: int, at_rem: int) -> None:
        """Refuse Rice streams that ended early, or that have bytes or set padding bits after their last code."""
        if at_unary < 0:
            raise FormatError(f"{name}: the Rice streams end early or code a rank beyond the tensor")
        if (at_unary + 7) // 8 != table.unary.size or (at_rem + 7) // 8 != table.rem.size:
            raise FormatError(f"{name}: bytes left after the Rice streams")
        for stream, used in ((table.unary, at_unary), (table.rem, at_rem)):
            if used % 8 and stream[-1] & ((1 << (8 - used % 8)) - 1):
                raise FormatError(f"{name}: padding bits after the Rice streams are set")

    def _ranks(self, name: str, table: _ClassTable, *, n_classes: int, numel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every class's coded ranks, one class after the other, and each class's slice of them."""
        coded = np.empty(int(table.counts.sum()), np.int64)
        at_unary, at_rem = _kernels().rice_decode_classes(table.unary, table.rem, table.ks, table.counts, numel, coded)
        self._check_streams_end(name, table, at_unary, at_rem)
        starts, ends = np.zeros(n_classes, np.int64), np.zeros(n_classes, np.int64)
        ends[table.classes] = np.cumsum(table.counts)
        starts[table.classes] = ends[table.classes] - table.counts
        return coded, starts, ends

    def _positions(
        self, name: str, table: _ClassTable, field: tuple[int, int], target: DecodeTarget
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat positions (increasing) of the changed elements, their old bits, and the slot of each one's
        value, from every class's changed members as a bitmap (:func:`~.rice_kernels.rice_bitmaps`) and
        one pass over the old bits (:func:`~.class_kernels.class_positions`)."""
        shift, mask = field
        count, base = target.count, target.tensor
        bits = int_view(base.detach()).numpy() if base is not None else _old_bits(target)
        rows = table.classes.size
        words = np.zeros(target.numel // 64 + 3 * rows + 3, np.uint64)  # the bitmaps of ranks that fit the tensor
        first_word = np.full(mask + 1, words.size - 2, np.int64)  # a class with no coded ranks reads the last two zeros
        bound = np.zeros(mask + 1, np.int64)  # per class, its last coded rank plus one
        inverted = (table.rows["flags"] & INVERTED) != 0
        at_unary, at_rem = _kernels().rice_bitmaps(
            table.unary, table.rem, table.ks, table.counts, table.classes, inverted, target.numel, words, first_word, bound
        )  # fmt: skip
        self._check_streams_end(name, table, at_unary, at_rem)
        if int(bound.sum()) > target.numel:  # the classes' members are the tensor's elements: a rank beyond its class
            raise FormatError(f"{name}: the coded ranks do not fit the tensor's classes")
        kernels = _class_kernels()
        positions, olds = np.empty(count, np.int64), np.empty(count, bits.dtype)
        slots = np.empty(count, np.int32 if count < 2**31 else np.int64)  # work space, as narrow as it can be
        written = kernels.class_positions(
            bits, shift, mask, _dense_classes(bits, field), bound, words, first_word,
            positions, olds, np.empty(count, np.uint8 if mask <= 0xFF else np.uint16), slots, np.zeros(mask + 1, np.int64),
        )  # fmt: skip
        if written != count:
            raise FormatError(f"{name}: the coded ranks do not fit the tensor's classes, or do not make {count} changes")
        return positions, olds.view(uint_dtype(olds.itemsize)), slots

    @staticmethod
    def _positions_on_device(
        name: str, table: _ClassTable, coded: np.ndarray, starts: np.ndarray, ends: np.ndarray,
        field: tuple[int, int], count: int, base: torch.Tensor,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_positions` with the class order built on the base tensor's device (no kernel)."""
        inverted = np.zeros(field[1] + 1, np.int8)
        inverted[table.classes] = (table.rows["flags"] & INVERTED) != 0
        order = ClassOrder.of_tensor(base, field)
        members = order.upto_chunk[-1].cpu().numpy()
        ranks = []
        for c in range(starts.size):
            mine = coded[starts[c] : ends[c]]
            if mine.size and mine[-1] >= members[c]:
                raise FormatError(f"{name}: a coded rank is beyond its class")
            if inverted[c]:
                keep = np.ones(members[c], bool)
                keep[mine] = False
                mine = np.flatnonzero(keep)
            ranks.append(mine + int(order.class_start[c]))
        rank = np.concatenate(ranks)  # one array per class, and there is at least one class
        if rank.size != count:
            raise FormatError(f"{name}: the coded ranks make {rank.size} changes, the metadata declares {count}")
        positions = order.positions_of(torch.from_numpy(rank).to(base.device)).cpu().numpy()
        flat = np.argsort(positions, kind="stable")
        return positions[flat], flat


def _dense_classes(bits: np.ndarray, field: tuple[int, int]) -> np.ndarray:
    """The classes :func:`~.class_kernels.class_ranks` and :func:`~.class_kernels.class_positions` take a block
    at a time: the most common ones in
    a sample of ``bits`` (any distinct classes decode the same; the sample only makes it fast), or none
    where masks cannot hold the classes."""
    kernels = _class_kernels()
    shift, mask = field
    if not kernels.MASKS_IN_ORDER or mask > 0xFF or mask + 1 < kernels.DENSE or bits.size < kernels.LANES:
        return np.empty(0, np.uint8)
    runs = range(0, bits.size, max(SAMPLE_RUN, bits.size // (DENSE_SAMPLE // SAMPLE_RUN)))  # whole cache lines
    sample = np.concatenate([bits[start : start + SAMPLE_RUN] for start in runs])
    counts = np.bincount((sample >> shift).astype(np.int64) & mask, minlength=mask + 1)
    return np.argsort(-counts, kind="stable")[: kernels.DENSE].astype(np.uint8)


def _old_bits(target: DecodeTarget) -> np.ndarray:
    """Every old bit pattern of a tensor, read :data:`CHUNK` elements at a time: the memory is the
    patterns' own (2 bytes an element in bf16), not an index array four times their size."""
    numel, old_bits_at = target.numel, target.bits_at
    first = signed_view(old_bits_at(np.arange(min(CHUNK, numel), dtype=np.int64)))
    if numel <= CHUNK:
        return first
    out = np.empty(numel, first.dtype)
    out[:CHUNK] = first
    for start in range(CHUNK, numel, CHUNK):
        out[start : min(start + CHUNK, numel)] = signed_view(
            old_bits_at(np.arange(start, min(start + CHUNK, numel), dtype=np.int64))
        )
    return out


register(Kind.CODEC, "classrice", "rlsync.codecs.classrice:ClassRiceCodec", capabilities=("accelerator",),
         summary="positions Golomb-Rice coded per exponent class of the old weights")
