"""Hostile OpenEnv servers (issue 26): slow, huge prompts, absurd rewards, malformed answers. Each is bounded
and counted by the env; none makes an object a replica cannot read, and none is retried hot."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from openenv.core.env_server import Environment, State, create_app

from env_space.environments import Task
from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources.openenv_client import OpenEnvEnvironment
from env_space.sources.settings import OpenEnvConfig
from tests.spaces_support.test_env_openenv import GuessAction, RiddleObservation, _free_port, _wait_healthy


class Hostile(Environment):
    """What the test sets: ``delay_s`` per reset, ``prompt_chars`` per prompt, ``reward`` per step."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    delay_s = 0.0
    prompt_chars = 10
    reward = 1.0

    def reset(self, seed=None, episode_id=None, **kwargs):
        time.sleep(Hostile.delay_s)
        return RiddleObservation(question="p" * Hostile.prompt_chars)

    def step(self, action, timeout_s=None, **kwargs):
        return RiddleObservation(done=True, reward=Hostile.reward)

    @property
    def state(self):
        return State()


@pytest.fixture
def hostile_url():
    port = _free_port()
    app = create_app(Hostile, GuessAction, RiddleObservation, max_concurrent_envs=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws_max_size=1 << 30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        Hostile.delay_s, Hostile.prompt_chars, Hostile.reward = 0.0, 10, 1.0
        server.should_exit = True
        thread.join(10)


def _simulator(bucket, url: str, **settings) -> EnvSimulator:
    env = EnvSimulator(EnvConfig(tasks_per_batch=6, failure_reward=-1.0), bucket)
    config = OpenEnvConfig(prompt_field="question", action_field="guess", type_field="", **settings)
    env.environment = OpenEnvEnvironment(url, config)
    return env


def test_making_a_batch_from_a_slow_server_is_bounded(bucket, hostile_url):
    Hostile.delay_s = 0.6
    env = _simulator(bucket, hostile_url, batch_timeout_s=1.0, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        env.publish_tasks()
    assert time.monotonic() - t0 < 3  # 6 resets would take 3.6 s; the bound is 1 s plus one call
    assert not list(bucket.list("tasks/"))
    env.environment.close()


@pytest.mark.parametrize("chars", [100_000, 2_000_000])  # over what replicas read; over the message cap
def test_a_huge_prompt_never_becomes_a_task_object(bucket, hostile_url, chars):
    Hostile.prompt_chars = chars
    env = _simulator(bucket, hostile_url)
    with pytest.raises(Exception):
        env.publish_tasks()
    assert not list(bucket.list("tasks/"))
    env.environment.close()


def test_an_absurd_reward_is_refused_and_counted_by_the_env(bucket, hostile_url):
    Hostile.reward = 1e300
    env = _simulator(bucket, hostile_url)
    task = env.environment.tasks(1, seed=0)[0]
    assert env.score_sample(task, "x") == -1.0
    assert env.failures.as_dict() == {"score: out_of_range": 1}
    env.environment.close()


def test_a_malformed_server_is_backed_off_not_retried_hot(bucket):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    connections = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(1)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\ngarbl")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        env = _simulator(bucket, f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=2)
        task = Task("oe-0-0", "p", "", {"type": "openenv", "seed": 0})
        rewards = env.score_samples([(task, "x")] * 30)
    finally:
        listener.close()
    assert rewards == [-1.0] * 30 and sum(env.failures.as_dict().values()) == 30
    assert len(connections) <= 2  # one per sample before
