"""A replica's ENGINE ends up with the published weights, bit for bit, after an anchor and after deltas.

The transformers engine's own tensors are the subscriber's state (the tiny offline model, a few
seconds on CPU): updates are verified before the pause and written straight into them, a forged
delta is refused with the engine untouched, and weights corrupted outside the protocol are caught
by the background re-hash and repaired from an anchor.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollout_space.replica import Replica, ReplicaConfig
from rlsync.dtypes import bits_to_numpy, int_view
from rlsync.errors import HashMismatchError
from rlsync.delta_format import Change, decode_delta, encode_delta
from rlsync.format import parse_header
from rlsync.hashing import state_hash
from rlsync.protocol import POINTER_KEY, FixedInterval, Publisher, read_manifest
from rlsync.spaces.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _nudge(master: dict[str, torch.Tensor], seed: int) -> None:
    """An RL-like update of the fp32 master: enough to flip a few percent of the bf16 weights."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t += torch.randn(t.shape, generator=g) * t.abs().mean() * 0.02


def _sync_once(replica: Replica) -> None:
    replica.slot.put(replica.subscriber.fetch())
    assert replica.slot.update is not None
    assert replica.apply_pending()


def _replica(bucket, model_dir, **settings) -> Replica:
    config = ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="transformers", model=str(model_dir), device="cpu", **settings)
    return Replica(config, bucket=bucket)


def _engine_hash(replica: Replica) -> str:
    return state_hash(replica.engine.state_dict())


def test_engine_weights_follow_anchor_and_deltas_bit_exactly(bucket, model_dir):
    master = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    _nudge(master, 0)  # the anchor differs from the weights the engine starts with
    pub = Publisher(bucket, policy=FixedInterval(100))
    replica = _replica(bucket, model_dir)
    engine_start = _engine_hash(replica)
    records = [pub.publish(0, master)]
    assert records[0].state_hash != engine_start
    _sync_once(replica)
    assert _engine_hash(replica) == records[0].state_hash
    # the subscriber's state is the engine's own parameters, not a copy of them
    params = {p.data_ptr() for p in replica.engine.model.parameters()}
    assert {t.data_ptr() for t in replica.subscriber.state.values()} <= params

    for step in (1, 2):
        before = _engine_hash(replica)
        _nudge(master, step)
        records.append(pub.publish(step, master))
        assert records[-1].kind == "delta" and 0 < records[-1].changed < records[-1].total
        _sync_once(replica)
        engine_hash = _engine_hash(replica)
        assert engine_hash == records[-1].state_hash == replica.subscriber.state_hash != before
    assert replica.subscriber.verify_weights() is True
    status = replica.status()
    assert status.applied_step == 2 and status.refused == 0
    assert status.engine_state_hash == records[-1].state_hash and status.engine_verified_step == 2
    assert status.rehashes == 1 and status.rehash_mismatches == 0
    assert [(s.step, s.kind) for s in replica.syncs] == [(0, "anchor"), (1, "delta"), (2, "delta")]  # typed records
    assert status.recent_syncs == replica.syncs and status.apply_s == replica.syncs[-1].idle_s
    replica.close()


def _corrupt_one_weight(replica: Replica) -> None:
    """Flip one bit of one served weight, outside the protocol (a memory fault, a stray write)."""
    tensor = next(t for t in replica.engine.weights().values() if t.numel() > 100)
    tensor.view(-1).view(torch.int16)[37] ^= 1


def test_corrupted_engine_weights_are_caught_by_the_background_rehash_and_resynced_from_an_anchor(bucket, model_dir):
    master = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    pub = Publisher(bucket, policy=FixedInterval(100))
    replica = _replica(bucket, model_dir, rehash_every_s=0.05)
    pub.publish(0, master)
    _sync_once(replica)
    _nudge(master, 1)
    pub.publish(1, master)
    _sync_once(replica)
    _corrupt_one_weight(replica)
    assert _engine_hash(replica) != replica.subscriber.state_hash  # a delta check would never see it
    stop = threading.Event()
    loop = threading.Thread(target=replica.weights.rehash_loop, args=(stop,), daemon=True)
    loop.start()
    deadline = time.monotonic() + 60
    while replica.subscriber.stats.rehash_mismatches == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    replica.weights.wake()
    loop.join(10)
    assert replica.subscriber.verify_weights() is None  # waiting for the anchor: the mismatch is counted once
    status = replica.status()
    assert status.rehash_mismatches == 1 and status.refused == 1 and replica.subscriber.needs_resync
    _nudge(master, 2)
    pub.publish(2, master)  # a delta: the replica does not take it, its weights are not the verified base
    update = replica.subscriber.fetch()
    assert update is not None and update.kind == "anchor" and update.step == 0  # the newest anchor
    replica.slot.put(update)
    assert replica.apply_pending()
    while replica.subscriber.step != 2:
        _sync_once(replica)
    assert _engine_hash(replica) == replica.subscriber.state_hash == read_manifest(bucket).state_hash
    assert replica.subscriber.verify_weights() is True and not replica.subscriber.needs_resync
    replica.close()


def _forge(delta: bytes, state: dict[str, torch.Tensor], how: str) -> bytes:
    """``delta`` re-encoded with one element changed (``how``), its metadata (steps, hashes) kept."""
    _, metadata = parse_header(delta)
    decoded = decode_delta(delta, state)
    name = max(decoded.patches, key=lambda n: decoded.patches[n].numel)
    changes = {}
    for n, patch in decoded.patches.items():
        index, new = patch.index.numpy().copy(), bits_to_numpy(int_view(patch.values)).copy()
        if n == name and how == "value":
            new[len(new) // 2] ^= 1 if new[len(new) // 2] ^ 1 != decoded.old_bits[n][len(new) // 2] else 2
        elif n == name and how == "index":  # the same value, one position further (a free one)
            k = next(k for k in range(len(index)) if index[k] + 1 not in set(index.tolist()))
            index[k] += 1
        elif n == name and how == "dropped":
            index, new = np.delete(index, len(index) // 2), np.delete(new, len(new) // 2)
        flat = bits_to_numpy(int_view(state[n]))
        changes[n] = Change(index, flat[index], new, state[n].dtype, tuple(state[n].shape))
    keep = {k: metadata[k] for k in ("step", "base_step", "base_hash", "state_hash", "total")}
    return encode_delta(changes, step=int(keep["step"]), base_step=int(keep["base_step"]), base_hash=keep["base_hash"],
                        state_hash=keep["state_hash"], total=int(keep["total"]), codec=metadata["codec"])  # fmt: skip


def _wrong_base(delta: bytes, replica: Replica) -> None:
    """Make the engine's weights differ from the delta's base at one element it changes, unknown to the
    replica (its hash still says the base): the old bits it gathers are not the trainer's."""
    decoded = decode_delta(delta, replica.subscriber.state)
    name = max(decoded.patches, key=lambda n: decoded.patches[n].numel)
    position, new = int(decoded.patches[name].index[0]), int(bits_to_numpy(int_view(decoded.patches[name].values))[0])
    flat = bits_to_numpy(int_view(replica.subscriber.state[name]))
    flat[position] ^= 1 if flat[position] ^ 1 != new else 2


@pytest.mark.parametrize("how", ["value", "index", "dropped", "base"])
def test_a_forged_delta_is_refused_before_the_pause_with_the_engine_untouched(bucket, model_dir, how):
    """One changed value, one moved position, one element left out, or a replica whose weights are not
    the delta's base: each delta is well-formed, and the state hash updated from it (old bits gathered
    from the engine's weights) differs from the published one, so fetch refuses it; nothing is written."""
    master = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    pub = Publisher(bucket, policy=FixedInterval(100))
    replica = _replica(bucket, model_dir)
    pub.publish(0, master)
    _sync_once(replica)
    _nudge(master, 1)
    pub.publish(1, master)
    key = read_manifest(bucket).deltas[-1].files[0].key
    if how == "base":
        _wrong_base(bucket.get(key), replica)
    else:
        forged = _forge(bucket.get(key), replica.subscriber.state, how)
        bucket.put(key, forged)
        pointer = json.loads(bucket.get(POINTER_KEY))
        pointer["deltas"][-1]["file"]["size"] = len(forged)
        bucket.put(POINTER_KEY, json.dumps(pointer).encode())
    before = _engine_hash(replica)
    with pytest.raises(HashMismatchError, match="does not match its hash"):
        replica.subscriber.fetch()
    assert _engine_hash(replica) == before and replica.subscriber.step == 0
    assert how == "base" or before == replica.subscriber.state_hash
    assert replica.status().refused == 1 and replica.subscriber.needs_resync
    replica.close()


def test_the_fetch_loop_drops_an_update_once_it_is_applied(bucket, model_dir):
    """While the fetch thread downloads and decodes the next update, the one applied before is not held
    (its patch and rollback values would add a second decoded delta to the replica's peak memory)."""
    master = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    Publisher(bucket, policy=FixedInterval(100)).publish(0, master)
    replica = _replica(bucket, model_dir)
    fetched: list[weakref.ref] = []
    in_next_fetch, release = threading.Event(), threading.Event()
    real_fetch = replica.subscriber.fetch

    def fetch():
        if fetched:  # the next fetch: wait here, as a long download would
            in_next_fetch.set()
            release.wait(30)
            return None
        update = real_fetch()
        fetched.append(weakref.ref(update))
        return update

    replica.subscriber.fetch = fetch
    stop = threading.Event()
    loop = threading.Thread(target=replica.weights.fetch_loop, args=(stop,), daemon=True)
    loop.start()
    try:
        assert in_next_fetch.wait(30)  # the loop applied the anchor itself (no batch was being generated)
        assert replica.subscriber.step == 0
        gc.collect()
        assert fetched[0]() is None, "the fetch loop still holds the applied update while it fetches the next one"
    finally:
        stop.set()
        release.set()
        replica.weights.wake()
        loop.join(10)
        replica.close()
