"""The Hugging Face token never leaks.

``HF_TOKEN`` is set to a recognisable fake and ``hf://`` buckets are the real huggingface_hub +
hf_xet client talking to the local Hub stand-in server (``testing/hub/server.py``), which here
answers with the errors the Hub can send with the token in them: echoed in the server's message
(429, 503, 401), or only in the request's ``Authorization`` header. (A proxy's connection error
quoting the token cannot come from a server; its text goes through the same scrubbing as an
echoed message.) Through a publisher, subscribers,
the three roles (trainer, replica, environment) and the panels' data functions, the token must
appear in no log record (everything captured at DEBUG), no exception message or traceback, no
``repr``, no object written to the bucket (status, metrics, tasks, rollouts, scores, pointer)
and nothing a panel renders.
"""

from __future__ import annotations

import logging
import time
import traceback
import types
from typing import Any

import pytest

from rlsync.roles import Role
from rlsync.bucket import open_bucket
from rlsync.bucket.hf import HfBucket
from rlsync.errors import BucketError
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from testing.hub.faults import Fault
from testing.hub.server import HubServer
from tests.helpers import master_state, rl_step

TOKEN = "hf_TESTsecretTOKEN0123456789abcdefXYZ"
BUCKET = "someone/rl-sync"

URL = f"hf://buckets/{BUCKET}/runs/secret"
PREFIX = "runs/secret/"


def transient_errors(path: str) -> list[Fault]:
    """Retryable failures: the token echoed in the message, or only in the request's headers, or a dropped
    connection. Two per path: a `get` meets them on its one request (the resolve), a `delete` on its
    paths-info, and must succeed within the retries of one operation."""
    last = Fault(drop=True, path=path) if path in ("/batch$", "/tree") else Fault(503, path=path)
    return [Fault(429, {"Retry-After": "0"}, message=f"slow down, token {TOKEN}", path=path), last]


def permanent_error(path: str) -> Fault:
    return Fault(401, message=f"Invalid credentials in Authorization header: Bearer {TOKEN}", path=path)


#: The Hub API path each huggingface_hub bucket method sends its requests to.
METHODS = {
    "batch_bucket_files": "/batch$",
    "download_bucket_files": "/resolve/",
    "list_bucket_tree": "/tree",
    "get_bucket_paths_info": "/paths-info$",
}


def said(value: Any) -> str:
    """Everything an exception (message, repr, whole traceback with its chain) or an object's repr shows."""
    if isinstance(value, BaseException):
        return "".join(traceback.format_exception(value)) + str(value) + repr(value)
    return repr(value) + str(value)


@pytest.fixture
def hub(hub, monkeypatch) -> HubServer:
    """The Hub stand-in, accepting the token, with the bucket created."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.add_token(TOKEN, "write")
    hub.create_bucket(BUCKET)
    hub.injected = 0
    return hub


@pytest.fixture
def hf_bucket(hub):
    bucket = open_bucket(URL)  # RetryingBucket(HfBucket), as the Spaces open it
    bucket._sleep = lambda seconds: None
    return bucket


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def fail_soon(hub: HubServer) -> None:
    """Queue the transient failures on every method whose queue is empty (fewer than the retries in a row)."""
    for path in METHODS.values():
        if not hub.pending("api", path):
            hub.inject("api", *transient_errors(path))
            hub.injected += len(transient_errors(path))


def fail_next(hub: HubServer, method: str, count: int = 1) -> None:
    hub.inject("api", *[permanent_error(METHODS[method])] * count)


def raised(hub: HubServer) -> int:
    """How many queued failures were served so far."""
    return hub.injected - sum(len(q) for q in hub.faults.values())


def assert_nothing_stored_leaks(hub: HubServer, *expected: str) -> None:
    """No stored key or object holds the token; each ``expected`` key prefix holds an object (so the scan saw them)."""
    keys = sorted(hub.buckets[BUCKET])
    assert expected
    for prefix in expected:
        assert any(k.startswith(PREFIX + prefix) for k in keys), f"nothing was written under {prefix!r}"
    reader = HfBucket(BUCKET, token=TOKEN)
    for key in keys:
        assert TOKEN not in key
        assert TOKEN.encode() not in reader.get(key), key  # the bytes, read back through Xet storage


def assert_logs_clean(logs, capfd) -> None:
    assert logs.records  # the code under test did log (retries, warnings, debug lines)
    assert TOKEN not in logs.text
    for record in logs.records:
        assert TOKEN not in record.getMessage()
        if record.exc_info:
            assert TOKEN not in "".join(traceback.format_exception(*record.exc_info))
    out, err = capfd.readouterr()
    assert TOKEN not in out + err


def test_publisher_and_subscriber_through_flaky_hub_never_show_the_token(hub, hf_bucket, logs, capfd):
    master = master_state()
    pub = Publisher(hf_bucket, policy=FixedInterval(3), owner="trainer")
    sub = Subscriber(open_bucket(URL))
    sub.bucket._sleep = lambda seconds: None
    for step in range(5):
        if step:
            rl_step(master, step)
        fail_soon(hub)
        pub.publish(step, master)
        sub.sync()
        assert sub.state_hash == pub.manifest.state_hash
    assert raised(hub) >= 20  # injected failures were served and retried
    # a permanent failure on every operation, with the token echoed: the errors the caller sees
    hub.clear_faults()
    errors = []
    for method, action in [
        ("batch_bucket_files", lambda: pub.publish(5, master)),
        ("download_bucket_files", lambda: Subscriber(hf_bucket).fetch()),
        ("list_bucket_tree", lambda: hf_bucket.list("anchors/")),
        ("get_bucket_paths_info", lambda: hf_bucket.delete(["deltas/000000000001.safetensors"])),
    ]:
        fail_next(hub, method)
        with pytest.raises(BucketError) as info:
            action()
        errors.append(info.value)
    for err in errors:
        assert TOKEN not in said(err)
        assert "HTTP 401" in str(err) and "<redacted>" in str(err)
    for obj in (hf_bucket, hf_bucket.inner, pub.ownership.lock, pub.manifest, sub.stats, sub.manifest, pub.policy):
        assert TOKEN not in said(obj)
    assert_nothing_stored_leaks(hub, "latest.json", "anchors/", "deltas/")
    assert_logs_clean(logs, capfd)


class StubEngine:
    """An engine that writes nothing to the token-bearing paths and answers every prompt with one token."""

    name = "stub"

    def weights(self) -> None:
        return None  # fed from the subscriber's copy, as an engine that keeps its own weights

    def load_state(self, state) -> None:
        pass

    def apply_patches(self, patches, state) -> None:
        pass

    def generate(self, prompts, sampling):
        from rollout_space.engine import Completion

        return [[Completion("1", [5], [-1.0]) for _ in range(sampling.n)] for _ in prompts]

    def close(self) -> None:
        pass


def test_three_roles_on_a_flaky_hub_never_show_the_token(hub, hf_bucket, logs, capfd):
    """Trainer, replica and environment exchange one round through the hf:// bucket while the
    Hub keeps failing with the token in its errors; status, metrics and every other object stay clean."""
    from env_space.simulator import EnvConfig, EnvSimulator
    from rollout_space.replica import Replica, ReplicaConfig
    from trainer_space.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(bucket=URL, batch_size=2, max_steps=1, trainer_id="trainer", poll_s=0.05), bucket=hf_bucket)
    env = EnvSimulator(EnvConfig(bucket=URL, tasks_per_batch=2, queue_depth=1), bucket=hf_bucket)
    replica = Replica(
        ReplicaConfig(bucket=URL, replica_id="r0", samples_per_task=2), bucket=hf_bucket, engine=StubEngine()
    )
    try:
        _exchange_one_round(hub, trainer, env, replica)
    finally:
        for role in (trainer, env, replica):
            role.close()
    assert_logs_clean(logs, capfd)


def _exchange_one_round(hub, trainer, env, replica) -> None:
    fail_soon(hub)
    trainer.start()  # TRL's first weight sync publishes version 0
    deadline = time.time() + 120
    while trainer.version is None and time.time() < deadline:
        time.sleep(0.1)
    fail_soon(hub)
    env.step()  # tasks out
    fail_soon(hub)
    replica.slot.put(replica.subscriber.fetch())
    assert replica.step()  # applies version 0, answers the batch, writes its status
    fail_soon(hub)
    env.step()  # scores
    fail_soon(hub)
    # TRL's data loader reads one batch ahead: the 4 samples are two batches of 2, enough for one step
    trainer._thread.join(timeout=180)  # trains one step on the scores, publishes version 1, checkpoints
    assert not trainer.running
    replica.slot.put(replica.subscriber.fetch())
    replica.step()
    assert replica.status().applied_step == 1 == trainer.version
    assert raised(hub) >= 20
    hub.clear_faults()
    # permanent failures with the token echoed: what each role's loop logs or raises
    fail_next(hub, "batch_bucket_files", 4)
    trainer.metrics.flush()
    replica.publish_status()
    with pytest.raises(BucketError) as info:
        env.step()
    assert TOKEN not in said(info.value)
    for obj in (trainer.config, replica.config, env.config, replica.status(), trainer.metrics.rows, env.figures.metrics.state,
                trainer.publisher.ownership.lock, replica.subscriber.stats):  # fmt: skip
        assert TOKEN not in said(obj)
    assert_nothing_stored_leaks(
        hub, "status/r0.json", "metrics/trainer.json", "metrics/env.json", "latest.json", "scores/", "tasks/"
    )


def test_panels_never_show_the_token(hub, hf_bucket, logs, capfd):
    from rlsync.spaces import anchor_policy, frames, role_control, snapshots

    master = master_state()
    pub = Publisher(hf_bucket, owner="trainer")
    for step in range(3):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    hf_bucket.put("status/r0.json", b'{"replica_id": "r0", "engine": "stub", "applied_step": 2, "apply_s": 0.1}')
    hf_bucket.put("metrics/trainer.json", b'{"rows": [{"kind": "delta", "version": 1, "nbytes": 10}], "version": 2}')
    fail_soon(hub)
    snap = snapshots.read_snapshot(hf_bucket)
    assert snap.manifest is not None and snap.statuses and not snap.error
    view = snapshots.BucketView(URL)
    fail_next(hub, "list_bucket_tree")
    failed = view.snapshot()
    view.close()
    assert failed.error  # the read failure is shown ...
    rendered = [snap, failed]
    for frame in (frames.publish_frame, frames.delta_size_frame, frames.changed_frame, frames.timing_frame,
                  frames.reward_frame, frames.fleet_frame, frames.recent_publishes_frame, frames.episodes_frame):  # fmt: skip
        rendered.append(frame(snap).to_string())
    policy = anchor_policy.describe_policy(anchor_policy.current_policy(snap))
    rendered += [frames.sync_time_frame(view).to_string(), policy, frames.trainer_summary(snap), frames.env_summary(snap)]
    runner = role_control.RoleRunner(Role.ENV, lambda config: open_bucket(URL).list("tasks/"))
    fail_next(hub, "list_bucket_tree", 6)
    runner.start(types.SimpleNamespace(), wait=True)
    rendered.append(runner.status())
    assert runner.state == "failed"
    for text in rendered:
        assert TOKEN not in said(text)  # ... without the token
    assert_logs_clean(logs, capfd)
