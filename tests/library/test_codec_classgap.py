"""The ``classgap`` codec: its class order, round trips across chunk boundaries, size, and hostile input.

The generic round trips over every dtype, shape and special value run for
``classgap`` in :mod:`tests.test_codecs` (it is in its ``CODECS``). Here the
chunk size is shrunk so that small tensors span many chunks, the coding order is
checked to be a bijection, decoding without the base tensor (through
``old_bits_at`` only) is checked against decoding with it, sizes are bounded on
RL-like data, and malformed order parameters and zstd streams are refused.
"""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import rlsync.codecs.classgap as classgap
from rlsync.codecs import DecodeTarget, get_codec
from rlsync.codecs.classgap import ClassOrder
from rlsync.detect import ChangeDetector
from rlsync.dtypes import EXPONENT_FIELDS, dtype_name
from rlsync.delta_format import Change, encode_delta
from rlsync.format import parse_header
from tests.library.test_codecs import FLOAT_DTYPES, _rl_deltas, bits_of, from_bits, mutate, publish_and_follow, random_bits
from tests.library.test_codecs import HYPOTHESIS as ROUND_TRIP_SETTINGS
from tests.library.test_format_hostile import NAME, assert_refused, make_delta, rewrite, state  # noqa: F401 (fixture)
from tests.library.test_format_hostile import test_every_truncation_refused as every_truncation_refused
from tests.library.test_format_hostile import test_flipped_bytes_never_escape as flipped_bytes_never_escape

HYPOTHESIS = settings(ROUND_TRIP_SETTINGS, derandomize=True)


def normal_bits(rng: np.random.Generator, dtype: torch.dtype, numel: int) -> np.ndarray:
    """Bit patterns of weights drawn like an LLM's (~N(0, 0.02)), with a few special values mixed in."""
    values = torch.from_numpy(rng.standard_normal(numel).astype(np.float32) * 0.02).to(dtype)
    bits = bits_of(values)
    specials = rng.random(numel) < 0.05
    bits[specials] = random_bits(rng, dtype, int(specials.sum()))
    return bits


def chunk_size(size: int):
    """Shrink the class-ordering chunk so that small tensors span many chunks (both sides read the module global)."""
    return mock.patch.object(classgap, "CHUNK", size)


@HYPOTHESIS
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 3000),
    chunk=st.sampled_from([1, 7, 64, 1000, 1 << 20]),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_across_chunks(dtype: torch.dtype, numel: int, chunk: int, density: float, seed: int) -> None:
    """Any float dtype, size, chunk size and density round-trips bit-exactly in exponent order."""
    with chunk_size(chunk):
        rng = np.random.default_rng(seed)
        old = from_bits(normal_bits(rng, dtype, numel), dtype, (numel,))
        new = mutate(rng, old, int(rng.binomial(numel, density)), specials=True)
        detector = ChangeDetector(dtype=None)
        detector.reset({"w": old})
        changes, data = publish_and_follow({"w": new}, {"w": old.clone()}, "classgap", detector)
        if changes:
            assert json.loads(parse_header(data)[1]["tensors"])["w"]["order"] == "exponent"


@HYPOTHESIS
@given(numel=st.integers(1, 5000), chunk=st.sampled_from([1, 3, 64, 4096]), seed=st.integers(0, 2**32 - 1))
def test_class_order_is_a_bijection_grouped_by_class(numel: int, chunk: int, seed: int) -> None:
    """Ranks of all positions are a permutation of 0..n-1, class by class, flat order within a class; positions_of inverts."""
    with chunk_size(chunk):
        rng = np.random.default_rng(seed)
        tensor = from_bits(normal_bits(rng, torch.bfloat16, numel), torch.bfloat16, (numel,))
        order = ClassOrder.of_tensor(tensor, EXPONENT_FIELDS["BF16"])
        ranks, positions = order.ranks_of(torch.arange(numel))
        np.testing.assert_array_equal(ranks.numpy(), np.arange(numel))
        exponents = (bits_of(tensor).astype(np.int64) >> 7) & 0xFF
        np.testing.assert_array_equal(positions.numpy(), np.lexsort((np.arange(numel), exponents)))
        some = np.sort(rng.choice(numel, size=min(numel, 17), replace=False))
        np.testing.assert_array_equal(order.positions_of(torch.from_numpy(some)).numpy(), positions.numpy()[some])


def test_round_trip_with_the_real_chunk_size() -> None:
    """A bf16 tensor of 2.5 chunks (the last one partial) at ~1% changed round-trips bit-exactly."""
    rng = np.random.default_rng(7)
    numel = 5 * classgap.CHUNK // 2 + 3
    old = from_bits(normal_bits(rng, torch.bfloat16, numel), torch.bfloat16, (numel,))
    new = mutate(rng, old, numel // 100, specials=False)
    detector = ChangeDetector(dtype=None)
    detector.reset({"w": old})
    publish_and_follow({"w": new}, {"w": old.clone()}, "classgap", detector)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_without_base_reads_old_bits_through_the_callback(dtype: torch.dtype) -> None:
    """Decoding from ``old_bits_at`` alone (no base tensor) gives the same patch as decoding with it."""
    with chunk_size(50):
        rng = np.random.default_rng(3)
        numel = 777
        old = from_bits(normal_bits(rng, dtype, numel), dtype, (numel,))
        new = mutate(rng, old, 40, specials=True)
        index = np.flatnonzero(bits_of(old) != bits_of(new))
        old_all, new_all = bits_of(old), bits_of(new)
        codec = get_codec("classgap")
        encoded = codec.encode("w", index, old_all[index], new_all[index], base=old)
        assert encoded.params["order"] == "exponent"
        params = {"dtype": dtype_name(dtype), **encoded.params}
        target = DecodeTarget(count=index.size, numel=numel, itemsize=old.element_size(), bits_at=lambda idx: old_all[idx])
        with_base = codec.decode("w", encoded.entries, params, dataclasses.replace(target, tensor=old))
        without = codec.decode("w", encoded.entries, params, target)
        for got_index, got_bits, _ in (with_base, without):
            np.testing.assert_array_equal(got_index, index)
            np.testing.assert_array_equal(got_bits, new_all[index])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8], ids=str)
def test_flat_order_without_an_exponent_or_a_base(dtype: torch.dtype) -> None:
    """Integer tensors, and any tensor encoded without its base, fall back to flat order: gapzz's position stream."""
    index = np.array([0, 5, 9], dtype=np.int64)
    old = np.zeros(3, dtype=np.uint8 if dtype != torch.int32 else np.uint32)
    new = old + 1
    for base in (None, torch.zeros(10, dtype=dtype)):
        encoded = get_codec("classgap").encode("w", index, old, new, base=base)
        assert encoded.params["order"] == "flat"
        reference = get_codec("gapzz").encode("w", index, old, new)
        assert torch.equal(encoded.entries["w.pos"], reference.entries["w.pos"])
    bf16 = get_codec("classgap").encode("w", index, old.astype(np.uint16), new.astype(np.uint16), base=None)
    assert bf16.params["order"] == "flat"


def test_size_bounds_on_rl_like_updates() -> None:
    """At 0.5-3% density classgap uses <= 1.1 bytes per changed element (whole file), >= 15% less than gapzz."""
    for density, sizes, _, changes in _rl_deltas():
        assert 0.005 <= density <= 0.03
        changed = sum(c.index.size for c in changes.values())
        assert sizes["classgap"] / changed <= 1.1, f"classgap: {sizes['classgap'] / changed:.3f} bytes per changed element"
        assert sizes["classgap"] <= 0.85 * sizes["gapzz"], f"classgap {sizes['classgap']} vs gapzz {sizes['gapzz']}"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_value_signs_and_magnitudes_cover_the_whole_wrapping_range(dtype: torch.dtype) -> None:
    """Differences of +-1, the largest positive and the most negative wrap exactly; signs take one bit each."""
    width = 8 * torch.empty((), dtype=dtype).element_size()
    np_dtype = np.dtype(f"uint{width}")
    diffs = np.array([1, (1 << width) - 1, (1 << (width - 1)) - 1, 1 << (width - 1), 2, (1 << width) - 2], dtype=np_dtype)
    old = np.arange(diffs.size, dtype=np_dtype) * np_dtype.type(77)
    new = old + diffs
    codec = get_codec("classgap")
    entries = codec._encode_values("w", old, new)
    assert entries["w.sign"].numel() == 1  # six signs in one byte
    np.testing.assert_array_equal(codec._decode_values("w", entries, DecodeTarget(count=diffs.size, numel=diffs.size, itemsize=width // 8, bits_at=old.__getitem__)), diffs)


# ---------------------------------------------------------------------------
# hostile input


@pytest.mark.parametrize("order", [None, "bogus", 1, ["exponent"], {"a": 1}, "Exponent"])
def test_invalid_order_refused(state, order) -> None:
    data = rewrite(make_delta(state, "classgap"), table=lambda t: t[NAME].update(order=order))
    assert_refused(data, state, "invalid order")


def test_exponent_order_for_an_integer_tensor_refused(state) -> None:
    """An integer tensor has no exponent: a delta claiming exponent order for one is refused."""
    name = "model.step_table"
    bits = np.zeros(2, np.uint64)
    change = Change(index=np.array([1, 2]), old_bits=bits, new_bits=bits + 1, dtype=torch.int64, shape=(3, 4))
    data = encode_delta({name: change}, step=5, base_step=4, base_hash="0" * 64, state_hash="1" * 64, total=1, codec="classgap")
    data = rewrite(data, table=lambda t: t[name].update(order="exponent"))
    assert_refused(data, state, "invalid order")


def test_rank_beyond_the_tensor_refused(state) -> None:
    """A gap stream whose ranks run past the tensor is refused before any class order is looked up."""
    codec = get_codec("classgap")
    planes = np.array([100, 100], dtype=np.uint8)  # ranks 100 and 201 of a 128-element tensor
    data = rewrite(
        make_delta(state, "classgap"),
        table=lambda t: t[NAME].update(count=2, gap_bytes=1),
        entries=lambda e: e.update({NAME + ".pos": codec._compress(planes), NAME + ".val": codec._compress(np.zeros(4, np.uint8))}),
        metadata=lambda m: m.update(changed=str(int(m["changed"]) - json.loads(m["tensors"])[NAME]["count"] + 2)),
    )
    assert_refused(data, state, "out of range")


@pytest.mark.parametrize("codec", ["classgap", "gapzz"])
@pytest.mark.parametrize("part", ["pos", "val"])
@pytest.mark.parametrize(
    "tail, match",
    [
        (lambda blob: blob + b"junk", "4 bytes after the zstd frame"),
        (lambda blob: blob + blob, "bytes after the zstd frame"),
        (lambda blob: blob + zstandard.ZstdCompressor().compress(b""), "bytes after the zstd frame"),
        (lambda blob: blob[:-1], "corrupt zstd data"),
    ],
    ids=["trailing_bytes", "second_frame", "empty_second_frame", "truncated"],
)
def test_stream_is_exactly_one_zstd_frame(state, codec: str, part: str, tail, match: str) -> None:
    """Bytes after the frame, a second frame, or a cut frame are refused (not silently ignored)."""
    key = f"{NAME}.{part}"

    def edit(entries):
        entries[key] = torch.frombuffer(bytearray(tail(entries[key].numpy().tobytes())), dtype=torch.uint8)

    assert_refused(rewrite(make_delta(state, codec), entries=edit), state, match)


@pytest.mark.parametrize("codec", ["classgap", "classrice"])  # classrice checks the value streams in its kernel
def test_sign_entry_checked(state, codec: str) -> None:
    """A sign entry of the wrong length or with padding bits set after the last sign is refused."""
    key = NAME + ".sign"
    data = make_delta(state, codec)
    count = json.loads(parse_header(data)[1]["tensors"])[NAME]["count"]
    assert count % 8, "the padding test needs a count that leaves padding bits"
    longer = rewrite(data, entries=lambda e: e.update({key: torch.cat([e[key], torch.zeros(1, dtype=torch.uint8)])}))
    assert_refused(longer, state, f"expected {(count + 7) // 8} elements")
    padded = rewrite(data, entries=lambda e: e[key].__setitem__(-1, e[key][-1] | 0x80))
    assert_refused(padded, state, "padding bits after the last sign are set")


@pytest.mark.parametrize("codec_name", ["classgap", "classrice"])
@pytest.mark.parametrize("at", [0, -1])
def test_magnitude_beyond_the_signed_range_refused(state, codec_name: str, at: int) -> None:
    """A magnitude with the top bit set would wrap to a zero or repeated difference: refused (the first or the last)."""
    codec = get_codec(codec_name)
    data = make_delta(state, codec_name)
    info = json.loads(parse_header(data)[1]["tensors"])[NAME]
    assert info.get("order", "exponent") == "exponent"
    count = info["count"]
    planes = np.zeros(2 * count, dtype=np.uint8)
    planes[count:][at] = 0x80  # high byte of the first or the last magnitude
    assert_refused(rewrite(data, entries=lambda e: e.update({NAME + ".val": codec._compress(planes)})), state, "does not fit")


def test_gpu_sync_benchmark_logic_on_cpu(capsys) -> None:
    """benchmarks.gpu_sync with the device as a parameter: every codec round-trips bit-exactly into the state and the engine."""
    from benchmarks import gpu_sync

    gpu_sync.main(["--device", "cpu", "--layers", "1", "--hidden", "128", "--vocab", "512", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "% of elements changed" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gapzz"], ["classgap"])]
    sizes = {row[0]: float(row[1]) for row in rows}
    assert set(sizes) == {"gapzz", "classgap"} and sizes["classgap"] < sizes["gapzz"]
    assert "transformers engine: generation paused" in out


def test_every_truncation_refused(state) -> None:
    """test_format_hostile's check for classgap: every proper prefix raises FormatError and writes nothing."""
    every_truncation_refused(state, "classgap")


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipped_bytes_never_escape(state, mask: int) -> None:
    """test_format_hostile's check for classgap: any flipped byte is refused or yields in-range patches that miss the promised hash."""
    flipped_bytes_never_escape(state, "classgap", mask)
