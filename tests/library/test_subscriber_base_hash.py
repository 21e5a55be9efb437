"""A delta naming the right steps but another base state is refused, counted, and healed by the next anchor."""

from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors
import safetensors.torch

from rlsync.errors import ChainError, HashMismatchError
from rlsync.hashing import state_hash
from rlsync.layout import POINTER_KEY, delta_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from tests.helpers import bf16, master_state, rl_step

OTHER_HASH = "0" * 64


def _rewrite_delta_base_hash(bucket, step: int, base_hash: str) -> None:
    """Replace the ``base_hash`` metadata of the published delta of ``step``; the pointer's size follows."""
    key = delta_key(step, 1)
    path = bucket.root / key
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = safetensors.torch.load_file(path)
    data = safetensors.torch.save(tensors, metadata={**metadata, "base_hash": base_hash})
    bucket.put(key, data)
    pointer = json.loads(bucket.get(POINTER_KEY))
    for entry in pointer["deltas"]:
        if entry["step"] == step:
            entry["file"]["size"] = len(data)
    bucket.put(POINTER_KEY, json.dumps(pointer).encode())


def _publish(pub, master, steps):
    for step in steps:
        if step:
            rl_step(master, step)
        pub.publish(step, master)


def _follower_one_delta_behind(bucket):
    """Versions 0 (anchor) and 1 followed by a subscriber, then version 2 published; anchors every 3."""
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(3)), Subscriber(bucket)
    _publish(pub, master, [0, 1])
    sub.sync()
    _publish(pub, master, [2])
    return master, pub, sub


def _held(sub):
    return sub.step, sub.state_hash, state_hash(sub.state)


def test_delta_with_another_base_hash_is_refused_at_fetch_and_healed_by_the_next_anchor(bucket):
    master, pub, sub = _follower_one_delta_behind(bucket)
    _rewrite_delta_base_hash(bucket, 2, OTHER_HASH)
    good = _held(sub)

    with pytest.raises(HashMismatchError, match="based on another state"):
        sub.fetch()
    assert _held(sub) == good
    assert sub.stats.refused == 1 and sub.needs_resync and "another state" in sub.stats.last_error

    # no loop on the bad delta: until an anchor exists, fetch waits without downloading it again
    reads = sub.stats.bytes_downloaded
    assert sub.fetch() is None
    assert sub.stats.bytes_downloaded - reads == len(bucket.get(POINTER_KEY))
    assert sub.stats.refused == 1

    _publish(pub, master, [3, 4])  # step 3 is an anchor
    applied = sub.sync()
    assert [(u.kind, u.step) for u in applied] == [("anchor", 3), ("delta", 4)]
    assert sub.state_hash == state_hash(sub.state) == state_hash(bf16(master)) and not sub.needs_resync


def test_apply_of_an_update_for_another_state_at_the_same_step_is_refused_and_resyncs(bucket):
    """Defence in depth: an update whose base hash disagrees reaching ``apply`` counts and triggers a resync."""
    _, _, sub = _follower_one_delta_behind(bucket)
    update = sub.fetch()
    good = _held(sub)
    with pytest.raises(ChainError, match="another state"):
        sub.apply(dataclasses.replace(update, base_hash=OTHER_HASH))
    assert _held(sub) == good
    assert sub.stats.refused == 1 and sub.needs_resync


def test_replayed_update_is_refused_without_a_resync(bucket):
    """An update for an older step (applied twice) is a caller's mistake, not a fork: no resync, not counted."""
    master, pub, sub = _follower_one_delta_behind(bucket)
    update = sub.fetch()
    sub.apply(update)
    with pytest.raises(ChainError):
        sub.apply(update)
    assert not sub.needs_resync and sub.stats.refused == 0
    _publish(pub, master, [3, 4])  # an anchor (with its companion delta) and a delta
    assert [u.kind for u in sub.sync()] == ["delta", "delta"]
