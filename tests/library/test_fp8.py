"""FP8 replicas of a bf16 trainer (``rlsync.fp8``): the trainer publishes, beside its bf16 chain, a
block-FP8 chain quantized from each bf16 version; a replica following it holds the trainer's own
quantization bit for bit after several deltas (weights and scales hash equal) and serves the
dequantized weights; a hostile FP8 object (a scale non-finite, zero or out of range, a NaN byte) is
refused before anything is applied."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

from rlsync.bucket import LocalBucket
from rlsync.fp8 import (
    AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX, MAX_SCALE, MIN_SCALE, SCALE_SUFFIX, Fp8Metadata, chain_metadata,
    dequantize_block, dequantize_state, fp8_bucket, fp8_publisher, fp8_subscriber, is_quantized,
    quantization_config, quantize_block, quantize_state,
)  # fmt: skip
from rlsync.errors import ChainError, FormatError
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.spaces.tiny_model import build_tiny_model
from tests.helpers import sparse_rl_step

DELTAS = 4


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe written block by block, independently of the vectorised one."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scale = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    for i, j in itertools.product(range(scale.shape[0]), range(scale.shape[1])):
        block = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]].float()
        amax = torch.clamp(block.abs().max(), min=AMAX_FLOOR)
        q[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (block * (FP8_MAX / amax)).to(FP8_DTYPE)
        scale[i, j] = amax / FP8_MAX
    return q, scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("shape", [(384, 128), (300, 200), (64, 128), (128, 1)])
def test_block_quantization_is_the_recipe_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    w[: min(128, shape[0]), : min(128, shape[1])] *= 50  # one block of large values, saturating nothing
    if shape[0] > 128:
        w[128:256] = 0  # an all-zero block row: the floor scale, zero bytes
    q, scale = quantize_block(w)
    ref_q, ref_scale = reference_quantize(w)
    assert same_bits(q, ref_q) and same_bits(scale, ref_scale)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and scale.dtype == torch.float32
    assert bool(((scale >= MIN_SCALE) & (scale <= MAX_SCALE)).all())
    if shape[0] > 128:
        assert float(scale[1].min()) == MIN_SCALE and not q[128:256].view(torch.uint8).any()
    # within e4m3's precision of the bf16 weights (3 mantissa bits: relative error at most 1/16 of a value)
    err = (dequantize_block(q, scale, torch.float32) - w.float()).abs()
    assert bool((err <= w.float().abs() / 16 + scale.max() * 2**-9).all())
    again = quantize_block(w.clone())
    assert same_bits(again[0], q) and same_bits(again[1], scale)


def test_layers_follow_vllms_fp8_checkpoints_and_are_recorded(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=0)
    state = load_file(str(path / "model.safetensors"))
    quantized = quantize_state(state)
    weights = {n for n in state if is_quantized(n, tuple(state[n].shape))}
    assert weights and all(n.rsplit(".", 2)[-2].endswith("_proj") for n in weights)
    assert not any(k in n for n in weights for k in ("embed_tokens", "norm", "lm_head"))
    assert all(quantized[n].dtype == FP8_DTYPE and quantized[n[: -len("weight")] + SCALE_SUFFIX].dtype == torch.float32 for n in weights)
    assert all(same_bits(quantized[n], state[n]) for n in state if n not in weights)  # the rest: the bf16 bits
    config = quantization_config(quantized)
    assert config["weight_block_size"] == list(BLOCK) and config["quant_method"] == "fp8"
    assert set(config["modules_to_not_convert"]) == {"lm_head", "model.embed_tokens"}
    assert is_quantized("model.layers.0.mlp.experts.3.down_proj.weight", (128, 128))
    assert not is_quantized("model.layers.0.mlp.gate.weight", (8, 128))  # a MoE router stays bf16
    meta = chain_metadata()
    assert meta[Fp8Metadata.SCHEME.value] and '"q_proj"' in meta[Fp8Metadata.FORMAT.value]


@pytest.fixture(scope="module")
def tiny_state(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    return path, {n: t.float() for n, t in load_file(str(path / "model.safetensors")).items()}


def test_fp8_replica_of_a_bf16_trainer_is_bit_exact_with_its_quantization(tiny_state, tmp_path):
    from rollout_space.engines.transformers_engine import TransformersEngine
    from rlsync.trl import BucketWeightTransfer

    path, master = tiny_state
    master = {n: t.clone() for n, t in master.items()}
    bucket = LocalBucket(tmp_path / "bucket")
    transfer = BucketWeightTransfer(
        publisher=Publisher(bucket, policy=FixedInterval(100)), fp8=fp8_publisher(bucket, policy=FixedInterval(100))
    )
    replica = fp8_subscriber(bucket)
    engine = TransformersEngine(path)
    bf16_replica = Subscriber(bucket)
    kinds = []
    for version in range(DELTAS + 1):
        if version:
            sparse_rl_step(master, 500 + version)
        transfer.send_weights(iter(master.items()))  # the trainer: one bf16 version, and its FP8 version
        bf16 = {n: t.to(torch.bfloat16) for n, t in master.items()}
        applied = replica.sync()
        kinds += [u.kind for u in applied]
        expected = quantize_state(bf16)  # the trainer's own quantization of this version
        assert replica.step == version and replica.state_hash == state_hash(expected) == state_hash(replica.state)
        assert replica.state.keys() == expected.keys() and all(same_bits(replica.state[n], expected[n]) for n in expected)
        engine.load_state(dequantize_state(replica.state))  # served: the dequantized FP8 weights
        served = engine.state_dict()
        assert all(same_bits(served[n], t) for n, t in dequantize_state(expected).items())
        bf16_replica.sync()
        assert bf16_replica.state_hash == state_hash(bf16)  # the bf16 chain beside it is unchanged
    assert kinds == ["anchor"] + ["delta"] * DELTAS
    assert all(0 < r.changed < r.total for r in transfer.fp8_records[1:])  # deltas: changed FP8 bytes and scales only
    assert {n for n in replica.state if n.endswith(SCALE_SUFFIX)} and read_metadata(bucket)[Fp8Metadata.SCHEME.value]


def read_metadata(bucket) -> dict:
    from rlsync.protocol import read_manifest

    return dict(read_manifest(fp8_bucket(bucket)).metadata)


def hostile_chain(bucket, state: dict[str, torch.Tensor], name: str, value) -> dict[str, torch.Tensor]:
    """A publisher that writes whatever it is given (as an attacker with write access would): version 0 the
    trainer's quantization, version 1 the same with ``value`` at one element of ``name``; its hashes consistent."""
    pub = Publisher(fp8_bucket(bucket), dtype=None, metadata=chain_metadata(), policy=FixedInterval(100), allow_non_finite=True)
    pub.publish(0, state)
    bad = {n: t.clone() for n, t in state.items()}
    flat = bad[name].reshape(-1)
    flat[1] = value if not isinstance(value, int) else torch.tensor([value], dtype=torch.uint8).view(FP8_DTYPE)[0]
    pub.publish(1, bad)
    return bad


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), 0.0, -MIN_SCALE, MIN_SCALE / 2, MAX_SCALE * 4, 0x7F],
    ids=["nan", "inf", "zero", "negative", "below", "above", "nan-byte"],
)
def test_a_hostile_fp8_delta_is_refused_before_it_is_applied(tiny_state, tmp_path, value):
    _, master = tiny_state
    state = quantize_state(master)
    weight = "model.layers.0.mlp.down_proj.weight"
    name = weight if isinstance(value, int) else weight[: -len("weight")] + SCALE_SUFFIX
    bucket = LocalBucket(tmp_path)
    hostile_chain(bucket, state, name, value)
    replica = fp8_subscriber(bucket)
    replica.apply(replica.fetch())  # version 0 is good
    before = {n: t.clone() for n, t in replica.state.items()}
    with pytest.raises(FormatError, match="refused before applying"):
        replica.fetch()
    assert replica.step == 0 and replica.stats.refused == 1 and replica.needs_resync
    assert all(same_bits(before[n], replica.state[n]) for n in before)
    plain = Subscriber(fp8_bucket(bucket))  # without the checks the same delta would have been applied
    plain.sync()
    assert plain.step == 1


def test_a_hostile_fp8_anchor_and_another_scheme_are_refused(tiny_state, tmp_path):
    _, master = tiny_state
    state = quantize_state(master)
    scale = "model.layers.1.self_attn.q_proj." + SCALE_SUFFIX
    bad = {n: t.clone() for n, t in state.items()}
    bad[scale].reshape(-1)[0] = 0.0
    bucket = LocalBucket(tmp_path / "a")
    Publisher(fp8_bucket(bucket), dtype=None, metadata=chain_metadata(), policy=FixedInterval(100)).publish(0, bad)
    replica = fp8_subscriber(bucket)
    with pytest.raises(FormatError, match="scale"):
        replica.fetch()
    assert replica.step is None and replica.stats.refused == 1
    other = LocalBucket(tmp_path / "b")
    meta = {**chain_metadata(), Fp8Metadata.SCHEME.value: "another-scheme"}
    Publisher(fp8_bucket(other), dtype=None, metadata=meta).publish(0, state)
    with pytest.raises(ChainError, match="metadata"):
        fp8_subscriber(other).fetch()
