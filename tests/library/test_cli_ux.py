"""``rlsync`` as a new user meets it: ``inspect`` takes the keys ``ls`` prints (an anchor folder)
and the pointer ``latest.json``; ``diff`` of two anchors records their own steps; long commands
show progress bars on stderr on a terminal or when asked (``--progress``), and stay quiet otherwise."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

import pytest

from rlsync.bucket import LocalBucket
from rlsync.protocol import FixedInterval, Publisher
from tests.helpers import master_state, rl_step
from tests.library.test_cli import ROOT, cli


@pytest.fixture(scope="module")
def bucket_dir(tmp_path_factory):
    """Seven publishes, an anchor every third: anchors 3 and 6 retained, deltas up to step 6."""
    root = tmp_path_factory.mktemp("bucket")
    master = master_state()
    pub = Publisher(LocalBucket(root), policy=FixedInterval(3), keep_anchors=2)
    for step in range(7):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
    return root


@pytest.fixture(scope="module")
def anchor_keys(bucket_dir) -> dict[int, str]:
    """The anchor folder keys that ``rlsync ls`` prints, by step."""
    out = cli("ls", str(bucket_dir)).stdout
    return {int(step): key for step, key in re.findall(r"^\s*(\d+) anchor\s+[\d,]+\s+(\S+/)$", out, re.M)}


def test_inspect_takes_the_anchor_folder_key_that_ls_prints(bucket_dir, anchor_keys):
    keys = anchor_keys
    assert sorted(keys) == [3, 6]
    r = cli("inspect", str(bucket_dir / keys[6]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("anchor folder: ") and "1 file(s)" in r.stdout
    assert "kind: anchor" in r.stdout and "step: 6" in r.stdout and "model.layers.0.mlp.up_proj.weight" in r.stdout


def test_inspect_latest_json_shows_the_pointer(bucket_dir):
    r = cli("inspect", str(bucket_dir / "latest.json"))
    assert r.returncode == 0, r.stderr
    assert "kind: pointer" in r.stdout and "newest step: 6" in r.stdout and "anchors: 3, 6" in r.stdout
    assert "deltas: " in r.stdout and "catch-up for a new replica: " in r.stdout
    (bucket_dir.parent / "broken.json").write_text('{"format": "rlsync", "step": "x"}')
    r = cli("inspect", str(bucket_dir.parent / "broken.json"))
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "header" not in r.stderr


def test_diff_of_anchors_takes_their_steps_and_apply_reproduces_the_newer(bucket_dir, anchor_keys, tmp_path):
    keys = anchor_keys
    old, new = bucket_dir / keys[3] / "model.safetensors", bucket_dir / keys[6] / "model.safetensors"
    patch, out = tmp_path / "p.safetensors", tmp_path / "out.safetensors"
    assert cli("diff", str(old), str(new), "-o", str(patch)).returncode == 0
    r = cli("inspect", str(patch))
    assert "step: 6\n" in r.stdout and "base_step: 3\n" in r.stdout
    assert cli("diff", str(old), str(new), "-o", str(patch), "--step", "9").returncode == 0  # told: the flag wins
    assert "step: 9\n" in cli("inspect", str(patch)).stdout
    assert cli("apply", str(old), str(patch), "-o", str(out)).returncode == 0
    assert out.read_bytes() == new.read_bytes()


def test_progress_bars_on_stderr_only_when_asked(bucket_dir, anchor_keys, tmp_path):
    keys = anchor_keys
    old, new = bucket_dir / keys[3] / "model.safetensors", bucket_dir / keys[6] / "model.safetensors"
    patch = tmp_path / "p.safetensors"
    quiet = cli("verify", str(bucket_dir))
    assert quiet.returncode == 0 and quiet.stderr == ""  # not a terminal: no bar
    r = cli("--progress", "verify", str(bucket_dir))
    assert r.returncode == 0 and r.stdout == quiet.stdout and re.search(r"verify: 100%\|.*\| [\d.]+k?/[\d.]+k?", r.stderr)
    r = cli("--progress", "diff", str(old), str(new), "-o", str(patch))
    assert r.returncode == 0 and "diff: write: 100%" in r.stderr and "4/4" in r.stderr
    r = cli("--progress", "apply", str(old), str(patch), "-o", str(tmp_path / "o.safetensors"))
    assert r.returncode == 0 and re.search(r"apply: 100%\|.*\| 5/5", r.stderr)
    r = cli("diff", str(old), str(new), "-o", str(patch))
    assert r.returncode == 0 and r.stderr == ""


def test_progress_bars_by_default_on_a_terminal(bucket_dir):
    leader, follower = os.openpty()  # stderr a terminal (80 columns, as tqdm reads its width), stdout a pipe
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        r = subprocess.run([sys.executable, "-m", "rlsync", "verify", str(bucket_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=follower, text=True, timeout=120)  # fmt: skip
        os.close(follower)
        follower = -1
        err = b""
        while chunk := _read(leader):
            err += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert r.returncode == 0 and r.stdout.startswith("OK: ") and b"verify: 100%" in err


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the terminal's other end is closed and drained
        return b""
