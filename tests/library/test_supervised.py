"""Background threads never die silently (issue 33 item 2): an exception escaping a role's loop is
logged with its traceback and counted, and the loop runs again after a backoff, or, for a loop that
must not run twice, the thread stops loudly; a replica whose fetching fails keeps syncing."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from safetensors.torch import load_file

from rlsync.protocol import FixedInterval, Publisher
from rlsync.spaces.tiny_model import build_tiny_model
from rlsync.supervised import SupervisedThread
from rollout_space.replica import Replica, ReplicaConfig


def test_a_failing_loop_is_logged_counted_and_run_again_after_a_growing_backoff(caplog):
    calls: list[float] = []

    def loop() -> None:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise RuntimeError(f"bug {len(calls)}")

    thread = SupervisedThread(loop, name="looping", stop=threading.Event(), backoff_s=0.05, max_backoff_s=1.0)
    with caplog.at_level(logging.ERROR, "rlsync.supervised"):
        thread.start()
        thread.join(10)
    assert not thread.is_alive() and len(calls) == 3 and thread.crashes == 2 and thread.error == "RuntimeError: bug 2"
    assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1  # waited, twice as long the second time
    logged = [r for r in caplog.records if "thread looping failed" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged) and "restarting in" in logged[0].getMessage()


def test_a_loop_that_must_not_run_twice_stops_loudly(caplog):
    calls = []

    def loop() -> None:
        calls.append(1)
        raise KeyError("state a second run would duplicate")

    thread = SupervisedThread(loop, name="main-loop", restart=False)
    with caplog.at_level(logging.ERROR, "rlsync.supervised"):
        thread.start()
        thread.join(10)
    assert calls == [1] and thread.crashes == 1 and thread.error.startswith("KeyError")
    assert any("main-loop failed and stopped" in r.getMessage() and r.exc_info for r in caplog.records)


def test_stop_ends_the_backoff_wait_and_no_restart_follows():
    stop, calls = threading.Event(), []

    def loop() -> None:
        calls.append(1)
        raise RuntimeError("always")

    thread = SupervisedThread(loop, name="stopping", stop=stop, backoff_s=600.0)
    thread.start()
    while not thread.crashes:
        time.sleep(0.01)
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and calls == [1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _wait(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_replica_whose_fetching_raises_anything_counts_it_and_keeps_syncing(bucket, model_dir, monkeypatch):
    """The fetch loop caught only SyncError and BucketError: anything else ended its thread, and the
    replica stayed at its version for good, even after the next anchor."""
    state = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    pub = Publisher(bucket, policy=FixedInterval(1))  # every version an anchor
    pub.publish(0, state)
    replica = Replica(
        ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="transformers", model=str(model_dir), device="cpu", poll_s=0.05),
        bucket=bucket,
    )  # fmt: skip
    fetch, failures = replica.subscriber.fetch, [IndexError("index -3 is out of bounds")]

    def failing_once():
        if failures:
            raise failures.pop()
        return fetch()

    monkeypatch.setattr(replica.subscriber, "fetch", failing_once)
    replica.start()
    try:
        _wait(lambda: replica.subscriber.step == 0)
        name = next(iter(state))
        state[name] = state[name] + 1.0
        pub.publish(1, state)
        _wait(lambda: replica.subscriber.step == 1)
        assert replica.status().thread_crashes == 1 and not failures
    finally:
        replica.close()
