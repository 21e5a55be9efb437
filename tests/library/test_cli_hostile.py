"""Issue 11: every CLI command on every hostile file gives one ``error:`` line, a non-zero
exit, no output file, in bounded time and memory.

All calls run in one child process (importing torch once) under an address-space limit
(``RLIMIT_AS``); the child reports each call's exit code, output and time, and its peak
RSS, and the test asserts ceilings on both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hostile_files import INSPECTABLE, make_buckets, make_patches

ROOT = Path(__file__).resolve().parents[2]
ADDRESS_SPACE_LIMIT = 3 << 30  # the child dies with MemoryError rather than taking the machine
PEAK_RSS_CEILING = 1 << 30  # bytes above the imported libraries, over all calls together
CALL_SECONDS_CEILING = 20.0  # CPU seconds of any single call (not wall time: a loaded machine is not a hostile file); the quadratic cases took 25 s to hours
CHILD_TIMEOUT_S = 300

DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, logging, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    sys.path.insert(0, {root!r})
    from rlsync.cli import main
    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the libraries, before any call
    results = []
    for argv in json.loads(sys.stdin.read()):
        out, err = io.StringIO(), io.StringIO()
        logging.getLogger().handlers.clear()  # main() configures logging to this call's stderr
        t0 = time.process_time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
        results.append({{"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                         "seconds": time.process_time() - t0}})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({{"results": results, "peak_rss": peak, "imported_rss": imported}}))
    """
)


def run_all(calls: list[list[str]]) -> tuple[list[dict], int]:
    """Run CLI calls in one bounded child; returns per-call results and the peak RSS in bytes the
    calls added to what importing the libraries took (torch alone is several hundred MB)."""
    script = DRIVER.format(limit=ADDRESS_SPACE_LIMIT, root=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(calls), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["results"], report["peak_rss"] - report["imported_rss"]


def assert_one_error_line(result: dict) -> None:
    assert result["rc"] == 1, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unexpected" not in lines[0], result
    assert len(lines[0]) < 1000, result
    assert "Traceback" not in result["stderr"] and result["stdout"] == "", result
    assert all(c.isprintable() for c in lines[0]), result


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[dict[str, Path], dict[str, Path], Path]:
    root = tmp_path_factory.mktemp("hostile")
    return make_patches(root / "files"), make_buckets(root / "buckets"), root / "out"


def test_every_command_on_every_hostile_file(hostile) -> None:
    files, buckets, out = hostile
    out.mkdir()
    hostile_files = {k: v for k, v in files.items() if k not in ("old", "new", "patch")}
    calls, expect = [], []
    for name, path in hostile_files.items():
        calls.append(["apply", str(files["old"]), str(path), "-o", str(out / f"apply-{name}")])
        expect.append(("apply", name, out / f"apply-{name}"))
        calls.append(["diff", str(files["old"]), str(path), "-o", str(out / f"diff-{name}")])
        expect.append(("diff", name, out / f"diff-{name}"))
        calls.append(["diff", str(path), str(files["new"]), "-o", str(out / f"diff-old-{name}")])
        expect.append(("diff", name, out / f"diff-old-{name}"))
        calls.append(["inspect", str(path)])
        expect.append(("inspect", name, None))
    for name, path in buckets.items():
        for command in ("ls", "verify"):
            calls.append([command, str(path)])
            expect.append((command, name, None))
    calls.append(["apply", str(files["old"]), str(files["patch"]), "-o", str(out / "good")])
    expect.append(("apply", "good", out / "good"))
    results, peak = run_all(calls)
    refused = 0
    for (command, name, output), result in zip(expect, results):
        assert result["seconds"] < CALL_SECONDS_CEILING, (command, name, result["seconds"])
        succeeds = (
            (command == "inspect" and name in INSPECTABLE)
            or (command in ("ls", "verify") and name == "good")
            or (command == "ls" and name in ("delta_6GB_sparse", "shard_links_dev_zero"))
            or (command == "apply" and name == "good")
        )
        if succeeds:
            assert result["rc"] == 0 and result["stdout"], (command, name, result)
            assert all(c.isprintable() for line in result["stdout"].splitlines() for c in line), (command, name)
        else:
            assert_one_error_line(result)
            refused += 1
        if output is not None:
            assert output.exists() == succeeds, (command, name)
    assert not [p for p in out.iterdir() if p.name != "good"], "a refused command left a file"
    assert (out / "good").read_bytes() == files["new"].read_bytes()  # the untampered patch still reproduces NEW
    print("PEAK", peak / 2**20)
    assert peak < PEAK_RSS_CEILING, f"peak RSS {peak / 2**20:.0f} MiB"
    assert refused >= 4 * len(hostile_files) - 2 * len(INSPECTABLE)


def test_ls_escapes_control_characters(hostile) -> None:
    """Finding 9: control characters in run_id reached the terminal."""
    _, buckets, _ = hostile
    (result,), _ = run_all([["ls", str(buckets["good"])]])
    assert result["rc"] == 0 and "\x1b" not in result["stdout"] and "\x07" not in result["stdout"]
    assert "run: run\\x1b[31mRED\\x07" in result["stdout"]


def test_read_only_commands_create_nothing(hostile, tmp_path: Path) -> None:
    results, _ = run_all([["ls", str(tmp_path / "typo")], ["verify", (tmp_path / "typo2").as_uri()]])
    for result in results:
        assert_one_error_line(result)
    assert not (tmp_path / "typo").exists() and not (tmp_path / "typo2").exists()
