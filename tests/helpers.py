"""Small synthetic models and RL-like updates for tests."""

from __future__ import annotations

import ast
import contextlib
import shutil
import threading
from pathlib import Path
from typing import Iterator

import torch

from rlsync.bucket.base import BucketWrapper
from rlsync.layout import DELTA_PREFIX


def master_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of a toy model (plus an integer buffer)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 48, generator=g) * 0.02,
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=g) * 0.02,
        "model.norm.weight": 1 + torch.randn(48, generator=g) * 0.02,
        "lm_head.weight": torch.randn(40, 48, generator=g) * 0.02,
        "model.step_counter": torch.tensor([0], dtype=torch.int64),
    }


def rl_step(master: dict[str, torch.Tensor], seed: int, scale: float = 2e-4) -> None:
    """An in-place update that flips a few percent of the bf16 weights."""
    g = torch.Generator().manual_seed(10_000 + seed)
    for name, t in master.items():
        if t.is_floating_point():
            t += torch.randn(t.shape, generator=g) * scale
    master["model.step_counter"] += 1


def sparse_rl_step(master: dict[str, torch.Tensor], seed: int) -> None:
    """Change ~3% of the elements of every tensor, by noise of the weights' own scale (every tensor is touched:
    packed parts, embeddings, norms)."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() * 3 // 100)]
        flat[idx] += torch.randn(idx.numel(), generator=g) * 0.02


def publish_sparse_run(model_dir: Path, bucket, deltas: int, seed: int) -> list:
    """Publish a model folder's checkpoint to ``bucket`` as an anchor (version 0), then ``deltas`` deltas of
    :func:`sparse_rl_step`; returns the publish records."""
    from safetensors.torch import load_file

    from rlsync.protocol import FixedInterval, Publisher

    pub = Publisher(bucket, policy=FixedInterval(100))
    master = {n: t.float() for n, t in load_file(str(model_dir / "model.safetensors")).items()}
    records = []
    for step in range(deltas + 1):
        if step:
            sparse_rl_step(master, seed + step)
        records.append(pub.publish(step, master))
    assert [r.kind for r in records] == ["anchor"] + ["delta"] * deltas
    return records


def bucket_backend_update(llm, step: int | None) -> None:
    """One weight update of a vLLM ``LLM`` through its ``bucket`` weight-transfer backend (``None``: the newest
    version), as ``vllm serve``'s update routes run it."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": step}})
    llm.finish_weight_update()
    llm.reset_prefix_cache()


def snapshot_in_hub_cache(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """Copy a model folder into a local Hub cache as the ``main`` snapshot of ``repo_id`` (the layout
    huggingface_hub writes: ``models--OWNER--NAME/{refs/main, snapshots/COMMIT/}``); returns the snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cast floating-point tensors as the publisher serves them."""
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for n, t in state.items()}


def files_under(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` with its bytes: compare before and after to show nothing was written."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def parse_module(path) -> "ast.Module":
    """``ast.parse`` of the file at ``path``, tried again on CPython 3.11's ``SystemError: AST constructor
    recursion depth mismatch`` (its ``ast`` keeps the recursion depth in global state: a parse racing
    another thread's parse, e.g. of a role a previous test left running, fails spuriously)."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text(), filename=str(path))
        except SystemError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


class GatedBucket(BucketWrapper):
    """Delta uploads wait until :attr:`gate` is set (a slow upload); ``fail`` makes them raise."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.fail: Exception | None = None

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(DELTA_PREFIX):
            self.waiting.set()
            self.gate.wait(60)
            if self.fail is not None:
                raise self.fail
        self.inner.put(key, data)


def hostile_fp8_chain(bucket, state: dict[str, torch.Tensor], name: str, value) -> dict[str, torch.Tensor]:
    """An FP8 chain (``rlsync.fp8``) by a publisher that writes whatever it is given (as an attacker with write
    access would): version 0 ``state`` (the trainer's quantization), version 1 the same with ``value`` at one
    element of ``name`` (an ``int``: that e4m3 bit pattern); its hashes consistent. Returns version 1."""
    from rlsync.fp8 import FP8_DTYPE, chain_metadata, fp8_bucket
    from rlsync.protocol import FixedInterval, Publisher

    pub = Publisher(fp8_bucket(bucket), dtype=None, metadata=chain_metadata(), policy=FixedInterval(100), allow_non_finite=True)
    pub.publish(0, state)
    bad = {n: t.clone() for n, t in state.items()}
    flat = bad[name].reshape(-1)
    flat[1] = value if not isinstance(value, int) else torch.tensor([value], dtype=torch.uint8).view(FP8_DTYPE)[0]
    pub.publish(1, bad)
    return bad


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: str, bucket: Path, root: Path, flags: list[str], timeout_s: float = 300.0) -> Iterator[str]:
    """A ``python -m rlsync.vllm.serve MODEL FLAGS`` process (``vllm serve``, CPU settings) following ``bucket``;
    yields its URL once it answers ``/health``, and stops it (its whole process group) after. ``flags`` must
    bind 127.0.0.1 on a free port; the server's log is ``root/serve.log``."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import pytest

    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", VLLM_SERVER_DEV_MODE="1", ROLLOUT_BUCKET=str(bucket))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "shared"), env.get("PYTHONPATH", "")])
    log = root / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlsync.vllm.serve", model, *flags],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{flags[flags.index('--port') + 1]}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def hub_buckets(hub, bucket_id: str, token: str):
    """Create `bucket_id` on the Hub stand-in `hub` (the conftest fixture) with `token` allowed to write it;
    returns ``open(meter=None)``, which opens an :class:`~rlsync.bucket.hf.HfBucket` on it (unpaced unless
    given a meter)."""
    from rlsync.bucket.budget import BudgetConfig, RequestMeter
    from rlsync.bucket.hf import HfBucket

    hub.add_token(token)
    hub.create_bucket(bucket_id)
    return lambda meter=None: HfBucket(bucket_id, token=token, meter=meter or RequestMeter(BudgetConfig(enabled=False)))
