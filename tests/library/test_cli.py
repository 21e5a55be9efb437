"""``python -m rlsync``: diff/apply byte for byte on real Hugging Face checkpoints, inspect, ls, verify."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlsync.layout import delta_key
from rlsync.protocol import FixedInterval, Publisher
from tests.helpers import master_state, rl_step

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsync", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two real checkpoints written by transformers' save_pretrained, one optimizer step apart."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root / "old")
    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, 96, (4, 16))
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    model.to(torch.bfloat16).save_pretrained(root / "new")
    return root / "old" / "model.safetensors", root / "new" / "model.safetensors"


@pytest.mark.parametrize("codec", ["gapzz", "trl"])
def test_diff_then_apply_reproduces_checkpoint_byte_for_byte(checkpoints, tmp_path, codec):
    old, new = checkpoints
    patch, out = tmp_path / "p.safetensors", tmp_path / "out.safetensors"
    r = cli("diff", str(old), str(new), "-o", str(patch), "--codec", codec)
    assert r.returncode == 0, r.stderr
    if codec == "gapzz":
        assert patch.stat().st_size < new.stat().st_size / 4
    r = cli("apply", str(old), str(patch), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == new.read_bytes()


def test_inspect_reports_kind_steps_and_sparsity(checkpoints, tmp_path):
    old, new = checkpoints
    patch = tmp_path / "p.safetensors"
    assert cli("diff", str(old), str(new), "-o", str(patch), "--step", "7", "--base-step", "6").returncode == 0
    r = cli("inspect", str(patch))
    assert r.returncode == 0, r.stderr
    assert "kind: delta" in r.stdout and "step: 7" in r.stdout and "base_step: 6" in r.stdout
    assert "changed:" in r.stdout and "model.layers.0.mlp.up_proj.weight" in r.stdout
    r = cli("inspect", str(new))
    assert r.returncode == 0 and "plain safetensors" in r.stdout and "lm_head.weight" in r.stdout


def test_apply_to_wrong_base_fails_without_output(checkpoints, tmp_path):
    old, new = checkpoints
    patch, out = tmp_path / "p.safetensors", tmp_path / "out.safetensors"
    assert cli("diff", str(old), str(new), "-o", str(patch)).returncode == 0
    r = cli("apply", str(new), str(patch), "-o", str(out))
    assert r.returncode != 0 and "error:" in r.stderr and "base" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_errors_are_clear_and_leave_no_partial_output(checkpoints, tmp_path):
    old, _ = checkpoints
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(old.read_bytes()[:1000])
    out = tmp_path / "p.safetensors"
    r = cli("diff", str(old), str(truncated), "-o", str(out))
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
    assert not out.exists()
    r = cli("apply", str(old), str(tmp_path / "missing.safetensors"), "-o", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr and not out.exists()


def test_ls_and_verify_bucket(tmp_path):
    bucket_dir = tmp_path / "bucket"
    from rlsync.bucket import LocalBucket

    bucket = LocalBucket(bucket_dir)
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(3))
    for step in range(5):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    r = cli("ls", str(bucket_dir))
    assert r.returncode == 0, r.stderr
    assert "newest step: 4" in r.stdout and r.stdout.count("anchor") >= 2 and "deltas/000000000004-e0001.safetensors" in r.stdout
    r = cli("verify", bucket_dir.as_uri())
    assert r.returncode == 0 and "OK: 2 anchor(s) and 4 delta(s)" in r.stdout
    path = bucket_dir / delta_key(4, 1)
    path.write_bytes(path.read_bytes()[:-10])
    r = cli("verify", str(bucket_dir))
    assert r.returncode == 1 and "verification failed" in r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("ls", str(tmp_path / "empty"))
    assert r.returncode == 1 and "no pointer" in r.stderr
