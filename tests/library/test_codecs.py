"""Bit-exact round trips through ChangeDetector.diff -> encode_delta -> decode_delta -> TensorPatch.apply_.

Every codec (``classgap``, ``classrice`` and ``gapzz``, ours; ``trl``, the baseline) is exercised on every dtype the
format supports, on 0-d, empty, 1-D and N-D tensors, with special values (NaN
payloads, infinities, -0.0, subnormals) and densities from 0% to 100%. Results are
compared with :func:`rlsync.hashing.state_hash`, never with tolerances. Index
handling beyond 2**31 elements is unit-tested on the codecs directly with small
index arrays, and the size of ``gapzz`` deltas is bounded on RL-like data.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlsync.codecs import DecodeTarget, get_codec, list_codecs
from rlsync.detect import ChangeDetector
from rlsync.dtypes import bits_to_numpy, int_view, uint_dtype
from rlsync.errors import FormatError
from rlsync.delta_format import Change, decode_delta, encode_delta
from rlsync.format import parse_header
from rlsync.hashing import state_hash

CODECS = ["classgap", "classrice", "gapzz", "trl"]

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]

# Bit patterns of special values per float dtype: zero, -zero, +inf, -inf (None where the
# dtype has none), three NaNs with different payloads/signs, two subnormals, one.
SPECIALS: dict[torch.dtype, dict[str, int | None]] = {
    torch.float16: dict(zero=0x0000, negzero=0x8000, inf=0x7C00, ninf=0xFC00, nan_a=0x7E00, nan_b=0x7C01, nan_c=0xFE55, sub_a=0x0001, sub_b=0x03FF, one=0x3C00),
    torch.bfloat16: dict(zero=0x0000, negzero=0x8000, inf=0x7F80, ninf=0xFF80, nan_a=0x7FC0, nan_b=0x7F81, nan_c=0xFFC5, sub_a=0x0001, sub_b=0x007F, one=0x3F80),
    torch.float32: dict(zero=0, negzero=0x80000000, inf=0x7F800000, ninf=0xFF800000, nan_a=0x7FC00000, nan_b=0x7F800001, nan_c=0xFFC01234, sub_a=0x00000001, sub_b=0x007FFFFF, one=0x3F800000),
    torch.float64: dict(zero=0, negzero=1 << 63, inf=0x7FF0 << 48, ninf=0xFFF0 << 48, nan_a=0x7FF8 << 48, nan_b=(0x7FF0 << 48) | 1, nan_c=(0xFFF8 << 48) | 0xBEEF, sub_a=1, sub_b=(1 << 52) - 1, one=0x3FF0 << 48),
    torch.float8_e4m3fn: dict(zero=0x00, negzero=0x80, inf=None, ninf=None, nan_a=0x7F, nan_b=0xFF, nan_c=0x7F, sub_a=0x01, sub_b=0x07, one=0x38),
    torch.float8_e5m2: dict(zero=0x00, negzero=0x80, inf=0x7C, ninf=0xFC, nan_a=0x7D, nan_b=0x7E, nan_c=0xFF, sub_a=0x01, sub_b=0x03, one=0x3C),
}

HYPOTHESIS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples and seed: tests/conftest.py


# ---------------------------------------------------------------------------
# helpers


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` holding the given unsigned bit patterns."""
    signed = np.ascontiguousarray(bits.astype(uint_dtype(itemsize(dtype)))).view(np.dtype(f"int{8 * itemsize(dtype)}"))
    flat = torch.from_numpy(signed.copy())
    flat = flat.view(torch.bool) if dtype == torch.bool else flat.view(dtype)
    return flat.reshape(shape)


def bits_of(tensor: torch.Tensor) -> np.ndarray:
    return bits_to_numpy(int_view(tensor.contiguous()))


def random_bits(rng: np.random.Generator, dtype: torch.dtype, numel: int) -> np.ndarray:
    """Random bit patterns: every pattern of the width (NaNs, infs, subnormals included); bools are 0/1."""
    if dtype == torch.bool:
        return rng.integers(0, 2, size=numel, dtype=np.uint8)
    size = itemsize(dtype)
    return rng.integers(0, 256, size=numel * size, dtype=np.uint8).view(uint_dtype(size))


def changed_count(density: str, numel: int) -> int:
    return {"zero": 0, "tiny": min(1, numel), "one_percent": max(1, numel // 100) if numel else 0, "half": numel // 2, "all": numel}[density]


def mutate(rng: np.random.Generator, old: torch.Tensor, count: int, specials: bool) -> torch.Tensor:
    """A copy of ``old`` with ``count`` random elements given different bits (some special values if asked)."""
    old_bits = bits_of(old)
    new_bits = old_bits.copy()
    where = np.sort(rng.choice(old.numel(), size=count, replace=False)) if count else np.zeros(0, dtype=np.int64)
    if old.dtype == torch.bool:
        new_bits[where] ^= np.uint8(1)
    else:
        mask = random_bits(rng, old.dtype, count)
        mask[mask == 0] = 1
        new_bits[where] ^= mask
        if specials and old.dtype in SPECIALS and count:
            pool = np.array([v for v in SPECIALS[old.dtype].values() if v is not None], dtype=uint_dtype(itemsize(old.dtype)))
            pick = where[rng.random(count) < 0.5]
            new_bits[pick] = rng.choice(pool, size=pick.size)
    return from_bits(new_bits, old.dtype, tuple(old.shape))


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state.items()}


def total_elements(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state.values())


def publish_and_follow(
    new: dict[str, torch.Tensor],
    replica: dict[str, torch.Tensor],
    codec: str,
    detector: ChangeDetector,
    expected: dict[str, torch.Tensor] | None = None,
) -> tuple[dict, bytes]:
    """Diff ``new`` against the detector's published state, ship a delta, apply it to ``replica``.

    Returns the detector's changes and the delta's bytes; asserts the replica ends up
    bit-identical (by hash) to ``expected`` (default ``new``) and that decoding alone
    left the replica untouched.
    """
    expected = new if expected is None else expected
    base_hash = state_hash(replica)
    changes = detector.diff(new)
    data = encode_delta(
        changes, step=1, base_step=0, base_hash=base_hash, state_hash=state_hash(expected), total=total_elements(new), codec=codec
    )
    delta = decode_delta(data, replica)
    assert state_hash(replica) == base_hash, "decode_delta wrote into the state"
    assert set(delta.patches) == set(changes)
    for name, patch in delta.patches.items():
        patch.apply_(replica[name])
    assert state_hash(replica) == state_hash(expected)
    assert state_hash(replica) == delta.state_hash
    return changes, data


# ---------------------------------------------------------------------------
# property tests


def test_both_codecs_are_registered() -> None:
    assert set(CODECS) <= set(list_codecs())
    for name in CODECS:
        assert get_codec(name).name == name


def test_state_hash_sees_every_bit_dtype_shape_and_name() -> None:
    """The comparisons below are only as strict as state_hash: it must tell apart what float equality does not."""
    base = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)}
    variants = [
        {"w": torch.tensor([-0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)},  # -0.0 == 0.0 as floats
        {"w": from_bits(bits_of(base["w"]) ^ np.array([0, 0, 1, 0], dtype=np.uint16), torch.bfloat16, (4,))},  # NaN payload
        {"w": base["w"].reshape(2, 2)},
        {"w": base["w"].view(torch.float16)},
        {"w": base["w"].view(torch.int16)},
        {"v": base["w"]},
        {"w": base["w"], "x": torch.zeros(0)},
    ]
    hashes = {state_hash(base)} | {state_hash(v) for v in variants}
    assert len(hashes) == len(variants) + 1
    assert state_hash(base) == state_hash({"w": base["w"].clone()})


SHAPES = st.one_of(
    st.just(()),  # 0-d scalar
    st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(lambda s: 0 in s),  # empty tensors
    st.lists(st.integers(1, 300), min_size=1, max_size=1),  # 1-D
    st.lists(st.integers(1, 9), min_size=2, max_size=4),  # N-D
)


@pytest.mark.parametrize("codec", CODECS)
@HYPOTHESIS
@given(
    dtype=st.sampled_from(DTYPES),
    shape=SHAPES,
    density=st.sampled_from(["zero", "tiny", "one_percent", "half", "all"]),
    specials=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_single_tensor(codec: str, dtype: torch.dtype, shape: list[int], density: str, specials: bool, seed: int) -> None:
    """Any dtype, shape and density round-trips bit-exactly; the detector finds exactly the changed bits."""
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    numel = int(np.prod(shape, dtype=np.int64))
    old = from_bits(random_bits(rng, dtype, numel), dtype, shape)
    new = mutate(rng, old, changed_count(density, numel), specials)
    want = np.flatnonzero(bits_of(old) != bits_of(new))

    detector = ChangeDetector(dtype=None)
    detector.reset({"w": old})
    replica = {"w": old.clone()}
    changes, data = publish_and_follow({"w": new}, replica, codec, detector)

    if want.size:
        np.testing.assert_array_equal(changes["w"].index, want)
        assert changes["w"].dtype == dtype and changes["w"].shape == shape
    else:
        assert changes == {}
    _, metadata = parse_header(data)
    assert int(metadata["changed"]) == want.size
    assert int(metadata["total"]) == numel
    assert metadata["codec"] == codec


@pytest.mark.parametrize("codec", CODECS)
@HYPOTHESIS
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=2, max_size=5),
    which=st.lists(st.booleans(), min_size=5, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_state_only_changed_tensors_shipped(codec: str, dtypes: list[torch.dtype], which: list[bool], seed: int) -> None:
    """Several tensors per state, some changed: only the changed ones appear in the file."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i, dtype in enumerate(dtypes):
        shape = tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        numel = int(np.prod(shape))
        old[f"layers.{i}.weight"] = from_bits(random_bits(rng, dtype, numel), dtype, shape)
        count = int(rng.integers(1, numel + 1)) if which[i] else 0
        new[f"layers.{i}.weight"] = mutate(rng, old[f"layers.{i}.weight"], count, specials=True)
    changed_names = {n for n in old if not np.array_equal(bits_of(old[n]), bits_of(new[n]))}

    detector = ChangeDetector(dtype=None)
    detector.reset(old)
    changes, data = publish_and_follow(new, clone_state(old), codec, detector)

    assert set(changes) == changed_names
    header, metadata = parse_header(data)
    entry_owners = {key.rsplit(".", 1)[0] for key in header}
    assert entry_owners == changed_names
    assert set(json.loads(metadata["tensors"])) == changed_names
    want_changed = sum(int((bits_of(old[n]) != bits_of(new[n])).sum()) for n in old)
    assert int(metadata["changed"]) == want_changed


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_special_values_compare_by_bits(codec: str, dtype: torch.dtype) -> None:
    """-0.0 vs 0.0 and NaN payload changes count as changes; an identical NaN does not; all round-trip exactly."""
    s = SPECIALS[dtype]
    pairs = [
        ("zero", "negzero"),
        ("negzero", "zero"),
        ("nan_a", "nan_b"),
        ("nan_b", "nan_c"),
        ("sub_a", "sub_b"),
        ("one", "nan_a"),
        ("sub_b", "negzero"),
        ("nan_a", "nan_a"),  # unchanged NaN: not a change
        ("negzero", "negzero"),
        ("sub_a", "sub_a"),
    ]
    if s["inf"] is not None:
        pairs += [("inf", "ninf"), ("ninf", "nan_a"), ("inf", "inf")]
    pairs = [(a, b) for a, b in pairs if s[a] != s[b] or a == b]
    old_bits = np.array([s[a] for a, _ in pairs], dtype=uint_dtype(itemsize(dtype)))
    new_bits = np.array([s[b] for _, b in pairs], dtype=uint_dtype(itemsize(dtype)))
    old = from_bits(old_bits, dtype, (len(pairs),))
    new = from_bits(new_bits, dtype, (len(pairs),))

    detector = ChangeDetector(dtype=None)
    detector.reset({"w": old})
    replica = {"w": old.clone()}
    changes, _ = publish_and_follow({"w": new}, replica, codec, detector)

    np.testing.assert_array_equal(changes["w"].index, np.flatnonzero(old_bits != new_bits))
    assert 0 in changes["w"].index  # 0.0 -> -0.0 is a change
    np.testing.assert_array_equal(bits_of(replica["w"]), new_bits)


@pytest.mark.parametrize("codec", CODECS)
@HYPOTHESIS
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=3),
    chunk=st.integers(1, 64),
    scales=st.lists(st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 1.0]), min_size=1, max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_serving_cast_fp32_master_to_bf16_chunked(codec: str, sizes: list[int], chunk: int, scales: list[float], seed: int) -> None:
    """fp32 master weights published as bf16, compared chunk by chunk: replicas follow the bf16 cast exactly.

    Several publish rounds with commit exercise accumulation of sub-ulp updates in the master.
    """
    gen = torch.Generator().manual_seed(seed)
    master: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        shape = (n,) if i % 2 == 0 else (max(n // 7, 0), 7)
        master[f"w{i}"] = torch.randn(shape, generator=gen) * 0.02
    if master["w0"].numel():
        master["w0"].view(-1)[0] = -0.0  # a -0.0 in the master
    master["step_counter"] = torch.tensor([3, 4], dtype=torch.int64)  # not floating point: never cast
    detector = ChangeDetector(dtype=torch.bfloat16, chunk_elements=chunk)
    reference = ChangeDetector(dtype=torch.bfloat16)
    detector.reset(master)
    reference.reset(master)
    serving = lambda: {n: (t.to(torch.bfloat16) if t.is_floating_point() else t.clone()) for n, t in master.items()}  # noqa: E731
    replica = serving()
    assert replica["step_counter"].dtype == torch.int64

    for round_, scale in enumerate(scales):
        for t in master.values():
            if t.is_floating_point() and t.numel():
                pick = torch.rand(t.shape, generator=gen) < 0.3
                t.add_(torch.randn(t.shape, generator=gen) * scale * pick)
        master["step_counter"][0] += round_ % 2
        expected = serving()
        chunked = detector.diff(master)
        whole = reference.diff(master)
        assert set(chunked) == set(whole)
        for name in whole:  # chunk boundaries must not change what is found
            np.testing.assert_array_equal(chunked[name].index, whole[name].index)
            np.testing.assert_array_equal(chunked[name].new_bits, whole[name].new_bits)
            np.testing.assert_array_equal(chunked[name].old_bits, whole[name].old_bits)
        changes, _ = publish_and_follow(master, replica, codec, detector, expected=expected)
        detector.commit(changes)
        reference.commit(whole)
        assert state_hash(detector.published) == state_hash(expected)


# ---------------------------------------------------------------------------
# tensors over 2**31 elements (index handling tested without allocating them)


def _old_bits_lookup(index: np.ndarray, old_bits: np.ndarray):
    def lookup(idx: np.ndarray) -> np.ndarray:
        np.testing.assert_array_equal(idx, index)  # the decoder asks for exactly the decoded positions
        return old_bits

    return lookup


def _decode(codec_name: str, name: str, encoded, index, old_bits, *, numel: int, itemsize_: int, params=None):
    codec = get_codec(codec_name)
    target = DecodeTarget(count=index.size, numel=numel, itemsize=itemsize_, bits_at=_old_bits_lookup(index, old_bits))
    return codec.decode(name, encoded.entries, encoded.params if params is None else params, target)


@pytest.mark.parametrize(
    "index, gap_bytes",
    [
        ([0, 255, 511], 1),
        ([3, 70_000], 4),  # gap 69_996 needs 3 bytes -> 4
        ([5, 2**31 + 10, 2**32 + 11], 4),  # gaps just under 2**32
        ([0, 2**31 - 1, 2**31, 2**33 + 3], 8),  # a gap over 2**32
        ([2**40 + 1], 8),
        ([7, 300], 2),
    ],
)
def test_gapzz_index_widths_beyond_2_31(index: list[int], gap_bytes: int) -> None:
    """gapzz gap widths of 1, 2, 4 and 8 bytes decode int64 positions beyond 2**31 exactly."""
    idx = np.array(index, dtype=np.int64)
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, size=idx.size, dtype=np.uint16)
    new = old + np.uint16(1)
    new[-1] = old[-1] - np.uint16(3)  # a negative difference, wrapping
    encoded = get_codec("gapzz").encode("w", idx, old, new)
    assert encoded.params["gap_bytes"] == gap_bytes
    numel = int(idx[-1]) + 1
    got_index, got_bits, _ = _decode("gapzz", "w", encoded, idx, old, numel=numel, itemsize_=2)
    assert got_index.dtype == np.int64
    np.testing.assert_array_equal(got_index, idx)
    np.testing.assert_array_equal(got_bits, new)
    with pytest.raises(FormatError, match="out of range"):
        _decode("gapzz", "w", encoded, idx, old, numel=numel - 1, itemsize_=2)


def test_gapzz_refuses_gap_that_wraps_int64() -> None:
    """An 8-byte gap of 2**64 - 1 would wrap to a duplicate position: refused, even for huge tensors."""
    encoded = get_codec("gapzz").encode("w", np.array([0, 1], dtype=np.int64), np.zeros(2, np.uint16), np.ones(2, np.uint16))
    gaps = np.array([0, 2**64 - 1], dtype=np.uint64)
    planes = np.ascontiguousarray(gaps.view(np.uint8).reshape(-1, 8).T).reshape(-1)
    encoded.entries["w.pos"] = get_codec("gapzz")._compress(planes)
    with pytest.raises(FormatError, match="out of range"):
        get_codec("gapzz").decode(
            "w", encoded.entries, {"gap_bytes": 8},
            DecodeTarget(count=2, numel=2**62, itemsize=2, bits_at=lambda i: np.zeros(i.size, np.uint16)),
        )  # fmt: skip


@pytest.mark.parametrize(
    "index, wide",
    [([0, 5, 2**31 - 1], False), ([0, 2**31], True), ([1, 2**31 + 7, 3 * 2**31 + 1], True), ([2**40], True)],
)
def test_trl_switches_to_int64_indices_beyond_2_31(index: list[int], wide: bool) -> None:
    """trl stores int32 indices while they fit and int64 beyond, and decodes both exactly."""
    idx = np.array(index, dtype=np.int64)
    old = np.zeros(idx.size, dtype=np.uint16)
    new = np.arange(1, idx.size + 1, dtype=np.uint16)
    encoded = get_codec("trl").encode("w", idx, old, new)
    assert encoded.entries["w.indices"].dtype == (torch.int64 if wide else torch.int32)
    got_index, got_bits, _ = _decode("trl", "w", encoded, idx, old, numel=int(idx[-1]) + 1, itemsize_=2)
    assert got_index.dtype == np.int64
    np.testing.assert_array_equal(got_index, idx)
    np.testing.assert_array_equal(got_bits, new)
    with pytest.raises(FormatError, match="out of range"):
        _decode("trl", "w", encoded, idx, old, numel=int(idx[-1]), itemsize_=2)


@pytest.mark.parametrize("codec", CODECS)
def test_delta_for_tensor_over_2_31_elements_through_the_format(codec: str) -> None:
    """encode_delta/decode_delta address positions past 2**31 of a (stride-0, unallocated) 2**31 + 9 element tensor."""
    numel = 2**31 + 9
    base = torch.full((1,), 1.5, dtype=torch.bfloat16).expand(numel)  # 2 bytes of storage
    index = np.array([1, 2**31 - 1, 2**31 + 3, numel - 1], dtype=np.int64)
    old_bits = np.full(index.size, bits_of(base[:1])[0], dtype=np.uint16)
    new_bits = old_bits + np.arange(1, index.size + 1, dtype=np.uint16)
    change = Change(index=index, old_bits=old_bits, new_bits=new_bits, dtype=torch.bfloat16, shape=(numel,))
    data = encode_delta({"big": change}, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=numel, codec=codec)
    assert len(data) < 4096
    delta = decode_delta(data, {"big": base})
    patch = delta.patches["big"]
    assert patch.index.dtype == torch.int64
    np.testing.assert_array_equal(patch.index.numpy(), index)
    np.testing.assert_array_equal(bits_of(patch.values), new_bits)
    assert patch.shape == (numel,)


# ---------------------------------------------------------------------------
# size bounds on RL-like data


RL_SHAPES = {"model.layers.0.mlp.up_proj.weight": (1024, 2048), "model.layers.0.mlp.down_proj.weight": (2048, 1024)}
RL_STEPS = 3


def _rl_deltas() -> list[tuple[float, dict[str, int], dict[str, torch.Tensor], dict]]:
    """Publish after each of a few AdamW steps (lr 1e-6, seeded random grads) of fp32 masters of bf16 weights."""
    gen = torch.Generator().manual_seed(1234)
    params = {n: torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16).float()) for n, s in RL_SHAPES.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-6)
    detector = ChangeDetector(dtype=torch.bfloat16)
    master = {n: p.data for n, p in params.items()}
    detector.reset(master)
    total = total_elements(master)
    out = []
    for _ in range(RL_STEPS):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        changes = detector.diff(master)
        changed = sum(c.index.size for c in changes.values())
        sizes = {
            c: len(encode_delta(changes, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=total, codec=c)) for c in CODECS
        }
        base = {n: t.clone() for n, t in detector.published.items()}
        out.append((changed / total, sizes, base, changes))
        detector.commit(changes)
    return out


def test_gapzz_size_bounds_on_rl_like_updates() -> None:
    """At 0.5-3% density gapzz uses <= 1.5 bytes per changed element (whole file) and is >= 4x smaller than trl."""
    for density, sizes, base, changes in _rl_deltas():
        assert 0.005 <= density <= 0.03, f"synthetic data drifted: density {density:.4f}"
        changed = sum(c.index.size for c in changes.values())
        assert sizes["gapzz"] / changed <= 1.5, f"gapzz: {sizes['gapzz'] / changed:.3f} bytes per changed element"
        assert sizes["trl"] / sizes["gapzz"] >= 4.0, f"gapzz only {sizes['trl'] / sizes['gapzz']:.2f}x smaller than trl"
    # the measured file decodes to the published state (sizes of a lossy file would mean nothing)
    expected = {n: t.clone() for n, t in base.items()}
    for name, ch in changes.items():
        int_view(expected[name])[torch.from_numpy(ch.index)] = torch.from_numpy(ch.new_bits.view(np.int16))
    data = encode_delta(
        changes, step=1, base_step=0, base_hash=state_hash(base), state_hash=state_hash(expected), total=total_elements(base), codec="gapzz"
    )
    assert len(data) == sizes["gapzz"]
    for name, patch in decode_delta(data, base).patches.items():
        patch.apply_(base[name])
    assert state_hash(base) == state_hash(expected)
