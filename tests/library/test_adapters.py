"""The adapter chain: adapter versions under ``adapters/`` with the weights chain's machinery.

Publisher and Subscriber run unchanged on a :class:`PrefixedBucket`: anchors and deltas,
pointer last, whole-adapter hashes, retention; the chain's pointer names its base, and a
subscriber bound to another base refuses it before downloading anything.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlsync.adapters import (
    AdapterChain,
    AdapterMetadata,
    LoraSpec,
    adapter_bucket,
    adapter_publisher,
    adapter_subscriber,
)
from rlsync.bucket import PrefixedBucket
from rlsync.errors import ChainError, FormatError, InvalidKeyError, SyncError, TransientBucketError
from rlsync.hashing import state_hash
from rlsync.layout import ADAPTER_PREFIX, POINTER_KEY
from rlsync.protocol import FixedInterval, Manifest, Publisher, read_manifest
from testing.faulty import FaultyBucket
from tests.helpers import bf16, master_state

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def adapter_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 LoRA tensors under peft's saved names (B starts at zero, as peft initialises it)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module, width in (("q_proj", 64), ("v_proj", 32)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(LORA.rank, 48, generator=g) * 0.1
            out[f"{prefix}.lora_B.weight"] = torch.zeros(width, LORA.rank)
    return out


def adam_like_step(state: dict[str, torch.Tensor], seed: int, lr: float) -> None:
    """Every element moves by about ``lr`` (Adam's normalised step), as one RL optimizer step does."""
    g = torch.Generator().manual_seed(100 + seed)
    for t in state.values():
        t += torch.sign(torch.randn(t.shape, generator=g)) * lr


def chain(base_hash: str = "b" * 64) -> AdapterChain:
    return AdapterChain("tiny-qwen3", base_hash, LORA)


def test_prefixed_bucket_addresses_only_its_prefix(bucket):
    view = PrefixedBucket(bucket, "adapters/")
    view.put("latest.json", b"adapter")
    bucket.put("latest.json", b"weights")
    assert bucket.get("adapters/latest.json") == b"adapter" and view.get("latest.json") == b"adapter"
    assert [o.key for o in view.list()] == ["latest.json"]
    assert view.exists("latest.json") and not view.exists("lock.json")
    view.delete(["latest.json"])
    assert bucket.get("latest.json") == b"weights" and not bucket.exists("adapters/latest.json")
    for key in ("../latest.json", "/latest.json", "a//b"):
        with pytest.raises(InvalidKeyError):
            view.put(key, b"x")
    with pytest.raises(ValueError):
        PrefixedBucket(bucket, "adapters")


def test_adapter_chain_lives_under_its_prefix_and_follows_bit_exactly(bucket):
    base = Publisher(bucket)
    base_hash = base.publish(0, master_state()).state_hash
    pub = adapter_publisher(bucket, chain(base_hash), policy=FixedInterval(4))
    sub = adapter_subscriber(bucket, base_hash)
    state = adapter_state()
    kinds = []
    for step in range(6):
        if step:
            adam_like_step(state, step, 1e-4)
        kinds.append(pub.publish(step, state).kind)
        sub.sync()
        assert sub.step == step and sub.state_hash == state_hash(bf16(state))
        assert state_hash(sub.state) == state_hash(bf16(state))  # the whole adapter state dict, byte for byte
    assert kinds == ["anchor", "delta", "delta", "delta", "anchor", "delta"]
    keys = [o.key for o in bucket.list()]
    assert all(k.startswith((ADAPTER_PREFIX, "anchors/", "latest.json", "lock.json")) for k in keys), keys
    assert any(k.startswith(ADAPTER_PREFIX + "deltas/") for k in keys)
    assert read_manifest(bucket).step == 0  # the weights chain is untouched
    pointer = read_manifest(adapter_bucket(bucket))
    assert AdapterChain.from_manifest(pointer) == chain(base_hash)
    late = adapter_subscriber(bucket, base_hash)  # a replica joining now: anchor 4, delta 5
    late.sync()
    assert late.state_hash == sub.state_hash


def test_a_replica_with_another_base_refuses_the_chain_before_downloading(bucket):
    pub = adapter_publisher(bucket, chain("a" * 64))
    pub.publish(0, adapter_state())
    sub = adapter_subscriber(bucket, "c" * 64)
    with pytest.raises(ChainError, match="base_hash"):
        sub.fetch()
    assert sub.stats.refused == 1 and sub.stats.reads == 1 and sub.step is None  # only the pointer was read
    sub.expect_metadata = {AdapterMetadata.BASE_HASH.value: "a" * 64}  # the right base
    sub.sync()
    assert sub.step == 0


def test_resume_refuses_an_adapter_chain_for_another_base(bucket):
    adapter_publisher(bucket, chain("a" * 64)).publish(0, adapter_state())
    with pytest.raises(SyncError, match="metadata"):
        adapter_publisher(bucket, chain("d" * 64)).resume()
    resumed = adapter_publisher(bucket, chain("a" * 64))
    assert state_hash(resumed.resume()) == state_hash(bf16(adapter_state()))


def test_a_publish_cut_short_leaves_the_previous_adapter_version(bucket):
    state = adapter_state()
    pub = adapter_publisher(bucket, chain())
    pub.publish(0, state)
    adam_like_step(state, 1, 1e-3)
    pub.writer.bucket = adapter_bucket(FaultyBucket(bucket, truncate_rate=1.0))  # every upload is cut short from now on
    with pytest.raises(TransientBucketError, match="deltas/"):
        pub.publish(1, state)
    sub = adapter_subscriber(bucket, "b" * 64)
    sub.sync()
    assert sub.step == 0 and sub.state_hash == state_hash(bf16(adapter_state()))


@pytest.mark.parametrize(
    "metadata",
    [[1, 2], {str(i): "x" for i in range(33)}, {"base_hash": 5}, {"lora": "x" * 5000}, {"k" * 300: "v"}],
)
def test_hostile_pointer_metadata_is_a_format_error(bucket, metadata):
    Publisher(bucket).publish(0, master_state())
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["metadata"] = metadata
    with pytest.raises(FormatError):
        Manifest.from_json(json.dumps(doc).encode())


def test_invalid_lora_settings_in_the_chain_are_a_format_error(bucket):
    pub = Publisher(adapter_bucket(bucket), metadata={**chain().metadata(), AdapterMetadata.LORA.value: '{"rank": -1}'})
    pub.publish(0, adapter_state())
    with pytest.raises(FormatError):
        AdapterChain.from_manifest(read_manifest(adapter_bucket(bucket)))
    with pytest.raises(ValueError):
        LoraSpec(rank=0)
    with pytest.raises(ValueError):
        LoraSpec(target_modules=())


def test_an_anchor_whose_delta_does_not_pay_is_written_without_it(bucket):
    """A dense update (every element new) at an anchor step: replicas keeping up download the anchor."""
    pub = adapter_publisher(bucket, chain(), policy=FixedInterval(2))
    sub = adapter_subscriber(bucket, "b" * 64)
    pub.publish(0, adapter_state(0))
    sub.sync()
    small = adapter_state(0)
    adam_like_step(small, 1, 1e-4)
    pub.publish(1, small)  # a delta
    sub.sync()
    dense = adapter_state(7)  # another random adapter: a delta would be as large as the whole adapter
    dense = {n: t + torch.randn(t.shape) for n, t in dense.items()}
    record = pub.publish(2, dense)
    assert record.kind == "anchor" and [d.step for d in pub.manifest.deltas] == [1]  # no companion delta of 2
    assert not any(k.key.startswith(f"{ADAPTER_PREFIX}deltas/000000000002") for k in bucket.list())
    applied = sub.sync()
    assert [u.kind for u in applied] == ["anchor"] and sub.state_hash == state_hash(bf16(dense))
    small = {n: t.clone() for n, t in dense.items()}
    adam_like_step(small, 3, 1e-4)
    pub.publish(3, small)
    record = pub.publish(4, {n: t.clone() for n, t in small.items()})  # an anchor of an unchanged adapter
    assert record.kind == "anchor" and pub.manifest.deltas[-1].step == 4  # its (empty) delta pays
    assert [u.kind for u in sub.sync()] == ["delta", "delta"]
