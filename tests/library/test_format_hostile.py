"""Hostile and malformed files are refused with FormatError before anything is written; anchors round-trip.

Every refusal is checked for its message (so the named check, not a later one,
fires) and for the target state's hash being unchanged afterwards. Anchor tests
cover the bit-exact round trip, Hugging Face style sharding readable by plain
``safetensors``, shards that disagree, and the metadata of deltas.
"""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import zstandard

from rlsync.codecs import get_codec
from rlsync.detect import ChangeDetector
from rlsync.dtypes import int_view
from rlsync.errors import FormatError
from rlsync.anchor_format import INDEX_FILE, anchor_metadata, load_anchor, plan_shards, write_anchor
from rlsync.delta_format import Change, decode_delta, encode_delta
from rlsync.format import FORMAT_NAME, FORMAT_VERSION, file_kind, parse_header, read_header_file
from rlsync.hashing import state_hash
from rlsync.limits import MAX_HEADER_BYTES

CODECS = ["gapzz", "trl"]

# ---------------------------------------------------------------------------
# fixtures and helpers


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model: a few dtypes and shapes, including a 0-d tensor and special values."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "model.embed_tokens.weight": (torch.randn(16, 8, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(8, 12, generator=gen) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=gen),
        "model.scale": torch.tensor(0.5, dtype=torch.float16),
        "model.step_table": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }
    state["model.norm.weight"][:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    return state


def updated(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """``state`` with some elements of some tensors changed (bit patterns differ)."""
    gen = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in state.items()}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.scale"):
        bits = int_view(new[name])
        pick = torch.rand(bits.shape, generator=gen) < 0.2
        pick[0] = True
        bits[pick] += 1
    return new


def make_delta(state: dict[str, torch.Tensor], codec: str) -> bytes:
    """A valid delta from ``state`` to :func:`updated` (``state``)."""
    new = updated(state)
    detector = ChangeDetector(dtype=None)
    detector.reset(state)
    changes = detector.diff(new)
    total = sum(t.numel() for t in state.values())
    return encode_delta(changes, step=5, base_step=4, base_hash=state_hash(state), state_hash=state_hash(new), total=total, codec=codec)


def split(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Entries and metadata of a valid file."""
    _, metadata = parse_header(data)
    return safetensors.torch.load(data), metadata


def rewrite(
    data: bytes,
    metadata: Callable[[dict[str, str]], None] | None = None,
    entries: Callable[[dict[str, torch.Tensor]], None] | None = None,
    table: Callable[[dict[str, Any]], None] | None = None,
) -> bytes:
    """Re-serialize a valid file after editing its metadata, entries or delta tensor table in place."""
    ents, meta = split(data)
    if table is not None:
        tab = json.loads(meta["tensors"])
        table(tab)
        meta["tensors"] = json.dumps(tab)
    if metadata is not None:
        metadata(meta)
    if entries is not None:
        entries(ents)
    return safetensors.torch.save(ents, metadata=meta)


def raw_file(header: dict[str, Any] | bytes, body: bytes = b"", length: int | None = None) -> bytes:
    """A file with an arbitrary header (object or raw bytes), body and declared header length."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if length is None else length) + head + body


def assert_refused(data: bytes, state: dict[str, torch.Tensor], match: str) -> FormatError:
    """decode_delta raises FormatError matching ``match`` and leaves ``state`` bit-identical."""
    before = state_hash(state)
    with pytest.raises(FormatError, match=match) as info:
        decode_delta(data, state)
    assert state_hash(state) == before
    assert str(info.value)  # a message, not an empty error
    return info.value


def delta_metadata(**extra: str) -> dict[str, str]:
    """Plausible delta metadata, so that only the defect under test is wrong."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kind": "delta",
        "sparse": "True",
        "step": "1",
        "base_step": "0",
        "base_hash": "0" * 64,
        "state_hash": "1" * 64,
        "codec": "trl",
        "codec_version": "1",
        "changed": "1",
        "total": "1",
        "tensors": "{}",
    }
    meta.update(extra)
    return meta


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    return model_state()


# ---------------------------------------------------------------------------
# malformed safetensors headers (checked by decode_delta and by load_anchor)

META = {"__metadata__": delta_metadata()}
F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}

HOSTILE_HEADERS: list[tuple[str, bytes, str]] = [
    ("not_json", raw_file(b"{this is not json", b""), "malformed safetensors header"),
    ("not_utf8", raw_file(b'{"a": "\xff\xfe"}'), "malformed safetensors header"),
    ("json_array", raw_file(b"[1, 2, 3]"), "not a JSON object"),
    ("json_string", raw_file(b'"hello"'), "not a JSON object"),
    ("deeply_nested", raw_file(b"[" * 100_000 + b"]" * 100_000), "malformed safetensors header"),
    ("integer_of_5000_digits", raw_file(b'{"a": ' + b"9" * 5000 + b"}"), "malformed safetensors header"),
    ("metadata_value_int", raw_file({"__metadata__": {**delta_metadata(), "step": 1}}), "malformed safetensors metadata"),
    ("metadata_value_null", raw_file({"__metadata__": {**delta_metadata(), "codec": None}}), "malformed safetensors metadata"),
    ("metadata_list", raw_file({"__metadata__": ["format", "rlsync"]}), "malformed safetensors metadata"),
    ("metadata_empty_list", raw_file({"__metadata__": []}), "malformed safetensors metadata"),
    ("metadata_string", raw_file({"__metadata__": "rlsync"}), "malformed safetensors metadata"),
    ("entry_not_object", raw_file({**META, "a": 5}, b""), "malformed safetensors entry 'a'"),
    ("entry_without_dtype", raw_file({**META, "a": {"shape": [4], "data_offsets": [0, 16]}}, bytes(16)), "malformed safetensors entry 'a'"),
    ("entry_unknown_dtype", raw_file({**META, "a": {**F32_4, "dtype": "F4"}}, bytes(16)), "unknown dtype name 'F4'"),
    ("shape_infinity", raw_file(b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 16]}}', bytes(16)), "non-finite number Infinity"),
    ("shape_float", raw_file({**META, "a": {**F32_4, "shape": [4.0]}}, bytes(16)), "malformed safetensors entry 'a'"),
    ("shape_string", raw_file({**META, "a": {**F32_4, "shape": "4"}}, bytes(16)), "malformed safetensors entry 'a'"),
    ("offsets_nan", raw_file(b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [NaN, 16]}}', bytes(16)), "non-finite number NaN"),
    ("offsets_three", raw_file({**META, "a": {**F32_4, "data_offsets": [0, 8, 16]}}, bytes(16)), "malformed safetensors entry 'a'"),
    ("negative_shape", raw_file({**META, "a": {**F32_4, "shape": [-4]}}, bytes(16)), "negative dimension"),
    ("offsets_past_end", raw_file({**META, "a": {**F32_4, "data_offsets": [0, 16]}}, bytes(12)), "outside the 12-byte data section"),
    ("offsets_far_past_end", raw_file({**META, "a": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}, bytes(16)), "outside"),
    ("offsets_reversed", raw_file({**META, "a": {**F32_4, "data_offsets": [16, 0]}}, bytes(16)), "outside"),
    ("negative_offset", raw_file({**META, "a": {**F32_4, "data_offsets": [-16, 0]}}, bytes(16)), "outside"),
    (
        "overlapping_entries",
        raw_file({**META, "a": {**F32_4, "data_offsets": [0, 16]}, "b": {**F32_4, "data_offsets": [8, 24]}}, bytes(24)),
        "entries overlap",
    ),
    ("size_not_shape_times_dtype", raw_file({**META, "a": {**F32_4, "data_offsets": [0, 12]}}, bytes(12)), "do not match shape"),
    ("size_wrong_for_dtype", raw_file({**META, "a": {**F32_4, "dtype": "F64"}}, bytes(16)), "do not match shape"),
    ("header_length_past_end", raw_file({**META}, b"", length=len(json.dumps(META)) + 1), "header declares"),
    ("header_length_2_60", raw_file({**META}, b"", length=2**60), "header declares 1152921504606846976 bytes"),
    ("header_length_max", raw_file(b"{}", b"", length=2**64 - 1), "header declares"),
    ("shorter_than_length_field", b"\x10\x00\x00", "shorter than the 8-byte header length"),
    ("empty_file", b"", "shorter than the 8-byte header length"),
]


@pytest.mark.parametrize("data, match", [h[1:] for h in HOSTILE_HEADERS], ids=[h[0] for h in HOSTILE_HEADERS])
def test_malformed_header_refused_by_decode_delta(state, data: bytes, match: str) -> None:
    assert_refused(data, state, match)


@pytest.mark.parametrize("data, match", [h[1:] for h in HOSTILE_HEADERS], ids=[h[0] for h in HOSTILE_HEADERS])
def test_malformed_header_refused_by_load_anchor(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(FormatError, match=match):
        load_anchor([path])


@pytest.mark.parametrize("reader", ["parse_header", "read_header_file"])
def test_huge_header_length_allocates_nothing(tmp_path: Path, reader: str) -> None:
    """A header length field of 2**60 is refused without reading or allocating it."""
    data = raw_file(META, b"", length=2**60)
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="header declares"):
            parse_header(data) if reader == "parse_header" else read_header_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_metadata_null_is_allowed_but_not_our_format(state) -> None:
    """``"__metadata__": null`` is valid safetensors; decode_delta then refuses it as not our format."""
    data = raw_file({"__metadata__": None})
    assert parse_header(data) == ({}, {})
    assert_refused(data, state, "not an rlsync file")


# ---------------------------------------------------------------------------
# truncation and bit flips


@pytest.mark.parametrize("codec", CODECS)
def test_every_truncation_refused(state, codec: str) -> None:
    """Every proper prefix of a valid delta raises FormatError (never another exception) and writes nothing."""
    data = make_delta(state, codec)
    before = state_hash(state)
    decode_delta(data, state)  # the whole file is fine
    for cut in range(len(data)):
        with pytest.raises(FormatError):
            decode_delta(data[:cut], state)
    assert state_hash(state) == before


def test_every_truncation_of_an_anchor_refused(tmp_path: Path) -> None:
    state = {"a": torch.arange(6, dtype=torch.int16), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
    (path,) = write_anchor(state, tmp_path / "full", step=3, state_hash=state_hash(state))
    data = path.read_bytes()
    cut_path = tmp_path / "model.safetensors"
    for cut in range(len(data)):
        cut_path.write_bytes(data[:cut])
        with pytest.raises(FormatError):
            load_anchor([cut_path])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipped_bytes_never_escape(state, codec: str, mask: int) -> None:
    """Flipping any byte of a delta gives FormatError or a delta that stays inside the model.

    A flip that survives decoding (zstd carries no checksum here) must still yield
    in-range patches of the right dtype, and the result differs from the promised
    state, which the protocol's hash check catches. Decoding never writes.
    """
    data = make_delta(state, codec)
    header_len = struct.unpack("<Q", data[:8])[0]
    expected = state_hash(updated(state))
    before = state_hash(state)
    refused = survived = 0
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= mask
        try:
            delta = decode_delta(bytes(flipped), state)
        except FormatError:
            refused += 1
            continue
        survived += 1
        work = {n: t.clone() for n, t in state.items()}
        for name, patch in delta.patches.items():
            assert patch.values.dtype == state[name].dtype
            assert patch.index.numel() == 0 or 0 <= int(patch.index.min()) <= int(patch.index.max()) < state[name].numel()
            patch.apply_(work[name])
        if pos >= 8 + header_len:  # payload flips that decode change the result
            assert state_hash(work) != expected, f"flip at payload byte {pos} went unnoticed"
    assert state_hash(state) == before
    assert refused > 0


# ---------------------------------------------------------------------------
# delta-level hostile metadata


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(format="safetensors"), "not an rlsync file"),
        (lambda m: m.pop("format"), "not an rlsync file"),
        (lambda m: m.update(format_version="2"), "unsupported rlsync file format version '2'.*re-publish an anchor"),
        (lambda m: m.update(format_version="3.0"), "unsupported rlsync file format version '3.0'"),
        (lambda m: m.pop("format_version"), "unsupported rlsync file format version 'None'"),
        (lambda m: m.update(kind="anchor"), "expected a delta, got kind='anchor'"),
        (lambda m: m.pop("kind"), "expected a delta"),
        (lambda m: m.update(codec="zstd-magic"), "unknown codec 'zstd-magic'"),
        (lambda m: m.pop("codec"), "metadata has no 'codec'"),
        (lambda m: m.update(codec_version="2"), "codec version '2'"),
        (lambda m: m.pop("codec_version"), "metadata has no 'codec_version'"),
        (lambda m: m.update(tensors="{not json"), "malformed metadata 'tensors': not valid JSON"),
        (lambda m: m.update(tensors="[]"), "'tensors' is not a JSON object"),
        (lambda m: m.pop("tensors"), "metadata has no 'tensors'"),
        (lambda m: m.update(changed=str(int(m["changed"]) + 1)), "metadata says"),
        (lambda m: m.update(step="five"), "'step' is not a non-negative integer"),
        (lambda m: m.pop("base_hash"), "metadata has no 'base_hash'"),
    ],
    ids=[
        "format_name", "format_missing", "format_version", "format_version_float", "format_version_missing", "kind_anchor",
        "kind_missing", "unknown_codec", "codec_missing", "codec_version", "codec_version_missing", "table_not_json",
        "table_not_object", "table_missing", "changed_mismatch", "step_not_int", "base_hash_missing",
    ],
)
def test_hostile_metadata_refused(state, codec: str, edit, match: str) -> None:
    data = rewrite(make_delta(state, codec), metadata=edit)
    assert_refused(data, state, match)


@pytest.mark.parametrize("codec", CODECS)
def test_anchor_given_to_decode_delta_refused(tmp_path: Path, state, codec: str) -> None:
    (path,) = write_anchor(state, tmp_path, step=4, state_hash=state_hash(state))
    assert_refused(path.read_bytes(), state, "expected a delta, got kind='anchor'")


@pytest.mark.parametrize("codec", CODECS)
def test_tensor_not_in_model_refused(state, codec: str) -> None:
    old, new = "model.norm.weight", "model.ghost.weight"

    def rename_entries(ents):
        for key in list(ents):
            if key.startswith(old + "."):
                ents[new + key[len(old) :]] = ents.pop(key)

    data = rewrite(make_delta(state, codec), table=lambda t: t.update({new: t.pop(old)}), entries=rename_entries)
    assert_refused(data, state, "'model.ghost.weight', which is not in the model")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update({"model.embed_tokens.weight": s["model.embed_tokens.weight"].to(torch.float16)}),
        lambda s: s.update({"model.embed_tokens.weight": s["model.embed_tokens.weight"].reshape(8, 16)}),
        lambda s: s.update({"model.embed_tokens.weight": s["model.embed_tokens.weight"].reshape(-1)}),
        lambda s: s.update({"model.scale": s["model.scale"].reshape(1)}),
        lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(torch.float64)}),
    ],
    ids=["dtype_bf16_vs_f16", "shape_transposed", "shape_flattened", "scalar_vs_1d", "dtype_f32_vs_f64"],
)
def test_dtype_or_shape_not_matching_model_refused(state, codec: str, change) -> None:
    data = make_delta(state, codec)
    model = dict(state)
    change(model)
    assert_refused(data, model, "delta is for")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("field, value", [("shape", 128), ("shape", None), ("dtype", "F16"), ("dtype", ["BF16"])])
def test_table_dtype_or_shape_malformed_refused(state, codec: str, field: str, value) -> None:
    data = rewrite(make_delta(state, codec), table=lambda t: t["model.embed_tokens.weight"].update({field: value}))
    assert_refused(data, state, "delta is for")


@pytest.mark.parametrize("codec", CODECS)
def test_table_entry_not_object_refused(state, codec: str) -> None:
    data = rewrite(make_delta(state, codec), table=lambda t: t.update({"model.scale": 1}))
    assert_refused(data, state, "not an object")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("count", ["too_many", 0, -1, "3", 2.0, None])
def test_invalid_declared_count_refused(state, codec: str, count) -> None:
    """A declared count larger than the tensor (or not a positive integer) is refused before decoding."""
    numel = state["model.norm.weight"].numel()
    value = numel + 1 if count == "too_many" else count
    data = rewrite(make_delta(state, codec), table=lambda t: t["model.norm.weight"].update(count=value))
    assert_refused(data, state, "invalid changed count")


@pytest.mark.parametrize("codec, match", [("gapzz", "declares"), ("trl", "expected 1 elements")])
def test_declared_count_not_matching_entries_refused(state, codec: str, match: str) -> None:
    data = make_delta(state, codec)
    table = json.loads(split(data)[1]["tensors"])
    assert table["model.norm.weight"]["count"] > 1
    data = rewrite(data, table=lambda t: t["model.norm.weight"].update(count=1))
    assert_refused(data, state, match)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("what", ["extra", "missing"])
def test_entries_not_matching_table_refused(state, codec: str, what: str) -> None:
    def edit(ents):
        if what == "extra":
            ents["model.norm.weight.bonus"] = torch.zeros(3, dtype=torch.uint8)
        else:
            ents.pop(sorted(ents)[0])

    assert_refused(rewrite(make_delta(state, codec), entries=edit), state, "entries do not match its tensor table")


# ---------------------------------------------------------------------------
# hostile indices


def crafted_delta(state: dict[str, torch.Tensor], codec: str, name: str, index: list[int]) -> bytes:
    """A delta for ``name`` storing exactly ``index`` (encode_delta does not validate; decoders must)."""
    target = state[name]
    idx = np.array(index, dtype=np.int64)
    bits = np.arange(1, idx.size + 1, dtype=np.uint16)
    change = Change(index=idx, old_bits=np.zeros_like(bits), new_bits=bits, dtype=target.dtype, shape=tuple(target.shape))
    return encode_delta({name: change}, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=1, codec=codec)


NAME = "model.embed_tokens.weight"  # bf16, 128 elements
HOSTILE_INDICES = [
    ("out_of_range", [3, 128], {"gapzz": "out of range", "trl": "out of range"}),
    ("far_out_of_range", [2**40], {"gapzz": "out of range", "trl": "out of range"}),
    ("negative", [-1, 4], {"gapzz": "out of range", "trl": "out of range"}),
    ("duplicate", [4, 7, 7, 9], {"gapzz": "out of range", "trl": "not strictly increasing"}),
    ("unsorted", [9, 4], {"gapzz": "out of range", "trl": "not strictly increasing"}),
]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("index, matches", [h[1:] for h in HOSTILE_INDICES], ids=[h[0] for h in HOSTILE_INDICES])
def test_hostile_indices_refused(state, codec: str, index: list[int], matches: dict[str, str]) -> None:
    """Out-of-range, negative, duplicate and unsorted positions never reach the state.

    gapzz cannot express a duplicate or backwards step except as a gap wider than the tensor.
    """
    assert_refused(crafted_delta(state, codec, NAME, index), state, matches[codec])


def test_trl_int32_negative_index_refused(state) -> None:
    data = rewrite(make_delta(state, "trl"), entries=lambda e: e[NAME + ".indices"].__setitem__(0, -5))
    assert_refused(data, state, "out of range")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda e: e.update({NAME + ".indices": e[NAME + ".indices"].float()}), "expected int32 or int64 indices"),
        (lambda e: e.update({NAME + ".indices": e[NAME + ".indices"].to(torch.int16)}), "expected int32 or int64 indices"),
        (lambda e: e.update({NAME + ".indices": e[NAME + ".indices"].reshape(1, -1)}), "expected 1-D"),
        (lambda e: e.update({NAME + ".values": e[NAME + ".values"].float()}), "values of 2 bytes"),
        (lambda e: e.update({NAME + ".values": e[NAME + ".values"][:-1].clone()}), "values of 2 bytes"),
        (lambda e: e.update({NAME + ".values": e[NAME + ".values"].reshape(1, -1)}), "values of 2 bytes"),
    ],
    ids=["float_indices", "int16_indices", "2d_indices", "f32_values", "short_values", "2d_values"],
)
def test_trl_malformed_entries_refused(state, edit, match: str) -> None:
    assert_refused(rewrite(make_delta(state, "trl"), entries=edit), state, match)


@pytest.mark.parametrize("gap_bytes", [0, 3, 16, "1", 1.0, True, None, [1]])
def test_gapzz_invalid_gap_bytes_refused(state, gap_bytes) -> None:
    data = rewrite(make_delta(state, "gapzz"), table=lambda t: t[NAME].update(gap_bytes=gap_bytes))
    assert_refused(data, state, "invalid gap_bytes")


def _zstd_frame_declaring(size: int) -> bytes:
    """A zstd frame header declaring ``size`` content bytes (8-byte field, single segment) and one empty raw block."""
    magic = struct.pack("<I", 0xFD2FB528)
    descriptor = bytes([0b1110_0000])  # FCS field 8 bytes, single segment, no checksum, no dictionary
    return magic + descriptor + struct.pack("<Q", size) + bytes([0x01, 0x00, 0x00])  # last raw block of size 0


def test_zstd_helper_frame_is_what_it_claims() -> None:
    assert zstandard.frame_content_size(_zstd_frame_declaring(2**40)) == 2**40


@pytest.mark.parametrize("part", ["pos", "val"])
@pytest.mark.parametrize(
    "blob, match",
    [
        (_zstd_frame_declaring(2**40), "declares 1099511627776 bytes"),
        (_zstd_frame_declaring(2**63), "declares"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64)), "does not declare its size"),
        (b"definitely not zstd", "not a zstd frame"),
        (b"", "not a zstd frame"),
    ],
    ids=["huge_1TiB", "huge_2_63", "no_content_size", "garbage", "empty"],
)
def test_gapzz_hostile_zstd_frames_refused(state, part: str, blob: bytes, match: str) -> None:
    """A frame declaring a huge (or no) content size is refused before decompression allocates it."""
    key = f"{NAME}.{part}"
    tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    data = rewrite(make_delta(state, "gapzz"), entries=lambda e: e.update({key: tensor}))
    assert_refused(data, state, match)


@pytest.mark.parametrize("part", ["pos", "val"])
def test_gapzz_corrupt_zstd_body_refused(state, part: str) -> None:
    """A frame with the right declared size whose compressed body is cut short."""
    key = f"{NAME}.{part}"

    def cut(ents):
        blob = ents[key].numpy().tobytes()
        ents[key] = torch.frombuffer(bytearray(blob[:-3]), dtype=torch.uint8)

    assert_refused(rewrite(make_delta(state, "gapzz"), entries=cut), state, "corrupt zstd data|cut short")


@pytest.mark.parametrize("part, dtype", [("pos", torch.int8), ("val", torch.int16)])
def test_gapzz_entry_of_wrong_dtype_refused(state, part: str, dtype: torch.dtype) -> None:
    key = f"{NAME}.{part}"
    data = rewrite(make_delta(state, "gapzz"), entries=lambda e: e.update({key: e[key].view(torch.int8).to(dtype)}))
    assert_refused(data, state, "expected 1-D torch.uint8")


def test_gapzz_gap_wider_than_tensor_refused(state) -> None:
    """A single gap >= numel, even one whose cumulative sum would wrap int64, is refused."""
    codec = get_codec("gapzz")
    for gap in (128, 2**63, 2**64 - 1):
        planes = np.frombuffer(struct.pack("<Q", gap), dtype=np.uint8).copy()
        data = rewrite(
            crafted_delta(state, "gapzz", NAME, [0]),
            table=lambda t: t[NAME].update(gap_bytes=8),
            entries=lambda e: e.update({NAME + ".pos": codec._compress(planes)}),
        )
        assert_refused(data, state, "out of range")


# ---------------------------------------------------------------------------
# anchors


def anchor_state() -> dict[str, torch.Tensor]:
    """A state with every kind of tensor an anchor must carry bit-exactly."""
    state = model_state()
    state["model.empty"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    state["model.fp8"] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaNs included
    state["model.mask"] = torch.tensor([True, False, True])
    state["model.nan_payloads"] = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001, -32768], dtype=torch.int16).view(torch.bfloat16)
    return state


def test_anchor_round_trip_single_file(tmp_path: Path) -> None:
    state = anchor_state()
    h = state_hash(state)
    files = write_anchor(state, tmp_path, step=7, state_hash=h)
    assert [f.name for f in files] == ["model.safetensors"]
    loaded, metadata = load_anchor(files)
    assert state_hash(loaded) == h
    assert metadata["kind"] == "anchor" and metadata["step"] == "7" and metadata["state_hash"] == h
    assert metadata["total"] == str(sum(t.numel() for t in state.values()))


def test_anchor_sharding_hf_style(tmp_path: Path) -> None:
    """Small max_shard_bytes: HF shard names, an index whose weight_map covers every tensor, plain-safetensors shards."""
    state = anchor_state()
    state.update({f"model.layers.{i}.self_attn.q_proj.weight": torch.full((10, 10), float(i), dtype=torch.bfloat16) for i in range(6)})
    h = state_hash(state)
    max_bytes = 300
    files = write_anchor(state, tmp_path, step=12, state_hash=h, max_shard_bytes=max_bytes)
    shards, index_file = files[:-1], files[-1]
    n = len(shards)
    assert n >= 3
    assert index_file.name == INDEX_FILE
    assert [f.name for f in shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name) for f in shards)

    index = json.loads(index_file.read_text())
    assert set(index["weight_map"]) == set(state)
    seen: dict[str, str] = {}
    for shard in shards:
        with safetensors.safe_open(str(shard), framework="pt") as f:
            meta = f.metadata()
            assert meta["format"] == FORMAT_NAME
            assert meta["format_version"] == str(FORMAT_VERSION)
            assert meta["kind"] == "anchor"
            assert meta["sparse"] == "False"
            assert meta["step"] == "12"
            assert meta["state_hash"] == h
            for key in f.keys():
                assert index["weight_map"][key] == shard.name
                assert state_hash({key: f.get_tensor(key)}) == state_hash({key: state[key]})
                seen[key] = shard.name
        size = sum(state[k].numel() * state[k].element_size() for k in seen if seen[k] == shard.name)
        assert size <= max_bytes or len([k for k in seen if seen[k] == shard.name]) == 1
    assert set(seen) == set(state)

    loaded, metadata = load_anchor(files)
    assert state_hash(loaded) == h
    assert metadata["step"] == "12"


def test_plan_shards_bounds_and_covers() -> None:
    state = {f"t{i:02d}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate([10, 90, 5, 200, 1, 50, 50])}
    groups = plan_shards(state, max_shard_bytes=100)
    assert [n for g in groups for n in g] == sorted(state)
    for group in groups:
        assert sum(state[n].numel() for n in group) <= 100 or len(group) == 1
    assert ["t03"] in groups  # the 200-byte tensor alone


@pytest.mark.parametrize("field, value", [("step", "13"), ("state_hash", "f" * 64), ("total", "1")])
def test_shards_with_disagreeing_metadata_refused(tmp_path: Path, field: str, value: str) -> None:
    state = anchor_state()
    files = write_anchor(state, tmp_path, step=12, state_hash=state_hash(state), max_shard_bytes=200)
    victim = files[1]
    tensors, meta = split(victim.read_bytes())
    victim.write_bytes(safetensors.torch.save(tensors, metadata={**meta, field: value}))
    with pytest.raises(FormatError, match="disagrees with the other shards"):
        load_anchor(files)


def test_tensor_in_two_shards_refused(tmp_path: Path) -> None:
    state = anchor_state()
    files = write_anchor(state, tmp_path, step=12, state_hash=state_hash(state), max_shard_bytes=200)
    first, meta = split(files[0].read_bytes())
    second, _ = split(files[1].read_bytes())
    files[1].write_bytes(safetensors.torch.save({**second, **first}, metadata=meta))
    with pytest.raises(FormatError, match="tensors appear in two shards"):
        load_anchor(files)


def test_delta_given_as_anchor_shard_refused(tmp_path: Path, state) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(make_delta(state, "gapzz"))
    with pytest.raises(FormatError, match="expected a anchor, got kind='delta'"):
        load_anchor([path])


def test_anchor_without_shards_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="^anchor has no shard files$"):
        load_anchor([tmp_path / INDEX_FILE])


# ---------------------------------------------------------------------------
# delta metadata, readable by plain safetensors


@pytest.mark.parametrize("codec", CODECS)
def test_delta_metadata_readable_by_safe_open(tmp_path: Path, state, codec: str) -> None:
    data = make_delta(state, codec)
    new = updated(state)
    path = tmp_path / "delta.safetensors"
    path.write_bytes(data)
    changed = {n for n in state if state_hash({n: state[n]}) != state_hash({n: new[n]})}
    n_changed = sum(int((int_view(state[n]) != int_view(new[n])).sum()) for n in state)
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
        for key in keys:
            f.get_tensor(key)
    assert meta["format"] == FORMAT_NAME and meta["format_version"] == str(FORMAT_VERSION)
    assert meta["kind"] == "delta"
    assert meta["sparse"] == "True"
    assert meta["step"] == "5" and meta["base_step"] == "4"
    assert meta["base_hash"] == state_hash(state)
    assert meta["state_hash"] == state_hash(new)
    assert meta["codec"] == codec and meta["codec_version"] == str(get_codec(codec).version)
    assert meta["changed"] == str(n_changed)
    assert meta["total"] == str(sum(t.numel() for t in state.values()))
    assert {k.rsplit(".", 1)[0] for k in keys} == changed
    assert set(json.loads(meta["tensors"])) == changed
    # and the same file decodes to the promised state
    delta = decode_delta(data, state)
    work = {n: t.clone() for n, t in state.items()}
    for name, patch in delta.patches.items():
        patch.apply_(work[name])
    assert state_hash(work) == meta["state_hash"]


# ---------------------------------------------------------------------------
# which of our files a header describes (``file_kind``, used by ``python -m rlsync inspect``)


def test_file_kind_of_anchors_and_deltas() -> None:
    assert file_kind(anchor_metadata(step=3, state_hash="0" * 64, total=10)) == "anchor"
    assert file_kind(delta_metadata()) == "delta"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kind": "checkpoint"}, r"^unknown file kind 'checkpoint'$"),
        ({"kind": None}, r"^unknown file kind None$"),
        ({"format": "other"}, r"^not an rlsync file \(format='other'\)$"),
        ({"format_version": "99"}, r"^unsupported rlsync file format version '99': this reader reads version\(s\) 3; re-publish"),
    ],
)
def test_file_kind_refuses_other_files(changes: dict, message: str) -> None:
    metadata = {k: v for k, v in {**delta_metadata(), **changes}.items() if v is not None}
    with pytest.raises(FormatError, match=message):
        file_kind(metadata)


# ---------------------------------------------------------------------------
# reading only what is needed


@pytest.mark.parametrize(
    "header_len", [64, MAX_HEADER_BYTES + 1, 2**64 - 1], ids=["small-header", "over-the-limit", "negative-if-signed"]
)
def test_read_header_file_reads_the_header_only(tmp_path: Path, header_len: int) -> None:
    """A 160 MiB file (sparse on disk) is never read past its header, whatever its header length field says."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len) + b"{" + b" " * 62 + b"}")
        f.truncate(160 * 2**20)
    tracemalloc.start()
    try:
        if header_len == 64:  # a valid empty header: read, the body left alone
            assert read_header_file(path) == ({}, {})
        else:
            with pytest.raises(FormatError, match="header declares"):
                read_header_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_load_anchor_skips_the_index_wherever_it_is_listed(tmp_path: Path) -> None:
    state = anchor_state()
    state.update({f"model.layers.{i}.w": torch.full((10, 10), float(i), dtype=torch.bfloat16) for i in range(4)})
    files = write_anchor(state, tmp_path, step=3, state_hash=state_hash(state), max_shard_bytes=300)
    assert files[-1].name == INDEX_FILE and len(files) > 2
    loaded, metadata = load_anchor([files[-1], *files[:-1]])  # the index first, as a hostile pointer may list it
    assert state_hash(loaded) == state_hash(state) and metadata["step"] == "3"


# ---------------------------------------------------------------------------
# issue 11: bounded work before trust (findings 3, 4, 5, 7)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "tensors, match",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),
        ('{"x": ' + "9" * 5000 + "}", "longer than 30 digits"),
        ('{"x": 1e999}', "1e100 or more"),
        ('{"x": NaN}', "non-finite"),
    ],
    ids=["deep_nesting", "5000_digits", "overflowing_float", "nan"],
)
def test_hostile_table_json_is_a_format_error(state, codec: str, tensors: str, match: str) -> None:
    """Finding 4: RecursionError and ValueError escaped decode_delta and killed the fetch thread."""
    assert_refused(rewrite(make_delta(state, codec), metadata=lambda m: m.update(tensors=tensors)), state, match)


@pytest.mark.parametrize("field", ["step", "base_step", "changed", "total"])
def test_integer_metadata_bounded(state, field: str) -> None:
    for value in ("9" * 5000, "-1", "1e3", " 1", "１"):  # the last: a full-width digit int() would accept
        assert_refused(rewrite(make_delta(state, "gapzz"), metadata=lambda m: m.update({field: value})), state, f"'{field}'|metadata says")


@pytest.mark.parametrize(
    "shape, match",
    [([10**18] * 60, "do not match"), ([2] * 65, "more than 64"), ([1, -1], "negative"), ([2**64] * 3, "do not match")],
    ids=["60_huge_dims", "65_dims", "negative", "beyond_int64"],
)
def test_hostile_shapes_refused_before_any_product(state, shape: list[int], match: str) -> None:
    """Finding 5: many huge dimensions made the size product quadratic (25 s at 3 MB of header)."""
    data = raw_file({"a": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 2]}}, bytes(2))
    assert_refused(data, state, match)


def test_header_with_many_huge_shapes_parses_in_linear_time() -> None:
    """Finding 5: 3 MB of huge-dimension shapes. The product stops at the first dimension
    larger than the file, so the work per entry is bounded: 8x the entries, about 8x the time."""
    import time as _time

    def seconds(entries: int) -> float:
        header = {f"t{i}": {"dtype": "BF16", "shape": [10**18] * 60, "data_offsets": [0, 2]} for i in range(entries)}
        data = raw_file(header, bytes(2))
        t0 = _time.perf_counter()
        with pytest.raises(FormatError):
            parse_header(data)
        return _time.perf_counter() - t0

    small, large = min(seconds(300) for _ in range(3)), min(seconds(2400) for _ in range(3))
    assert large < 40 * max(small, 1e-3)  # quadratic would be 64x; linear 8x (generous for a loaded machine)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_differences_refused(state, codec: str) -> None:
    """Finding 7: a delta declaring elements changed with zero difference is no change."""
    name = "model.embed_tokens.weight"
    bits = int_view(state[name]).reshape(-1).numpy().view(np.uint16)
    index = np.arange(state[name].numel(), dtype=np.int64)
    change = Change(index, bits[index], bits[index].copy(), state[name].dtype, tuple(state[name].shape))
    h = state_hash(state)
    data = encode_delta({name: change}, step=5, base_step=4, base_hash=h, state_hash=h, total=1, codec=codec)
    assert_refused(data, state, "do not change")
    one_real = bits[index].copy()
    one_real[0] += 1  # a single zero difference among real ones is refused as well
    one_real[1:] += 1
    one_real[5] -= 1
    change = Change(index, bits[index], one_real, state[name].dtype, tuple(state[name].shape))
    data = encode_delta({name: change}, step=5, base_step=4, base_hash=h, state_hash="0" * 64, total=1, codec=codec)
    assert_refused(data, state, "do not change")


@pytest.mark.parametrize("part", ["pos", "val"])
@pytest.mark.parametrize(
    "extra",
    [b"trailing garbage", zstandard.compress(b"a second frame"), struct.pack("<II", 0x184D2A50, 4) + b"skip"],
    ids=["garbage", "second_frame", "skippable_frame"],
)
def test_gapzz_only_one_frame_and_nothing_after(state, part: str, extra: bytes) -> None:
    """Finding 7: trailing garbage, a second frame or a trailing skippable frame were accepted."""
    key = f"{NAME}.{part}"

    def append(ents):
        ents[key] = torch.frombuffer(bytearray(ents[key].numpy().tobytes() + extra), dtype=torch.uint8)

    assert_refused(rewrite(make_delta(state, "gapzz"), entries=append), state, "after the zstd frame")


def test_frame_lying_about_its_size_is_stopped_early() -> None:
    """A frame whose declared size is right but whose blocks hold far more is cut by libzstd
    at the declared size instead of being decompressed in full."""
    from rlsync.codecs.checks import decompress_frame

    real = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(64 << 20))
    lying = bytearray(real)
    declared = zstandard.get_frame_parameters(real).content_size
    assert declared == 64 << 20
    width = {0: 1, 1: 2, 2: 4, 3: 8}[lying[4] >> 6]  # frame header descriptor: width of the size field
    assert width == 4
    field = bytes(lying).find(struct.pack("<I", declared))
    assert field > 0
    lying[field : field + width] = (1024).to_bytes(width, "little")  # declare 1 KiB, keep the 64 MiB of blocks
    tracemalloc.start()
    with pytest.raises(FormatError):
        decompress_frame(bytes(lying), what="x", expected=zstandard.frame_content_size(bytes(lying)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("codec", ["classrice", *CODECS])
@pytest.mark.parametrize(
    "hostile,match",
    [("read_at_minus_3", "out of range"), ("minus_3", "out of range"), ("past_the_end", "out of range"),
     ("duplicate", "not strictly increasing"), ("one_short", "the metadata declares"),
     ("raises", "decoder failed on this delta: IndexError")],
)  # fmt: skip
def test_every_codecs_decoded_positions_are_checked_by_decode_delta(state, monkeypatch, codec: str, hostile: str, match: str) -> None:
    """Issue 33 item 2: what a codec decodes (or reads the old bits at) is checked in one place for every
    codec, so a decoder bug yields a FormatError, never an IndexError or a patch at position -3."""
    from rlsync.codecs import get_codec

    data = make_delta(state, codec)
    coder = get_codec(codec)
    decode = coder.decode  # what decode_delta calls

    def lying(name, entries, params, target):
        index, new_bits, old_bits = decode(name, entries, params, target)
        if name != NAME:
            return index, new_bits, old_bits
        if hostile == "read_at_minus_3":
            target.bits_at(np.array([-3]))
        if hostile == "raises":  # a decoder bug on a hostile file (as numpy's IndexError on a wrapped position was)
            raise IndexError("index -9223372036854775803 is out of bounds")
        edit = {"minus_3": lambda i: np.concatenate([[-3], i[1:]]), "past_the_end": lambda i: np.concatenate([i[:-1], [target.numel]]),
                "duplicate": lambda i: np.concatenate([i[:1], i[:-1]]), "one_short": lambda i: i[1:]}.get(hostile, lambda i: i)  # fmt: skip
        index = edit(index)
        return index, new_bits[: index.size], None if old_bits is None else old_bits[: index.size]

    monkeypatch.setattr(coder, "decode", lying)
    assert_refused(data, state, match)
