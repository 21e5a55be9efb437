"""A rollout replica chooses the chain it follows (``ROLLOUT_CHAIN``): the bf16 weights or the FP8 chain.

The FP8 chain is served by the vLLM engine (``tests/test_vllm_fp8.py`` runs it); these checks need no vLLM.
"""

from __future__ import annotations

import dataclasses

import pytest

from rlsync.bucket import LocalBucket
from rlsync.errors import ConfigurationError
from rlsync.fp8 import Chain, fp8_bucket, fp8_publisher, quantize_state
from rlsync.protocol import FixedInterval
from rollout_space.config import ReplicaConfig
from tests.helpers import master_state


def test_the_chain_setting_is_read_from_the_environment(monkeypatch):
    assert ReplicaConfig.from_env().chain == Chain.BF16.value
    monkeypatch.setenv("ROLLOUT_CHAIN", "fp8")
    assert Chain(ReplicaConfig.from_env().chain) is Chain.FP8


def test_each_chain_has_its_pointer_and_subscriber(tmp_path):
    bucket = LocalBucket(tmp_path)
    state = quantize_state(master_state())
    fp8_publisher(bucket, policy=FixedInterval(10)).publish(0, state)
    assert Chain.FP8.pointer_key == "fp8/" + Chain.BF16.pointer_key and bucket.exists(Chain.FP8.pointer_key)
    assert not bucket.exists(Chain.BF16.pointer_key)
    assert Chain.BF16.subscriber(bucket).fetch() is None  # the bf16 chain is empty
    follower = Chain.FP8.subscriber(bucket)
    assert follower.bucket.url == fp8_bucket(bucket).url and [u.kind for u in follower.sync()] == ["anchor"]


def test_a_replica_on_the_fp8_chain_needs_the_vllm_engine(tmp_path):
    from rollout_space.replica import Replica

    config = ReplicaConfig(bucket=str(tmp_path / "bucket"), engine="transformers", chain=Chain.FP8.value)
    with pytest.raises(ConfigurationError, match="ROLLOUT_CHAIN=fp8 is served by ROLLOUT_ENGINE=vllm, not 'transformers'"):
        Replica(config)
    with pytest.raises(ConfigurationError, match="serves no LoRA"):
        Replica(dataclasses.replace(config, engine="vllm", lora=True))
    with pytest.raises(ValueError):
        Replica(ReplicaConfig(bucket=str(tmp_path / "bucket"), chain="fp16"))
