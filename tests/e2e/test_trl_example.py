"""The README's TRL script (``examples/trl_bucket_sync.py``, the very file) in a fresh venv made only from
its install line (``pip install ./shared[trl]``, see :mod:`tests.fresh_venv` for the CPU torch wheel),
against a local bucket and the tiny offline model, while a replica (a :class:`Subscriber` in this
process) follows it: after the run, the replica's whole state hashes equal to the trained model the
script saved, cast to bf16 as published. Scored rollouts come from :class:`tests.trl_feed.ScoreFeeder`.

About 2-3 minutes on 2 cores, most of it the install (pip's cache shared with the other fresh venvs).
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.tiny_model import tiny_model_path
from tests.fresh_venv import ROOT, clean_env, library_copy, make_venv
from tests.helpers import bf16
from tests.trl_feed import ScoreFeeder

SCRIPT = ROOT / "examples" / "trl_bucket_sync.py"
INSTALL_LINE = '"rlsync[trl] @ git+https://github.com/OWNER/rl-weight-sync#subdirectory=shared"'
STEPS = 3


def test_readme_shows_the_script_and_its_install_line():
    readme = (ROOT / "README.md").read_text()
    assert "examples/trl_bucket_sync.py" in readme and f"pip install {INSTALL_LINE}" in readme
    assert f"pip install {INSTALL_LINE}" in SCRIPT.read_text()


def follow(subscriber: Subscriber, done: threading.Event, applied: list[int]) -> None:
    """Apply every version the trainer publishes until ``done``, then catch up."""
    while True:
        finished = done.is_set()
        while (update := subscriber.fetch()) is not None:
            subscriber.apply(update)
            applied.append(subscriber.step)
        if finished:
            return
        done.wait(0.5)


def test_the_readme_script_runs_in_a_fresh_venv_and_a_replica_follows_bit_exactly(tmp_path):
    from transformers import AutoTokenizer

    library_copy(tmp_path)
    python, _ = make_venv(tmp_path / "venv", "./shared[trl]", cwd=tmp_path)
    model = tiny_model_path(warmup=None)
    bucket = LocalBucket(tmp_path / "bucket")
    out = tmp_path / "out"
    subscriber, applied, done = Subscriber(LocalBucket(tmp_path / "bucket")), [], threading.Event()
    replica = threading.Thread(target=follow, args=(subscriber, done, applied), daemon=True)
    replica.start()
    with ScoreFeeder(bucket, AutoTokenizer.from_pretrained(model), tasks=2, group=4):
        run = subprocess.run(
            [str(python), str(SCRIPT), "--bucket", str(bucket.root), "--model", str(model),
             "--max-steps", str(STEPS), "--batch-size", "8", "--lr", "1e-3", "--output-dir", str(out)],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    done.set()
    replica.join(60)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"trained {STEPS} steps" in run.stdout
    manifest = read_manifest(bucket)
    assert manifest is not None and manifest.step == STEPS  # the initial weights, then one version per step
    assert applied[-1] == STEPS and len(applied) >= 2
    trained = bf16(load_file(out / "model.safetensors"))
    assert state_hash(subscriber.state) == state_hash(trained) == manifest.state_hash
    # the run changed the weights: the replica's state is not the checkpoint it started from
    assert state_hash(bf16(load_file(Path(model) / "model.safetensors"))) != manifest.state_hash
    # run again on the bucket that now holds this run, neither --resume nor --new-run: refused, nothing published
    again = subprocess.run(
        [str(python), str(SCRIPT), "--bucket", str(bucket.root), "--model", str(model), "--max-steps", "1",
         "--output-dir", str(tmp_path / "again")],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode != 0 and "RunExistsError" in again.stderr and "new_run" in again.stderr, again.stderr[-2000:]
    assert read_manifest(bucket).state_hash == manifest.state_hash


def test_the_readme_excerpt_is_lines_of_the_script():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\n", readme.index("Its core (lines of that file")) + len("```python\n")
    excerpt = readme[start : readme.index("```", start)].splitlines()
    script = SCRIPT.read_text().splitlines()
    assert len(excerpt) >= 4 and all(line in script for line in excerpt)
    assert "sync.attach(trainer)" in "\n".join(excerpt)


def test_the_script_is_short_and_names_one_object_of_the_library():
    """The integration is one object: at most 40 lines, at most 3 rlsync names, nothing from Space support."""
    import ast

    tree = ast.parse(SCRIPT.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlsync") for a in n.names]
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlsync")]
    assert len(SCRIPT.read_text().splitlines()) <= 40 and 1 <= len(names) <= 3 and names == ["BucketSync"]
    assert not any(m.startswith("rlsync.spaces") for m in modules)
