"""``--help`` of every documented command prints its usage and nothing else: no warning of a pinned
dependency (TRL's experimental-API and vLLM-version warnings, vLLM's CPU Triton notice are silenced by
``rlsync.trl``), and none of them imports torch, transformers, safetensors or gradio before it
has read its flags (checked with ``-X importtime``, not with a timing): ``--help`` answers at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "gradio", "transformers", "safetensors")


def _help(*args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    env = dict(os.environ, PYTHONWARNINGS="default")  # every warning shown once: none may be there
    return subprocess.run([sys.executable, *flags, *args, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


COMMANDS = [
    ("app.py",), ("-m", "rlsync"), ("-m", "trainer_space"), ("-m", "rollout_space"), ("-m", "env_space"),
    ("-m", "rlsync.spaces.deploy"),
]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_help_prints_usage_and_nothing_else(command):
    run = _help(*command)
    assert run.returncode == 0 and run.stdout.startswith("usage:")
    assert run.stderr == ""


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_help_imports_no_torch_or_gradio(command):
    run = _help(*command, importtime=True)
    assert run.returncode == 0
    imported = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", run.stderr, re.M)}
    assert "argparse" in imported  # the check sees imports at all
    assert not {name for name in imported if name.split(".")[0] in HEAVY}
