"""Replicas serve adapter versions bit-exactly: the transformers engine through peft, and the
:class:`AdapterFollower` that feeds it from the bucket's adapter chain (hash check before
serving, a new adapter per version, versions out of the staleness window dropped)."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

pytest.importorskip("peft")

from peft import get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rlsync.adapters import AdapterChain, LoraSpec, adapter_publisher  # noqa: E402
from rlsync.hashing import state_hash  # noqa: E402
from rlsync.lora import peft_config  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher, Subscriber  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from rollout_space.adapters import AdapterFollower  # noqa: E402
from rollout_space.engine import SamplingSettings  # noqa: E402
from rollout_space.engines.transformers_engine import TransformersEngine  # noqa: E402

LORA = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "down_proj"))
PROMPTS = ["reverse 12345 =", "add 12 + 34 ="]


def greedy(adapter: int | None = None) -> SamplingSettings:
    return SamplingSettings(n=1, max_new_tokens=8, temperature=0.0, adapter=adapter)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def trained_adapter(model_dir, seed: int) -> dict[str, torch.Tensor]:
    """A peft adapter whose B is not zero (as after training), in bf16 under peft's saved names."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), peft_config(LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return {n: t.to(torch.bfloat16) for n, t in get_peft_model_state_dict(model).items()}


@functools.lru_cache(maxsize=1)
def _reference_model(model_dir: str):
    """An independent bf16 peft model of ``model_dir`` (built once; each reference loads its adapter into it)."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), peft_config(LORA), autocast_adapter_dtype=False
    )
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def peft_reference(model_dir, tensors) -> list[list[int]]:
    """Greedy tokens of an independent peft model (bf16) holding ``tensors``."""
    from peft import set_peft_model_state_dict

    model, tok = _reference_model(str(model_dir))
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out.append(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist())
    return out


#: Another engine's kernels (vLLM's LoRA on CPU) round differently from peft's: where peft's two best
#: logits are closer than this, either token is the adapter's greedy choice.
NEAR_TIE_LOGITS = 0.25


def greedy_under_peft(model_dir, tensors, served: list[list[int]]) -> bool:
    """Whether each of ``served``'s tokens (one list per prompt) is the greedy choice of peft holding
    ``tensors``, given the tokens before it: peft's best, or within :data:`NEAR_TIE_LOGITS` of it."""
    from peft import set_peft_model_state_dict

    model, tok = _reference_model(str(model_dir))
    assert not set_peft_model_state_dict(model, tensors).unexpected_keys
    for prompt, got in zip(PROMPTS, served, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"][0].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1].float()
        best = logits.max(dim=-1).values
        if not bool((best - logits[torch.arange(len(got)), torch.tensor(got)] <= NEAR_TIE_LOGITS).all()):
            return False
    return True


def tokens(engine, sampling) -> list[list[int]]:
    """Greedy tokens per prompt, one prompt at a time (as the reference: no padding in the batch)."""
    return [engine.generate([prompt], sampling)[0][0].token_ids for prompt in PROMPTS]


def test_transformers_engine_serves_each_adapter_version_bit_exactly(model_dir):
    engine = TransformersEngine(model_dir)
    base = tokens(engine, greedy())
    first, second = trained_adapter(model_dir, 1), trained_adapter(model_dir, 2)
    chain = AdapterChain("tiny", "b" * 64, LORA)
    assert engine.load_adapter(3, first, chain) == state_hash(first)
    assert engine.load_adapter(4, second, chain) == state_hash(second)
    assert state_hash(engine.adapter_state(3)) == state_hash(first)  # the served tensors, byte for byte
    assert tokens(engine, greedy(3)) == peft_reference(model_dir, first)
    assert tokens(engine, greedy(4)) == peft_reference(model_dir, second) != tokens(engine, greedy(3))
    assert tokens(engine, greedy()) == base  # no adapter: the base model
    assert state_hash(engine.state_dict()) == state_hash(TransformersEngine(model_dir).state_dict())  # base untouched
    engine.drop_adapter(3)
    with pytest.raises(KeyError):
        engine.generate(PROMPTS, greedy(3))
    assert tokens(engine, greedy(4)) == peft_reference(model_dir, second)


def test_transformers_engine_refuses_tensors_of_another_adapter(model_dir):
    engine = TransformersEngine(model_dir)
    tensors = trained_adapter(model_dir, 1)
    renamed = {n.replace("q_proj", "k_proj"): t for n, t in tensors.items()}
    with pytest.raises(ValueError, match="do not match"):
        engine.load_adapter(0, renamed, AdapterChain("tiny", "b" * 64, LORA))
    with pytest.raises(KeyError):
        engine.generate(PROMPTS, greedy(0))


def publish_and_follow(follower: AdapterFollower, pub, versions: dict[int, dict[str, torch.Tensor]]) -> dict:
    """Publish each adapter version and let ``follower`` (its fetch loop in a thread) take it in, served or
    refused, before the next; returns ``versions``."""
    stop = threading.Event()
    thread = threading.Thread(target=follower.fetch_loop, args=(stop,), daemon=True)
    thread.start()
    try:
        for version, tensors in versions.items():
            pub.publish(version, tensors)
            while not follower.apply_pending() and follower.subscriber.step != version:  # served, or refused
                assert thread.is_alive()
                stop.wait(0.02)
    finally:
        stop.set()
        follower.wake()
        thread.join(timeout=10)
    return versions


class BitFlippingEngine(TransformersEngine):
    """Serves adapter version 2 with one element changed after loading (a faulty engine)."""

    def load_adapter(self, version, tensors, chain):
        if version == 2:
            tensors = {n: t.clone() for n, t in tensors.items()}
            first = next(iter(tensors))
            tensors[first].view(-1)[0] += 1
        return super().load_adapter(version, tensors, chain)


def following(bucket, engine, *, window: int, interval: int):
    """``engine``'s base published and synced; its adapter follower and the adapter chain's publisher."""
    base = Subscriber(bucket)
    base_hash = Publisher(bucket).publish(0, engine.state_dict()).state_hash
    base.sync()
    follower = AdapterFollower(bucket, engine, lambda: base.state_hash, window=window, poll_s=0.05)
    return follower, adapter_publisher(bucket, AdapterChain("tiny", base_hash, LORA), policy=FixedInterval(interval))


def test_follower_serves_verified_versions_in_a_window_and_drops_a_mismatch(bucket, model_dir):
    engine = BitFlippingEngine(model_dir)
    follower, pub = following(bucket, engine, window=2, interval=3)
    published = publish_and_follow(follower, pub, {v: trained_adapter(model_dir, v) for v in range(5)})
    assert follower.refused == 1 and 2 not in follower.served  # never served with the wrong bits
    assert sorted(follower.served) == [3, 4] and sorted(engine._peft.peft_config) == ["v3", "v4"]
    assert follower.status()["engine_adapter_hash"] == state_hash(bf16_of(published[4])) == pub.manifest.state_hash
    assert tokens(engine, greedy(4)) == peft_reference(model_dir, published[4])


def bf16_of(tensors):
    return {n: t.to(torch.bfloat16) for n, t in tensors.items()}


def test_adapter_settings_the_tensors_or_the_run_disagree_with_are_refused_and_nothing_stays_loaded(bucket, model_dir):
    """Issue 33 item 10: the adapter pointer's LoRA settings are writable; rank 1024 on every module left
    every refused version loaded in the engine (5 refused versions, 6 adapters loaded with a window of 3)."""
    import json

    from rlsync.adapters import AdapterMetadata, adapter_bucket
    from rlsync.layout import POINTER_KEY

    engine = TransformersEngine(model_dir)
    follower, pub = following(bucket, engine, window=3, interval=100)
    everything = LoraSpec(rank=1024, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    hostile = {2: everything, 3: everything, 4: LoraSpec(8, 16.0, ("q_proj", "v_proj")), 5: LoraSpec(8, 1e6, LORA.target_modules),
               6: everything}  # fmt: skip
    follower.subscriber.expect_metadata = {AdapterMetadata.BASE_HASH.value: follower.base_hash()}  # as its fetch loop sets it
    chain = adapter_bucket(bucket)
    for version in range(8):
        pub.publish(version, trained_adapter(model_dir, version))
        if version in hostile:  # the settings in the pointer rewritten, the tensors left as they are
            doc = json.loads(chain.get(POINTER_KEY))
            doc["metadata"][AdapterMetadata.LORA.value] = hostile[version].to_json()
            chain.put(POINTER_KEY, json.dumps(doc).encode())
        follower.slot.put(follower.subscriber.fetch())  # the fetch loop's step, here in order
        assert follower.apply_pending() is (version not in hostile)
        assert sorted(engine._peft.peft_config) == [f"v{v}" for v in sorted(follower.served)]  # nothing refused stays loaded
    assert follower.refused == len(hostile) and sorted(follower.served) == [7]
