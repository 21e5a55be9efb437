"""Fresh virtual environments for the user-path tests: what a user gets from one install line.

Each venv is made with ``python -m venv`` (no site packages of the test venv) and filled by one
``pip install``. The one substitution, for CPU machines: the root ``requirements.txt`` (the versions
the project is tested with, ``torch==2.13.0``, which this machine's pip mirror serves as the CPU build
``2.13.0+cpu``) is passed as a constraints file (``-c``), so a line like ``torch==2.13.0`` or
``torch>=2.4`` resolves to the CPU wheel instead of PyPI's CUDA build, and nothing is upgraded beyond
what CI tests. Constraints only pin versions; they add no package. Pip's cache is pip's own
(``~/.cache/pip``), shared by every venv of a run. Pip makes no retries (``PIP_RETRIES=0``): an index
this machine cannot reach (the env Space's ``download.pytorch.org`` line) fails at once instead of
after pip's back-off, and the wheel comes from the mirror. ``--no-compile``: Python compiles what it
imports when it imports it, and compiling all of torch ahead is most of an install's CPU time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "requirements.txt"
INSTALL_TIMEOUT_S = 900


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would reach the test venv or the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def library_copy(dest: Path) -> Path:
    """A copy of ``shared/`` (the ``rlsync`` distribution's source) at ``dest/shared``, without build leftovers:
    ``pip install ./shared`` then builds there, never in the checkout, and no stale ``build/`` reaches the wheel."""
    target = dest / "shared"
    shutil.copytree(ROOT / "shared", target, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return target


def make_venv(path: Path, *install_args: str, cwd: Path = ROOT) -> tuple[Path, float]:
    """Create a venv at ``path`` and run ``pip install -c requirements.txt INSTALL_ARGS`` in it.

    Args:
        path: The venv folder (must not exist).
        install_args: What the user's install line installs (``"./shared[trl]"``, ``"-r", "requirements.txt"``).
        cwd: Where pip runs (relative paths in ``install_args`` are relative to it).

    Returns:
        The venv's ``python`` and the seconds the venv and the install took.
    """
    start = time.monotonic()
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(path)], check=True, env=clean_env())
    python = path / "bin" / "python"
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", "-c", str(CONSTRAINTS), *install_args],
        cwd=cwd, env=clean_env(PIP_RETRIES="0"), capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    if result.returncode != 0:
        raise AssertionError(f"pip install {' '.join(install_args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return python, time.monotonic() - start
