"""The ``classrice`` codec: the two rank paths, inverted classes, size bounds, and hostile input.

The generic round trips over every dtype, shape and special value run for ``classrice`` in
:mod:`tests.test_codecs` (it is in its ``CODECS``). Here: the compiled CPU kernel and the torch
class order (what an accelerator runs) give identical files and decode each other's; dense
classes are coded inverted; decoding without the base tensor equals decoding with it; sizes are
bounded on RL-like data (whole file); and malformed class tables and Rice streams are refused.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlsync.codecs import DecodeTarget, EncodedTensor, get_codec
from rlsync.dtypes import EXPONENT_FIELDS
from rlsync.codecs.classrice import INVERTED, TABLE, ClassRiceCodec, _class_ranks
from rlsync.detect import ChangeDetector
from rlsync.dtypes import dtype_name
from rlsync.errors import FormatError
from rlsync.format import parse_header
from tests.library.test_codec_classgap import HYPOTHESIS, chunk_size, normal_bits
from tests.library.test_codecs import FLOAT_DTYPES, _rl_deltas, bits_of, from_bits, mutate, publish_and_follow
from tests.library.test_format_hostile import NAME, assert_refused, make_delta, rewrite, state  # noqa: F401 (fixture)
from tests.library.test_format_hostile import test_every_truncation_refused as every_truncation_refused
from tests.library.test_format_hostile import test_flipped_bytes_never_escape as flipped_bytes_never_escape

KERNEL, TORCH = ClassRiceCodec(compiled=True), ClassRiceCodec(compiled=False)


def _case(rng: np.random.Generator, dtype: torch.dtype, numel: int, changed: int):
    old = from_bits(normal_bits(rng, dtype, numel), dtype, (numel,))
    new = mutate(rng, old, changed, specials=True)
    index = np.flatnonzero(bits_of(old) != bits_of(new))
    return old, bits_of(old), bits_of(new), index


def _decode(codec: ClassRiceCodec, encoded, old: torch.Tensor, old_all: np.ndarray, index: np.ndarray, base=True):
    """The decoded positions and new bits (the old bits that come with them are checked here)."""
    params = {"dtype": dtype_name(old.dtype), **encoded.params}
    target = DecodeTarget(
        count=index.size, numel=old.numel(), itemsize=old.element_size(), bits_at=lambda idx: old_all[idx],
        tensor=old if base else None,
    )  # fmt: skip
    got_index, got_bits, got_old = codec.decode("w", encoded.entries, params, target)
    np.testing.assert_array_equal(got_old, old_all[got_index])
    return got_index, got_bits


def _table(pos: np.ndarray, rows: int) -> np.ndarray:
    """The first ``rows`` rows of the class table of a ``.pos`` entry, as a view (edits write through)."""
    return pos[: rows * TABLE.itemsize].view(TABLE)


def _classes_of(old: torch.Tensor, index: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per changed element its rank within its class and its class, and every class's size (CPU kernel)."""
    return _class_ranks(old, index, EXPONENT_FIELDS[dtype_name(old.dtype)], compiled=True)


@HYPOTHESIS
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 3000),
    chunk=st.sampled_from([1, 7, 64, 1 << 20]),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_and_torch_class_order_agree(dtype: torch.dtype, numel: int, chunk: int, density: float, seed: int) -> None:
    """The CPU kernel and the torch class order (the accelerator path) write the same bytes and decode each other's."""
    with chunk_size(chunk):  # the torch path's chunked class order, across chunk boundaries
        rng = np.random.default_rng(seed)
        old, old_all, new_all, index = _case(rng, dtype, numel, int(rng.binomial(numel, density)))
        if not index.size:
            return
        by_kernel = KERNEL.encode("w", index, old_all[index], new_all[index], base=old)
        by_torch = TORCH.encode("w", index, old_all[index], new_all[index], base=old)
        assert by_kernel.params == by_torch.params and by_kernel.params["order"] == "exponent"
        for key, entry in by_kernel.entries.items():
            assert torch.equal(entry, by_torch.entries[key]), key
        for decoder in (KERNEL, TORCH):
            got_index, got_bits = _decode(decoder, by_kernel, old, old_all, index)
            np.testing.assert_array_equal(got_index, index)
            np.testing.assert_array_equal(got_bits, new_all[index])


@pytest.mark.parametrize("changed", [3600, 2400])
def test_dense_classes_are_coded_inverted_and_round_trip(changed: int) -> None:
    """A class where more than half the members changed (and only such a class) lists its unchanged
    members instead, and decodes exactly."""
    rng = np.random.default_rng(5)
    old, old_all, new_all, index = _case(rng, torch.bfloat16, 4000, changed)
    encoded = KERNEL.encode("w", index, old_all[index], new_all[index], base=old)
    rows = _table(encoded.entries["w.pos"].numpy(), encoded.params["classes"])
    _, classes, members = _classes_of(old, index)
    dense = {int(c) for c in np.unique(classes) if 2 * int((classes == c).sum()) > members[c]}
    assert dense and {int(r["cls"]) for r in rows if r["flags"] & INVERTED} == dense
    for decoder, base in ((KERNEL, True), (KERNEL, False), (TORCH, True)):
        got_index, got_bits = _decode(decoder, encoded, old, old_all, index, base=base)
        np.testing.assert_array_equal(got_index, index)
        np.testing.assert_array_equal(got_bits, new_all[index])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_without_base_reads_old_bits_through_the_callback(dtype: torch.dtype) -> None:
    """Decoding from ``old_bits_at`` alone (no base tensor) gives the same patch as decoding with it."""
    rng = np.random.default_rng(3)
    old, old_all, new_all, index = _case(rng, dtype, 777, 40)
    encoded = KERNEL.encode("w", index, old_all[index], new_all[index], base=old)
    with_base, without = (_decode(KERNEL, encoded, old, old_all, index, base=b) for b in (True, False))
    for got_index, got_bits in (with_base, without):
        np.testing.assert_array_equal(got_index, index)
        np.testing.assert_array_equal(got_bits, new_all[index])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_without_base_reads_the_old_bits_a_chunk_at_a_time(dtype: torch.dtype, monkeypatch) -> None:
    """Without a base the old bits are read in chunks (no index array of the whole tensor), and the
    patch is the same as with the base."""
    import rlsync.codecs.classrice as classrice

    monkeypatch.setattr(classrice, "CHUNK", 64)
    rng = np.random.default_rng(4)
    old, old_all, new_all, index = _case(rng, dtype, 777, 40)
    encoded = KERNEL.encode("w", index, old_all[index], new_all[index], base=old)
    asked: list[np.ndarray] = []
    params = {"dtype": dtype_name(old.dtype), **encoded.params}
    got_index, got_bits, _ = KERNEL.decode(
        "w", encoded.entries, params,
        DecodeTarget(count=index.size, numel=old.numel(), itemsize=old.element_size(), bits_at=lambda idx: asked.append(idx.copy()) or old_all[idx]),
    )  # fmt: skip
    np.testing.assert_array_equal(got_index, index)
    np.testing.assert_array_equal(got_bits, new_all[index])
    # the class order reads every element once, in chunks, and nothing more: its pass keeps the changed elements' old bits
    assert [(int(c[0]), c.size) for c in asked] == [(start, min(64, 777 - start)) for start in range(0, 777, 64)]
    np.testing.assert_array_equal(np.concatenate(asked), np.arange(777))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8], ids=str)
def test_flat_order_without_an_exponent_or_a_base(dtype: torch.dtype) -> None:
    """Integer tensors, and any tensor encoded without its base, are one class of all elements in flat order."""
    index = np.array([0, 5, 9], dtype=np.int64)
    old = np.zeros(3, dtype=np.uint8 if dtype != torch.int32 else np.uint32)
    for base in (None, torch.zeros(10, dtype=dtype)):
        encoded = get_codec("classrice").encode("w", index, old, old + 1, base=base)
        assert encoded.params["order"] == "flat" and encoded.params["classes"] == 1


def test_size_bounds_on_rl_like_updates() -> None:
    """At 0.5-3% density classrice uses <= 0.95 bytes per changed element (whole file) and <= 70% of gapzz; after
    AdamW's first step (which moves nearly every small weight, so positions cost almost nothing) <= 92% of classgap."""
    for step, (density, sizes, _, changes) in enumerate(_rl_deltas()):
        assert 0.005 <= density <= 0.03
        changed = sum(c.index.size for c in changes.values())
        assert sizes["classrice"] / changed <= 0.95, f"classrice: {sizes['classrice'] / changed:.3f} bytes per changed element"
        assert sizes["classrice"] <= 0.70 * sizes["gapzz"], f"classrice {sizes['classrice']} vs gapzz {sizes['gapzz']}"
        bound = 0.92 if step else 1.01
        assert sizes["classrice"] <= bound * sizes["classgap"], f"step {step}: classrice {sizes['classrice']} vs classgap {sizes['classgap']}"


def test_round_trip_of_a_multi_million_element_tensor() -> None:
    """A bf16 tensor of 3M elements at ~1% changed round-trips bit-exactly through the format (kernel path)."""
    rng = np.random.default_rng(7)
    numel = 3_000_003
    old = from_bits(normal_bits(rng, torch.bfloat16, numel), torch.bfloat16, (numel,))
    new = mutate(rng, old, numel // 100, specials=False)
    detector = ChangeDetector(dtype=None)
    detector.reset({"w": old})
    publish_and_follow({"w": new}, {"w": old.clone()}, "classrice", detector)


def test_default_codec_is_classrice_everywhere() -> None:
    """The library, the CLI and the trainer default to classrice on every device it has been measured on."""
    from rlsync.codecs import DEFAULT_CODEC, default_codec
    from trainer_space.trainer import TrainerConfig

    assert DEFAULT_CODEC == default_codec("cpu") == default_codec("cuda") == "classrice"
    assert TrainerConfig().codec == "classrice"


# ---------------------------------------------------------------------------
# hostile input


def _edit_pos(edit):
    """A rewrite of the class table or streams of ``NAME``'s ``.pos`` entry."""

    def entries(e):
        e[NAME + ".pos"] = torch.from_numpy(edit(e[NAME + ".pos"].numpy().copy()))

    return entries


def _classes(data: bytes) -> int:
    return json.loads(parse_header(data)[1]["tensors"])[NAME]["classes"]


def _set_row(field: str, value: int, row: int = 0):
    def edit(pos):
        _table(pos, row + 1)[row][field] = value
        return pos

    return edit


@pytest.mark.parametrize(
    "params, match",
    [
        ({"order": "bogus"}, "invalid order"),
        ({"order": None}, "invalid order"),
        ({"classes": -1}, "invalid class table size"),
        ({"classes": 10**6}, "invalid class table size"),
        ({"classes": 1.0}, "invalid class table size"),
        ({"unary_bytes": -3}, "invalid class table size"),
        ({"unary_bytes": 10**9}, f"entry '{NAME}.pos': .* bytes, shorter than its table"),
    ],
)
def test_invalid_parameters_refused(state, params: dict, match: str) -> None:
    assert_refused(rewrite(make_delta(state, "classrice"), table=lambda t: t[NAME].update(params)), state, match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set_row("cls", 300), "invalid class table"),
        (_set_row("flags", 41), "invalid class table"),  # Rice parameter beyond 40
        (_set_row("flags", 0x40), "invalid class table"),  # a reserved flag
        (_set_row("count", 2**32 - 1), "codes more ranks than"),
        (_set_row("count", 0), "bytes left after the Rice streams|do not fit|padding bits"),
    ],
    ids=["class_out_of_range", "rice_parameter", "reserved_flag", "huge_count", "count_too_small"],
)
def test_hostile_class_table_refused(state, edit, match: str) -> None:
    assert_refused(rewrite(make_delta(state, "classrice"), entries=_edit_pos(edit)), state, match)


def test_classes_out_of_order_refused(state) -> None:
    data = make_delta(state, "classrice")
    assert _classes(data) >= 2

    def swap(pos):
        rows = _table(pos, 2)
        rows[0]["cls"], rows[1]["cls"] = rows[1]["cls"], rows[0]["cls"]
        return pos

    assert_refused(rewrite(data, entries=_edit_pos(swap)), state, "invalid class table")


def test_class_table_boundaries_refused(state) -> None:
    """A class id one past the dtype's classes (bf16: 256), on the last row where the order check does
    not catch it, and a class listed twice are refused as an invalid table."""
    data = make_delta(state, "classrice")
    rows = _classes(data)
    assert rows >= 2
    assert_refused(rewrite(data, entries=_edit_pos(_set_row("cls", 256, row=rows - 1))), state, "invalid class table")

    def repeat(pos):
        table = _table(pos, 2)
        table[1]["cls"] = table[0]["cls"]
        return pos

    assert_refused(rewrite(data, entries=_edit_pos(repeat)), state, "invalid class table")


def test_the_largest_rice_parameter_decodes(monkeypatch) -> None:
    """Every parameter the table can hold (0-40) is valid: a class coded with the largest round-trips."""
    import rlsync.codecs.classrice as classrice

    kernels = classrice._kernels()

    def largest(ranks, order, bounds, members, max_k, gaps, ks, counts, inverted):  # the plan, every class at max_k
        kernels.rice_plan(ranks, order, bounds, members, max_k, gaps, ks, counts, inverted)
        ks[counts > 0] = max_k
        used = gaps[: counts.sum()]
        return int(used.size + (used >> np.uint64(max_k)).sum()), int(used.size * max_k)

    monkeypatch.setattr(classrice, "_kernels", lambda: SimpleNamespace(**{**vars(kernels), "rice_plan": largest}))
    old, old_all, new_all, index = _case(np.random.default_rng(3), torch.bfloat16, 500, 30)
    encoded = KERNEL.encode("w", index, old_all[index], new_all[index], base=old)
    assert set(_table(encoded.entries["w.pos"].numpy(), encoded.params["classes"])["flags"] & 0x3F) == {classrice.MAX_RICE_K}
    got_index, got_bits = _decode(KERNEL, encoded, old, old_all, index)
    np.testing.assert_array_equal(got_index, index)
    np.testing.assert_array_equal(got_bits, new_all[index])


def test_a_quotient_whose_shift_would_overflow_is_refused() -> None:
    """A rank of quotient 2^23 with the largest parameter (40) is 2^63, past int64: the decoder refuses
    a quotient above ``bound >> k`` before shifting it, even where the quotient alone is below the
    tensor's size (2^23 + 1 elements here), so no wrapped, negative rank reaches the position pass."""
    numel = (1 << 23) + 1
    old = torch.ones(numel, dtype=torch.bfloat16)  # one class: every element's exponent is 127
    table = np.zeros(1, TABLE)
    table[0] = (127, 40, 1)
    unary = np.zeros((1 << 20) + 1, np.uint8)  # 2^23 zero bits, then the terminating one
    unary[-1] = 0x80
    pos = np.concatenate([table.view(np.uint8), unary, np.zeros(5, np.uint8)])  # and a 40-bit remainder of 0
    encoded = KERNEL.encode("w", np.array([0]), bits_of(old)[:1], bits_of(old)[:1] + 1, base=old)
    params = {**encoded.params, "classes": 1, "unary_bytes": int(unary.size)}
    with pytest.raises(FormatError, match="code a rank beyond the tensor"):
        _decode(KERNEL, EncodedTensor({**encoded.entries, "w.pos": torch.from_numpy(pos)}, params), old, bits_of(old), np.array([0]))


def _with_groups(encoded: EncodedTensor, groups) -> EncodedTensor:
    """``encoded`` with its class table and Rice streams rebuilt from ``groups`` (values unchanged)."""
    table, unary, rem = ClassRiceCodec._encode_classes(groups)
    pos = np.concatenate([table.view(np.uint8), unary, rem])
    params = {**encoded.params, "classes": int(table.size), "unary_bytes": int(unary.size)}
    return EncodedTensor(entries={**encoded.entries, "w.pos": torch.from_numpy(pos)}, params=params)


@pytest.mark.parametrize("codec", [KERNEL, TORCH], ids=["kernel", "torch"])
@pytest.mark.parametrize("hostile", ["rank_at_class_size", "inverted_class"])
def test_hostile_ranks_refused_on_both_rank_paths(codec: ClassRiceCodec, hostile: str) -> None:
    """A coded rank equal to its class's size, or a class coded inverted that was not, is refused by the
    CPU kernel and by the torch class order (an accelerator's path) alike."""
    old, old_all, new_all, index = _case(np.random.default_rng(11), torch.bfloat16, 2000, 60)
    encoded = codec.encode("w", index, old_all[index], new_all[index], base=old)
    ranks, classes, members = _classes_of(old, index)
    groups = [(int(c), np.sort(ranks[classes == c]), int(members[c])) for c in np.unique(classes)]
    at = max(range(len(groups)), key=lambda i: groups[i][1].size)  # the fullest class: its last rank can move
    c, mine, size = groups[at]
    assert 2 * mine.size <= size  # coded as listed, not inverted
    if hostile == "rank_at_class_size":
        groups[at] = (c, np.append(mine[:-1], size), size + 1)
        match = "w: a coded rank is beyond its class" if codec is TORCH else "w: the coded ranks do not fit"
    else:  # listing the class's unchanged members instead: other positions, another count
        groups[at] = (c, np.setdiff1d(np.arange(size), mine), size)
        match = f"w: the coded ranks make {index.size + size - 2 * mine.size} changes, the metadata declares {index.size}"
        match = match if codec is TORCH else "w: the coded ranks do not fit the tensor's classes, or do not make"
    with pytest.raises(FormatError, match=match):
        _decode(codec, _with_groups(encoded, groups), old, old_all, index)


@pytest.mark.parametrize(
    "hostile, match",
    [
        ("second_class", "w: invalid class table"),
        ("inverted", "w: a flat order cannot be inverted"),
        ("one_rank_less", "w: 19 positions, the metadata declares 20"),
        ("byte_after_the_streams", "w: bytes left after the Rice streams"),
        ("exponent_order_of_integers", "w: invalid order 'exponent' for dtype 'I32'"),
    ],
)
def test_hostile_flat_order_refused(hostile: str, match: str) -> None:
    """A flat order (no exponent field, or encoded without the base) has one class, never inverted, and
    codes exactly the declared number of positions in streams with nothing after them."""
    old, old_all, new_all, index = _case(np.random.default_rng(5), torch.bfloat16, 300, 20)
    encoded = KERNEL.encode("w", index, old_all[index], new_all[index], base=None)
    assert encoded.params["order"] == "flat" and index.size == 20
    pos, params = encoded.entries["w.pos"].numpy().copy(), encoded.params
    if hostile == "second_class":
        _table(pos, 1)[0]["cls"] = 1
    elif hostile == "inverted":
        _table(pos, 1)[0]["flags"] |= INVERTED
    elif hostile == "one_rank_less":
        encoded = _with_groups(encoded, [(0, index[:-1], 1 << 62)])
        pos, params = encoded.entries["w.pos"].numpy(), encoded.params
    elif hostile == "byte_after_the_streams":
        pos = np.append(pos, np.uint8(0))
    else:
        params = {**params, "order": "exponent", "dtype": "I32"}
    with pytest.raises(FormatError, match=match):
        _decode(KERNEL, EncodedTensor({**encoded.entries, "w.pos": torch.from_numpy(pos)}, params), old, old_all, index, base=False)


def test_flipped_inversion_refused(state) -> None:
    """Flipping a class's "inverted" flag makes other positions: refused by the count the metadata declares."""
    data = make_delta(state, "classrice")

    def flip(pos):
        _table(pos, 1)[0]["flags"] ^= INVERTED
        return pos

    assert_refused(rewrite(data, entries=_edit_pos(flip)), state, "do not make|do not fit")


def test_unary_stream_of_zeros_refused_in_bounded_time(state) -> None:
    """A unary stream of zero bytes (a quotient running past the tensor) is refused, not decoded for ever."""
    data = make_delta(state, "classrice")
    rows = _classes(data)
    zeros = 1 << 20

    def pad(pos):
        table = pos[: rows * TABLE.itemsize]
        return np.concatenate([table, np.zeros(zeros, np.uint8), pos[rows * TABLE.itemsize :]])

    edited = rewrite(data, entries=_edit_pos(pad), table=lambda t: t[NAME].update(unary_bytes=t[NAME]["unary_bytes"] + zeros))
    assert_refused(edited, state, "end early or code a rank beyond")


def test_padding_bits_after_the_streams_refused() -> None:
    """A set bit after the last Rice code (padding that a decoder would ignore) is refused."""
    old = torch.zeros(8, dtype=torch.int32)
    index = np.array([3], dtype=np.int64)  # one gap of 3: Rice k=1, unary "01", remainder "1"
    encoded = KERNEL.encode("w", index, np.zeros(1, np.uint32), np.ones(1, np.uint32), base=old)
    pos = encoded.entries["w.pos"].numpy()
    assert encoded.params["unary_bytes"] == 1 and pos.size == TABLE.itemsize + 2
    for byte in (TABLE.itemsize, TABLE.itemsize + 1):  # the unary byte, then the remainder byte
        edited = pos.copy()
        edited[byte] |= 1
        with pytest.raises(FormatError, match="padding bits after the Rice streams"):
            _decode(KERNEL, EncodedTensor({**encoded.entries, "w.pos": torch.from_numpy(edited)}, encoded.params),
                    old, np.zeros(8, np.uint32), index)


def test_parameter_of_an_empty_class_refused(state) -> None:
    """A Rice parameter on a class that codes no rank (nothing reads it) is refused, so no bit goes unread."""
    data = make_delta(state, "classrice")
    rows = json.loads(parse_header(data)[1]["tensors"])[NAME]["classes"]

    def set_k(pos):
        table = pos[: rows * TABLE.itemsize].view(TABLE)
        empty = np.flatnonzero(table["count"] == 0)
        table[empty[0] if empty.size else 0]["count"] = 0
        table[empty[0] if empty.size else 0]["flags"] |= 1
        return pos

    assert_refused(rewrite(data, entries=_edit_pos(set_k)), state, "invalid class table")


def test_every_truncation_refused(state) -> None:
    """test_format_hostile's check for classrice: every proper prefix raises FormatError and writes nothing."""
    every_truncation_refused(state, "classrice")


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipped_bytes_never_escape(state, mask: int) -> None:
    """test_format_hostile's check for classrice: any flipped byte is refused or yields in-range patches that miss the promised hash."""
    flipped_bytes_never_escape(state, "classrice", mask)


def overflowing_delta(numel: int, quotient: int, remainder: int, k: int = 40) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A delta of one change to a bf16 tensor of ``numel`` elements whose flat-order position is Rice-coded
    as ``quotient << k | remainder``: past 2^63 for a quotient of 2^23 (int64 wraps to a negative position)."""
    from testing.soak.kinds.hostile_positions import NAME, one_change_delta, rice_position_delta

    base = torch.zeros(numel, dtype=torch.bfloat16)
    return rice_position_delta(one_change_delta(base), quotient, remainder, k), {NAME: base}


@pytest.mark.parametrize(
    "numel,quotient,remainder",
    [(1 << 23, 1 << 23, 5), (1 << 24, (1 << 24) - 1, (1 << 40) - 3)],
    ids=["wraps_negative", "wraps_to_minus_3"],
)
def test_a_rice_quotient_that_overflows_int64_is_refused(numel: int, quotient: int, remainder: int) -> None:
    """Issue 33 item 2: ``q << k`` wrapped past 2^63 on tensors of 2^23 elements or more: a plain IndexError
    (a replica's fetch thread died), or a position of -3 accepted as a patch index."""
    data, base = overflowing_delta(numel, quotient, remainder)
    assert len(data) < 3 << 20
    assert_refused(data, base, "Rice streams end early or code a rank beyond the tensor")


def test_the_rice_kernel_refuses_a_quotient_above_the_bound_before_shifting() -> None:
    from rlsync.codecs.classrice import _kernels

    k, numel = 40, 1 << 24
    unary, rem = np.zeros(numel // 8, np.uint8), np.zeros(5, np.uint8)
    _kernels().rice_encode(np.array([(numel - 1) << k | ((1 << k) - 3)], np.uint64), k, unary, 0, rem, 0)
    out = np.zeros(1, np.int64)
    assert _kernels().rice_decode(unary, 0, rem, 0, k, 1, numel, out) == (-1, -1) and out[0] == 0


def test_a_subscriber_refuses_an_overflowing_delta_and_syncs_to_the_next_anchor(bucket) -> None:
    """Issue 33 item 2: one 2 MB delta stopped a replica's fetching for good (it stayed at step 0 after the
    next anchor); refused as a FormatError, it is counted and the next anchor is applied."""
    import json

    from rlsync.layout import POINTER_KEY
    from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest

    numel = 1 << 24
    pub = Publisher(bucket, policy=FixedInterval(2))
    state = {"w": torch.zeros(numel, dtype=torch.bfloat16)}
    pub.publish(0, state)
    sub = Subscriber(bucket)
    sub.sync()
    state["w"][0] = 1.0
    pub.publish(1, state)
    hostile, _ = overflowing_delta(numel, numel - 1, (1 << 40) - 3)
    doc = json.loads(bucket.get(POINTER_KEY))
    bucket.put(doc["deltas"][-1]["file"]["key"], hostile)
    doc["deltas"][-1]["file"]["size"] = len(hostile)
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    with pytest.raises(FormatError, match="beyond the tensor"):
        sub.fetch()
    assert sub.step == 0 and sub.stats.refused == 1
    state["w"][1] = 2.0
    assert pub.publish(2, state).kind == "anchor"
    sub.sync()
    assert sub.step == 2 and sub.state_hash == read_manifest(bucket).state_hash
