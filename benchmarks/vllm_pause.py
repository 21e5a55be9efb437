"""How long a ``vllm serve`` server idles per sync: the ``keep`` pause against the ``wait`` drain, one run.

Starts ``python -m rlsync.vllm.serve`` (vLLM CPU here) on the tiny offline model's architecture
(:mod:`rlsync.spaces.tiny_model`), widened by default to 155M parameters (``--hidden 2048 --layers 4``: the
apply then outweighs the fixed cost of a pause, vLLM's own 20 ms wait in ``pause_generation`` and six HTTP
calls; ``--hidden 0 --layers 0`` is the 0.4M-parameter model itself) with the ``bucket`` backend and
``--enable-scale-out`` (``/inference/v1/generate``, whose choices carry each token's weight version),
publishes an anchor and one sparse delta per sync to a local bucket, and per sync: sends ``--requests``
concurrent completions of ``--tokens`` tokens (``ignore_eos``) once the update is prepared (downloaded and
decoded by the workers, :meth:`~rlsync.vllm.client.BucketSyncClient.prepare`), waits ``--at`` of the batch's
unpaused time, then :class:`~rlsync.vllm.client.BucketSyncClient` syncs the server, alternating
:class:`~rlsync.vllm.client.PauseMode` ``wait`` (today's drain: no new request admitted until every one in
flight has finished) and ``keep`` (the in-flight requests frozen for the apply). It prints the server's
idle per sync, from ``/pause`` to ``/resume`` (what the client measures), against the apply (the workers'
own write of the prepared update inside the pause), and how many completions span the update
(:func:`~rlsync.vllm.versions.completion_versions`: first and last version differ). The client does not
re-hash after each sync (``verify=False``): that runs after the resume, outside the pause measured here.

    python -m benchmarks.vllm_pause                  # ~4 min on 2 cores (the model's build, the server's start)
    python -m benchmarks.vllm_pause --hidden 1024 --syncs 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "reverse 1234567 ="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, bucket: Path, log: Path, max_len: int) -> tuple[subprocess.Popen, str]:
    """``python -m rlsync.vllm.serve`` on 127.0.0.1 (CPU settings); returns the process and its URL once healthy."""
    import httpx

    port = free_port()
    flags = [
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
        "--max-model-len", str(max_len), "--weight-transfer-config", '{"backend": "bucket"}',
        "--worker-extension-cls", "rlsync.vllm.worker.SyncWorkerExtension", "--enable-scale-out",
    ]  # fmt: skip
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", VLLM_SERVER_DEV_MODE="1", ROLLOUT_BUCKET=str(bucket))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "shared"), str(ROOT), env.get("PYTHONPATH", "")])
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlsync.vllm.serve", str(model), *flags],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(server)
    raise SystemExit(f"vllm serve not ready after 600 s:\n{log.read_text()[-3000:]}")


def stop_server(server: subprocess.Popen) -> None:
    """Stop the server's whole process group (vLLM's engine runs in a child process): asked, then killed."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
        os.killpg(server.pid, sig)
        try:
            server.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def rl_step(master: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> None:
    """Move ``fraction`` of every tensor's elements by noise of the weights' scale (a sparse RL step)."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        flat[idx] += torch.randn(idx.numel(), generator=g) * 0.02


class Batch:
    """``n`` concurrent completions through ``/inference/v1/generate``, each on its own thread."""

    def __init__(self, url: str, model: str, prompt_ids: list[int], n: int, tokens: int) -> None:
        import httpx

        self.choices: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        body = {
            "model": model, "token_ids": prompt_ids,
            "sampling_params": {"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
        }  # fmt: skip

        def one(seed: int) -> None:
            try:
                request = dict(body, sampling_params=dict(body["sampling_params"], seed=seed))
                response = httpx.post(f"{url}/inference/v1/generate", json=request, timeout=600)
                response.raise_for_status()
                with self._lock:
                    self.choices += response.json()["choices"]
            except Exception as exc:  # reported with the figures
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

        self.threads = [threading.Thread(target=one, args=(seed,), daemon=True) for seed in range(n)]
        self.t0 = time.perf_counter()
        for thread in self.threads:
            thread.start()

    def join(self) -> float:
        """Wait for every completion; the batch's wall time."""
        for thread in self.threads:
            thread.join()
        return time.perf_counter() - self.t0


def timed_client(url: str, bucket: str, mode: Any) -> Any:
    """A :class:`~rlsync.vllm.client.BucketSyncClient` that also times each HTTP call it makes (``calls``)."""
    from rlsync.vllm.client import BucketSyncClient

    client = BucketSyncClient(url, bucket, pause_mode=mode, verify=False)
    client.calls, post = [], client.server.post

    def timed_post(path: str, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return post(path, **kwargs)
        finally:
            client.calls.append((path, time.perf_counter() - t0))

    client.server.post = timed_post
    return client


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="concurrent completions per sync")
    parser.add_argument("--tokens", type=int, default=160, help="tokens per completion (128+)")
    parser.add_argument("--syncs", type=int, default=3, help="syncs per pause mode (alternating)")
    parser.add_argument("--hidden", type=int, default=2048, help="the tiny model's hidden size (0: its own, 128)")
    parser.add_argument("--layers", type=int, default=4, help="the tiny model's layers (0: its own, 2)")
    parser.add_argument("--at", type=float, default=0.3, help="sync once this share of the batch's time has passed")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlsync-vllm-pause-") as work:
        rows = run(args, Path(work))
    report(rows)


def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlsync.bucket import LocalBucket
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.spaces.tiny_model import build_tiny_model
    from rlsync.vllm.client import PauseMode
    from rlsync.vllm.versions import completion_versions

    overrides: dict[str, Any] = {"max_position_embeddings": 512}
    if args.hidden:
        overrides.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    model = build_tiny_model(work / "model", config_overrides=overrides)
    master = {n: t.float() for n, t in load_file(model / "model.safetensors").items()}
    params = sum(t.numel() for t in master.values())
    prompt_ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    bucket = work / "bucket"
    publisher = Publisher(LocalBucket(bucket), policy=FixedInterval(1000))
    publisher.publish(0, master)
    server, url = start_server(model, bucket, work / "serve.log", max_len=512)
    rows = []
    try:
        client = timed_client(url, str(bucket), PauseMode.KEEP)  # one client: the server's engine is initialised once
        client.sync()
        warm = Batch(url, str(model), prompt_ids, args.requests, args.tokens)
        gen_s = warm.join()  # an unpaused batch: when to sync
        if warm.errors:
            raise SystemExit(f"generation failed: {warm.errors[0]}")
        print(f"{params / 1e6:.2f}M parameters; {args.requests} x {args.tokens} tokens take {gen_s:.2f} s unpaused")
        for i in range(2 * args.syncs):
            mode = (PauseMode.WAIT, PauseMode.KEEP)[i % 2]
            client.pause_mode, step = mode, i + 1
            rl_step(master, seed=step)
            publisher.publish(step, master)
            assert client.prepare() == step  # downloaded and decoded before the batch: the sync pauses at once
            batch = Batch(url, str(model), prompt_ids, args.requests, args.tokens)
            time.sleep(args.at * gen_s)
            client.calls = []
            t0 = time.perf_counter()
            assert client.sync() == step
            sync_s = time.perf_counter() - t0
            in_flight = sum(thread.is_alive() for thread in batch.threads)  # still generating after the sync
            idle_s, [status] = client.pauses[0], client.transfer_status()
            pause_calls = {path: round(s * 1e3, 1) for path, s in client.calls if path != "/collective_rpc"}
            wall_s = batch.join()
            if batch.errors:
                raise SystemExit(f"generation failed during a {mode.value} sync: {batch.errors[0]}")
            versions = [completion_versions(c["weight_versions"]) for c in batch.choices]
            assert all(len(c["token_ids"]) == args.tokens for c in batch.choices)
            rows.append({
                "mode": mode.value, "step": step, "idle_s": idle_s, "apply_s": status.pause.s, "sync_s": sync_s,
                "batch_s": wall_s, "requests": len(batch.choices), "in_flight": in_flight,
                "spanning": sum(v.spans_update for v in versions),
                "first": min(v.first for v in versions), "last": max(v.last for v in versions), "pause_ms": pause_calls,
            })  # fmt: skip
            print(json.dumps(rows[-1]))
        client.close()
    finally:
        stop_server(server)
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    print("| pause | syncs | idle per sync (median) | apply (median) | idle / apply | completions spanning the update |")
    print("|---|---|---|---|---|---|")
    for mode in ("wait", "keep"):
        mine = [r for r in rows if r["mode"] == mode]
        idle, apply = statistics.median(r["idle_s"] for r in mine), statistics.median(r["apply_s"] for r in mine)
        ratios = [r["idle_s"] / r["apply_s"] for r in mine]
        print(
            f"| {mode} | {len(mine)} | {idle * 1e3:.1f} ms | {apply * 1e3:.1f} ms "
            f"| {statistics.median(ratios):.2f}x (worst {max(ratios):.2f}x) "
            f"| {sum(r['spanning'] for r in mine)} of {sum(r['requests'] for r in mine)} |"
        )


if __name__ == "__main__":
    main()
