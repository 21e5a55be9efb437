"""The compiled codecs on any x86-64: built for a generic one (``NUMBA_CPU_NAME=generic``: no AVX-512, no BMI2,
so no ``pdep`` and no wide vectors), the codec tests pass and the files written are the default build's, byte
for byte (:mod:`tests.codec_digest`).

numba compiles for the machine it runs on unless told otherwise, so without this a CI machine decides which
paths of ``rlsync.codecs.rice_kernels`` are ever tested. Each check runs in a child process with its own numba
cache folder (a cache entry is keyed by the CPU it was compiled for, and the child's must not be reused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.codec_digest import corpus_digests

ROOT = Path(__file__).resolve().parents[2]
#: The codec test files run compiled for a generic CPU: the kernels' own tests and the state hash's.
CODEC_TESTS = [
    "tests/library/test_codec_classrice.py",
    "tests/library/test_classrice_blocks.py",
    "tests/library/test_codec_classgap.py",
    "tests/library/test_state_hash.py",
    "tests/library/test_codec_threads.py",
]


@pytest.fixture(scope="module")
def generic_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a child compiled for a generic CPU, its numba cache shared by this module's children."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp("numba-generic")))
    env.pop("NUMBA_CPU_FEATURES", None)  # generic: numba then compiles for no optional feature at all
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_a_generic_build_writes_the_same_files_as_this_machines(tmp_path, generic_env):
    child = subprocess.run(
        [sys.executable, "-m", "tests.codec_digest", str(tmp_path / "generic")],
        cwd=ROOT, env=generic_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    generic = json.loads(child.stdout.strip().splitlines()[-1])
    assert generic["cpu_name"] == "generic" and generic["has_pdep"] is False  # the portable paths ran
    here = corpus_digests(tmp_path / "here")
    assert len(here) == 10 and generic["digests"] == here


@pytest.mark.parametrize("test_file", CODEC_TESTS)
def test_the_codec_tests_pass_compiled_for_a_generic_cpu(generic_env, test_file):
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", test_file],
        cwd=ROOT, env=generic_env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout
