"""Compiled bit operations on blocks of :data:`LANES` elements (numba intrinsics, any CPU).

A block's elements are compared as one LLVM vector and the comparison read back as a ``uint64`` mask,
element ``j`` in bit ``j`` (:data:`MASKS_IN_ORDER`: little-endian targets; elsewhere callers take the
elements one at a time). LLVM lowers the vectors to whatever the target has (AVX-512, AVX2, SSE2 or
NEON), so the same code is correct on any CPU, ``NUMBA_CPU_NAME=generic`` included; only
:data:`HAS_PDEP` depends on the host CPU, and it is checked.
"""

from __future__ import annotations

import sys

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .cpu import has_fast_pdep

#: Elements per block: one bit each in a ``uint64`` mask.
LANES = 64
#: Classes whose members :func:`class_masks` finds a block at a time.
DENSE = 12
#: Entries of :func:`class_masks`' per-class arrays: the dense classes, the others' mask, and padding to a vector.
SLOTS = 16
#: Whether a vector of comparisons cast to an integer puts its first element in the lowest bit
#: (little-endian targets); elsewhere the callers take every element one at a time.
MASKS_IN_ORDER = sys.byteorder == "little"
#: Whether the compiled code runs on this machine's x86-64 CPU with a fast BMI2 ``pdep`` (:func:`~rlsync.cpu.has_fast_pdep`),
#: which picks a mask's k-th set bit, or deposits bits at a mask's, in one instruction; elsewhere a search does.
HAS_PDEP = numba.config.CPU_NAME in (None, "host") and has_fast_pdep()


@intrinsic
def popcount(typingctx, x):  # pragma: no cover - compiled
    """Set bits of a ``uint64``, as an ``int64``."""

    def codegen(context, builder, signature, args):
        return builder.call(builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)]), args)

    return types.int64(types.uint64), codegen


def zero_count(name: str, llvm_name: str, doc: str):
    """An intrinsic that counts the zero bits of a nonzero ``uint64`` with LLVM's ``llvm_name``
    (``llvm.cttz``: below its lowest set bit, ``llvm.ctlz``: above its highest), as an ``int64``."""

    def typer(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            count = builder.module.declare_intrinsic(llvm_name, [ir.IntType(64), ir.IntType(1)])
            return builder.call(count, [args[0], ir.Constant(ir.IntType(1), 0)])

        return types.int64(types.uint64), codegen

    typer.__name__, typer.__qualname__, typer.__doc__ = name, name, doc
    return intrinsic(typer)


@intrinsic
def funnel_shift_right(typingctx, high, low, shift):  # pragma: no cover - compiled
    """The 64 bits from bit ``shift % 64`` on of the 128-bit ``high:low`` (``uint64`` each), as a ``uint64``:
    ``low >> shift`` with the low bits of ``high`` shifted in above it (LLVM's ``llvm.fshr``; one ``shrd``)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fshr = builder.module.declare_intrinsic("llvm.fshr.i64", fnty=ir.FunctionType(i64, [i64, i64, i64]))
        return builder.call(fshr, args)

    return types.uint64(types.uint64, types.uint64, types.uint64), codegen


@intrinsic
def load_be64(typingctx, stream, at):  # pragma: no cover - compiled
    """The 8 bytes of a contiguous ``uint8`` array from byte ``at`` on (``at + 8`` within it; not checked), read
    as a big-endian ``uint64``: one unaligned load (and a byte swap on little-endian CPUs), where a
    compiled loop over the bytes stays 8 loads, shifts and ors."""
    if not _contiguous(stream) or stream.dtype != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        word = builder.load(builder.bitcast(builder.gep(data, [args[1]]), i64.as_pointer()), align=1)
        if sys.byteorder == "little":
            word = builder.call(builder.module.declare_intrinsic("llvm.bswap", [i64]), [word])
        return word

    return types.uint64(stream, types.intp), codegen


lowest_bit = zero_count("lowest_bit", "llvm.cttz", "Index of the lowest set bit of a nonzero ``uint64``.")
leading_zeros = zero_count("leading_zeros", "llvm.ctlz", "Zero bits above the highest set bit of a nonzero ``uint64``.")


def _contiguous(*arrays: types.Type) -> bool:
    """Whether every one of ``arrays`` is a contiguous 1-D array (the intrinsics read vectors from the data pointers)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


def _emit_members(context, builder, signature, args) -> list[ir.Value]:  # pragma: no cover - compiled
    """The code of :func:`class_members` (its first six arguments); returns the :data:`DENSE` masks."""
    bits_type, _, _, _, dense_type, out_type = signature.args[:6]
    data = context.make_array(bits_type)(context, builder, args[0]).data
    classes = context.make_array(dense_type)(context, builder, args[4]).data
    masks = context.make_array(out_type)(context, builder, args[5]).data
    lane, i32, i64 = ir.IntType(bits_type.dtype.bitwidth), ir.IntType(32), ir.IntType(64)
    wide, narrow = ir.VectorType(lane, LANES), ir.VectorType(ir.IntType(8), LANES)

    def splat(value, vector):
        one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(i32, 0))
        first = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
        return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), first)

    block = builder.load(builder.bitcast(builder.gep(data, [args[1]]), wide.as_pointer()), align=1)
    block = builder.lshr(block, splat(builder.trunc(args[2], lane), wide))
    block = builder.and_(block, splat(builder.trunc(args[3], lane), wide))
    block = builder.trunc(block, narrow)
    found, anyone = [], ir.Constant(i64, 0)
    for k in range(DENSE):
        cls = builder.load(builder.gep(classes, [ir.Constant(i64, k)]))
        found.append(builder.bitcast(builder.icmp_unsigned("==", block, splat(cls, narrow)), i64))
        builder.store(found[-1], builder.gep(masks, [ir.Constant(i64, k)]))
        anyone = builder.or_(anyone, found[-1])
    builder.store(builder.not_(anyone), builder.gep(masks, [ir.Constant(i64, DENSE)]))
    return found


@intrinsic
def class_members(typingctx, bits, start, shift, mask, dense, out):  # pragma: no cover - compiled
    """The members of the :data:`DENSE` classes ``dense`` (``mask <= 0xFF``) among the :data:`LANES` elements
    from ``start``: ``out[k]`` gets bit ``j`` set where the class ``(bits[start + j] >> shift) & mask`` is
    ``dense[k]``, and ``out[DENSE]`` the elements of no dense class.

    One vector load, shift and mask of the block, one vector comparison per class: what a compiled loop
    over the elements did not vectorize.
    """
    if not _contiguous(bits, dense, out):
        return None

    def codegen(context, builder, signature, args):
        _emit_members(context, builder, signature, args)
        return context.get_dummy_value()

    return types.void(bits, types.intp, types.intp, types.intp, dense, out), codegen


@intrinsic
def class_masks(typingctx, bits, start, shift, mask, dense, out, left):  # pragma: no cover - compiled
    """:func:`class_members`, and the members' counts taken from ``left``: ``left[k]`` (``int64``) loses the
    members of ``dense[k]``. Returns a mask of the ``k`` whose ``left[k]`` is now below zero. ``out`` and
    ``left`` hold :data:`SLOTS` entries, the last ones zero. The counts are one vector.
    """
    if not _contiguous(bits, dense, out, left):
        return None

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        slots = ir.VectorType(i64, SLOTS)
        members = ir.Constant(slots, [0] * SLOTS)
        for k, found in enumerate(_emit_members(context, builder, signature, args)):
            members = builder.insert_element(members, found, ir.Constant(i32, k))
        counts = context.make_array(signature.args[6])(context, builder, args[6]).data
        ctpop = builder.module.declare_intrinsic(f"llvm.ctpop.v{SLOTS}i64", fnty=ir.FunctionType(slots, [slots]))
        left_at = builder.bitcast(counts, slots.as_pointer())
        now = builder.sub(builder.load(left_at, align=8), builder.call(ctpop, [members]))
        builder.store(now, left_at, align=8)
        below = builder.icmp_signed("<", now, ir.Constant(slots, [0] * SLOTS))
        return builder.zext(builder.bitcast(below, ir.IntType(SLOTS)), i64)

    return types.uint64(bits, types.intp, types.intp, types.intp, dense, out, left), codegen


@intrinsic
def differ_mask(typingctx, old, new, start):  # pragma: no cover - compiled
    """Bit ``j`` set where ``old[start + j] != new[start + j]``, for the :data:`LANES` elements from
    ``start`` of two contiguous integer arrays of one dtype: one vector comparison, as ``uint64``."""
    if not _contiguous(old, new) or old.dtype != new.dtype:
        return None  # contiguous arrays of one dtype only

    def codegen(context, builder, signature, args):
        old_type, new_type, _ = signature.args
        wide = ir.VectorType(ir.IntType(old_type.dtype.bitwidth), LANES)
        blocks = []
        for array_type, array in ((old_type, args[0]), (new_type, args[1])):
            data = context.make_array(array_type)(context, builder, array).data
            blocks.append(builder.load(builder.bitcast(builder.gep(data, [args[2]]), wide.as_pointer()), align=1))
        return builder.bitcast(builder.icmp_unsigned("!=", *blocks), ir.IntType(64))

    return types.uint64(old, new, types.intp), codegen
