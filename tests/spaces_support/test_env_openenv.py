"""OpenEnv, both directions, over HTTP/WebSocket on 127.0.0.1: our environments served with openenv-core's server
(in a separate process), fronted with openenv-core's client as a task source, scoring as the library itself does."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import reasoning_gym
import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from reasoning_gym.utils import extract_answer

from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources import open_environment
from env_space.sources.openenv_client import OpenEnvEnvironment
from env_space.sources.settings import OpenEnvConfig
from rlsync.layout import rollout_key, score_key, task_key
from rlsync.spaces.exchange import Sample, get_json, read_samples, write_samples

ROOT = Path(__file__).resolve().parents[2]
SERVED = "reasoning_gym:leg_counting,basic_arithmetic"
SERVER_LIFETIME_S = 120  # the server process stops by itself after this, whatever happens to the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, deadline_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {deadline_s}s")


@pytest.fixture(scope="module")
def served_url():
    """``python -m env_space.sources.openenv_server`` serving two reasoning-gym generators on 127.0.0.1."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)])}
    command = ["timeout", str(SERVER_LIFETIME_S), sys.executable, "-m", "env_space.sources.openenv_server",
               "--environment", SERVED, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, 60, process)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_served_environment_scores_over_openenv_as_reasoning_gym_does(served_url):
    source = open_environment(f"openenv:{served_url}", settings=OpenEnvConfig())
    local = open_environment(SERVED)
    tasks = source.tasks(6, seed=11)
    assert [t.prompt for t in tasks] == [t.prompt for t in source.tasks(6, seed=11)]  # reproducible by seed
    assert {t.meta["type"] for t in tasks} <= {"leg_counting", "basic_arithmetic"}
    for task in tasks:
        reference = local.tasks(1, seed=task.meta["seed"])[0]  # what the server's reset(seed) made
        assert task.prompt == reference.prompt
        entry = reference.meta["entry"]
        verifier = reasoning_gym.create_dataset(entry["metadata"]["source_dataset"], size=1, seed=0)
        for completion in (f"<answer>{reference.answer}</answer>", f"<answer>{reference.answer}1</answer>", "no tags"):
            expected = verifier.score_answer(answer=extract_answer(completion), entry=entry)
            assert source.score(task, completion) == expected
        assert source.score(task, f"<answer>{reference.answer}</answer>") == 1.0
    source.close()


def test_simulator_runs_an_openenv_source_through_the_bucket(served_url, bucket):
    config = EnvConfig(bucket=str(bucket.root), environment=f"openenv:{served_url}", tasks_per_batch=3)
    env = EnvSimulator(config, bucket=bucket)
    local = open_environment(SERVED)
    batch = env.publish_tasks()
    doc = get_json(bucket, task_key(batch))
    samples = []
    for t, task in zip(doc["tasks"], env.environment.tasks(3, seed=doc["seed"])):
        answer = local.tasks(1, seed=task.meta["seed"])[0].answer
        samples += [
            Sample(t["task_id"], t["prompt"], c, [1], [2], [-0.5], 0) for c in (f"<answer>{answer}</answer>", "wrong")
        ]
    write_samples(bucket, rollout_key(batch, "r0"), samples, batch=batch)
    assert env.score_rollouts() == 6
    assert [s.reward for s in read_samples(bucket, score_key(batch, "r0"))[1]] == [1.0, 0.0] * 3
    env.step()
    assert not get_json(bucket, "metrics/env.json")["failures"]
    env.stop()


class GuessAction(Action):
    guess: str


class RiddleObservation(Observation):
    question: str = ""


class UnseededRiddles(Environment):
    """A third-party style OpenEnv environment whose reset ignores the seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.answer = random.randrange(10**9)
        return RiddleObservation(question=f"say {self.answer}")

    def step(self, action, timeout_s=None, **kwargs):
        return RiddleObservation(done=True, reward=float(action.guess == str(self.answer)))

    @property
    def state(self):
        return State()


def test_other_field_names_and_an_unreproducible_reset_count_as_failures(bucket):
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(UnseededRiddles, GuessAction, RiddleObservation, max_concurrent_envs=8),
                                           host="127.0.0.1", port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", 30)
        settings = OpenEnvConfig(prompt_field="question", action_field="guess", type_field="", timeout_s=5)
        source = OpenEnvEnvironment(f"http://127.0.0.1:{port}", settings)
        task = source.tasks(1, seed=0)[0]
        assert task.prompt.startswith("say ") and task.meta["type"] == "openenv"
        env = EnvSimulator(EnvConfig(bucket=str(bucket.root), environment="reverse"), bucket=bucket)
        env.environment = source
        assert env.score_sample(task, task.prompt[4:]) == 0.0  # a new reset gives another riddle: refused, not scored
        assert env.failures.as_dict() == {"score: openenv: reset gave another prompt for the same seed": 1}
        source.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_unreachable_openenv_server_is_counted_and_the_env_keeps_running(bucket):
    env = EnvSimulator(EnvConfig(bucket=str(bucket.root), environment="reverse", poll_s=0.05), bucket=bucket)
    env.environment = OpenEnvEnvironment(
        f"http://127.0.0.1:{_free_port()}", OpenEnvConfig(timeout_s=2)
    )  # nobody listens
    env.start()
    try:
        deadline = time.monotonic() + 20
        while env.failures.total() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert env.running and env.failures.as_dict() == {"step: error:ConnectionError": env.failures.total()}
    finally:
        env.stop()
    assert not env.running
