"""The ``bucket`` backend's rules for an update prepared before vLLM's pause: it is applied only while it still
follows the served state and the bucket's pointer still leads through it (no vLLM model needed: a plain
subscriber stands for the worker's)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher, Subscriber  # noqa: E402
from rlsync.vllm.transfer import _follows, _on_pointer  # noqa: E402
from tests.helpers import master_state, rl_step  # noqa: E402


def test_a_prepared_delta_is_stale_once_the_state_or_the_pointer_moves_on(tmp_path):
    bucket = LocalBucket(tmp_path / "bucket")
    master = master_state()
    publisher = Publisher(bucket, policy=FixedInterval(10))
    publisher.publish(0, master)
    for step in (1, 2):
        rl_step(master, step)
        publisher.publish(step, master)
    sub = Subscriber(bucket)
    sub.apply(sub.fetch())
    delta = sub.fetch()
    assert delta.kind == "delta" and delta.step == 1
    assert _follows(sub, delta, None) and _follows(sub, delta, 1) and _on_pointer(sub, delta)
    assert not _follows(sub, delta, 0)  # it would pass the step asked for
    sub.apply(delta)
    assert not _follows(sub, delta, None)  # the served state moved on: applying it again is refused
    following = sub.fetch()
    assert _follows(sub, following, None) and _on_pointer(sub, following)

    fresh = master_state(seed=7)  # a new run: its anchor replaces the chain the prepared delta belongs to
    Publisher(bucket, policy=FixedInterval(10), new_run=True).publish(3, fresh)
    assert _follows(sub, following, None) and not _on_pointer(sub, following)
    anchor = sub.fetch()
    assert anchor.kind == "anchor" and _follows(sub, anchor, None) and _on_pointer(sub, anchor)
    assert not _follows(sub, anchor, 2)
