"""The Hugging Face token never leaks.

``HF_TOKEN`` is set to a recognisable fake and ``hf://`` buckets are backed by the recording
stand-in for ``HfApi`` of ``tests/test_bucket_hf.py``, which here raises the errors the Hub can
raise with the token in them: echoed in the server's message, or only in the request's
``Authorization`` header, or in a proxy's connection error. Through a publisher, subscribers,
the three roles (trainer, replica, environment) and the panels' data functions, the token must
appear in no log record (everything captured at DEBUG), no exception message or traceback, no
``repr``, no object written to the bucket (status, metrics, tasks, rollouts, scores, pointer)
and nothing a panel renders.
"""

from __future__ import annotations

import time

import logging
import traceback
import types
from typing import Any

import pytest

import shared.bucket.hf as hf_module
from shared.bucket import BucketError, open_bucket
from shared.protocol import FixedInterval, Publisher, Subscriber
from tests.helpers import master_state, rl_step
from tests.test_bucket_hf import BUCKET, ENDPOINT, TOKEN, RecordingHfApi, http_error

URL = f"hf://buckets/{BUCKET}/runs/secret"
PREFIX = "runs/secret/"


def transient_errors() -> list[BaseException]:
    """Retryable failures that carry the token in three different places."""
    return [
        http_error(
            429,
            f"{ENDPOINT}/api/buckets/{BUCKET}/batch",
            {"Retry-After": "0", "X-Error-Message": f"slow down, token {TOKEN}"},
        ),
        http_error(503, f"{ENDPOINT}/api/buckets/{BUCKET}/resolve"),  # the token only in the request headers
        ConnectionError(f"proxy refused the tunnel; Proxy-Authorization: Bearer {TOKEN}"),
    ]


def permanent_error() -> BaseException:
    body = f'{{"error": "Invalid credentials in Authorization header: Bearer {TOKEN}"}}'.encode()
    return http_error(
        401, f"{ENDPOINT}/api/buckets/{BUCKET}/batch", {"X-Error-Message": f"bad token {TOKEN}"}, body=body
    )


METHODS = ["batch_bucket_files", "download_bucket_files", "list_bucket_tree", "get_bucket_paths_info"]


def said(value: Any) -> str:
    """Everything an exception (message, repr, whole traceback with its chain) or an object's repr shows."""
    if isinstance(value, BaseException):
        return "".join(traceback.format_exception(value)) + str(value) + repr(value)
    return repr(value) + str(value)


@pytest.fixture
def hub(monkeypatch) -> RecordingHfApi:
    """The stand-in client every ``hf://`` bucket of the test gets."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    api = RecordingHfApi(token=TOKEN)
    monkeypatch.setattr(hf_module, "HfApi", lambda token=None, **kwargs: api)
    return api


@pytest.fixture
def hf_bucket(hub):
    bucket = open_bucket(URL)  # RetryingBucket(HfBucket), as the Spaces open it
    bucket._sleep = lambda seconds: None
    return bucket


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def fail_soon(api: RecordingHfApi) -> None:
    """Queue the transient failures on every method whose queue is empty (fewer than the retries in a row)."""
    for method in METHODS:
        if not api.failures.get(method):
            api.fail_next(method, *transient_errors())
            api.queued = getattr(api, "queued", 0) + len(transient_errors())


def raised(api: RecordingHfApi) -> int:
    """How many queued failures were raised so far."""
    return getattr(api, "queued", 0) - sum(len(q) for q in api.failures.values())


def assert_nothing_stored_leaks(api: RecordingHfApi) -> None:
    objects = api.buckets[BUCKET]
    assert any(k.startswith(PREFIX + "status/") for k in objects) or objects  # something was written
    for key, data in objects.items():
        assert TOKEN.encode() not in data, key
        assert TOKEN not in key


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
    assert raised(hub) >= 20  # injected failures were raised and retried
    # a permanent failure on every operation, with the token echoed: the errors the caller sees
    hub.failures.clear()
    errors = []
    for method, action in [
        ("batch_bucket_files", lambda: pub.publish(5, master)),
        ("download_bucket_files", lambda: Subscriber(hf_bucket).fetch()),
        ("list_bucket_tree", lambda: hf_bucket.list("anchors/")),
        ("get_bucket_paths_info", lambda: hf_bucket.delete(["deltas/000000000001.safetensors"])),
    ]:
        hub.fail_next(method, permanent_error())
        with pytest.raises(BucketError) as info:
            action()
        errors.append(info.value)
    for err in errors:
        assert TOKEN not in said(err)
        assert "HTTP 401" in str(err) and "<redacted>" in str(err)
    for obj in (hf_bucket, hf_bucket.inner, pub.lock, pub.manifest, sub.stats, sub.manifest, pub.policy):
        assert TOKEN not in said(obj)
    assert_nothing_stored_leaks(hub)
    assert_logs_clean(logs, capfd)


class StubEngine:
    """An engine that writes nothing to the token-bearing paths and answers every prompt with one token."""

    name = "stub"

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
    fail_soon(hub)
    trainer.start()  # TRL's first weight sync publishes version 0
    deadline = time.time() + 120
    while trainer.version is None and time.time() < deadline:
        time.sleep(0.1)
    fail_soon(hub)
    env.step()  # tasks out
    fail_soon(hub)
    replica._pending = replica.subscriber.fetch()
    assert replica.step()  # applies version 0, answers the batch, writes its status
    fail_soon(hub)
    env.step()  # scores
    fail_soon(hub)
    # TRL's data loader reads one batch ahead: the 4 samples are two batches of 2, enough for one step
    trainer._thread.join(timeout=180)  # trains one step on the scores, publishes version 1, checkpoints
    assert not trainer.running
    replica._pending = replica.subscriber.fetch()
    replica.step()
    assert replica.status()["applied_step"] == 1 == trainer.version
    assert raised(hub) >= 20
    hub.failures.clear()
    # permanent failures with the token echoed: what each role's loop logs or raises
    hub.fail_next("batch_bucket_files", permanent_error(), permanent_error(), permanent_error(), permanent_error())
    trainer.metrics.flush()
    replica.publish_status()
    with pytest.raises(BucketError) as info:
        env.step()
    assert TOKEN not in said(info.value)
    for obj in (trainer.config, replica.config, env.config, replica.status(), trainer.metrics.rows, env.metrics.extra,
                trainer.publisher.lock, replica.subscriber.stats):  # fmt: skip
        assert TOKEN not in said(obj)
    keys = set(hub.buckets[BUCKET])
    for kind in ("status/r0.json", "metrics/trainer.json", "metrics/env.json", "latest.json"):
        assert PREFIX + kind in keys
    assert any(k.startswith(PREFIX + "scores/") for k in keys) and any(k.startswith(PREFIX + "tasks/") for k in keys)
    assert_nothing_stored_leaks(hub)
    assert_logs_clean(logs, capfd)


def test_panels_never_show_the_token(hub, hf_bucket, logs, capfd):
    from shared.spaces import anchor_policy, frames, role_control, snapshots

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
    hub.fail_next("list_bucket_tree", *[permanent_error()])
    failed = view.snapshot()
    assert failed.error  # the read failure is shown ...
    rendered = [snap, failed]
    for frame in (frames.publish_frame, frames.delta_size_frame, frames.changed_frame, frames.timing_frame,
                  frames.reward_frame, frames.fleet_frame, frames.recent_publishes_frame, frames.episodes_frame):  # fmt: skip
        rendered.append(frame(snap).to_string())
    policy = anchor_policy.describe_policy(anchor_policy.current_policy(snap))
    rendered += [frames.sync_time_frame(view).to_string(), policy, frames.trainer_summary(snap), frames.env_summary(snap)]
    runner = role_control.RoleRunner("env", lambda config: open_bucket(URL).list("tasks/"))
    hub.fail_next("list_bucket_tree", *[permanent_error()] * 6)
    runner.start(types.SimpleNamespace(), wait=True)
    rendered.append(runner.status())
    assert runner.state == "failed"
    for text in rendered:
        assert TOKEN not in said(text)  # ... without the token
    assert_logs_clean(logs, capfd)
