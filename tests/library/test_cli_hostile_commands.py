"""Hostile files and arguments for the file format and the CLI (issue 26: high 5, medium 5 and 6, low 3)."""

from __future__ import annotations

import base64
import os
import stat
import struct

import pytest
import safetensors.torch
import torch
import zstandard

from rlsync import format as fmt
from rlsync.cli import main
from rlsync.commands import FILE_HASH_KEY, HEADER_KEY
from rlsync.errors import FormatError
from rlsync.delta_format import encode_delta
from rlsync.format import MAX_HEADER_ENTRIES, parse_header


@pytest.fixture
def pair(tmp_path):
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    w = torch.arange(64, dtype=torch.float32).to(torch.bfloat16)
    safetensors.torch.save_file({"w": w}, old)
    w2 = w.clone()
    w2[3] += 1
    safetensors.torch.save_file({"w": w2}, new)
    return old, new


def _header(entries: int) -> bytes:
    body = ",".join(f'"{i:x}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(entries))
    head = ("{" + body + "}").encode()
    return struct.pack("<Q", len(head)) + head


def test_a_header_of_many_tiny_entries_is_refused_before_it_is_parsed(monkeypatch):
    """High 5: a 98 MB header of tiny entries cost 17.7 s and 3.9 GB; its entries are now counted first."""
    parse_header(_header(1000))  # a plain header passes
    parsed = []
    monkeypatch.setattr(fmt, "loads_bounded", lambda *a, **k: parsed.append(1))
    with pytest.raises(FormatError, match="entries, more than"):
        parse_header(_header(MAX_HEADER_ENTRIES + 1))
    assert parsed == []  # refused from a byte count, before any JSON parse


@pytest.mark.parametrize("header", [b"\x01\x02", b"", b"\x00" * 7])
def test_apply_of_a_patch_whose_stored_file_header_is_cut_short_exits_1(tmp_path, pair, capsys, header):
    """Medium 6: a 2-byte stored header crashed apply with a struct error (exit 2)."""
    old, new = pair
    base = safetensors.torch.load_file(old)
    target = safetensors.torch.load_file(new)
    from rlsync.detect import ChangeDetector
    from rlsync.hashing import state_hash

    detector = ChangeDetector(dtype=None)
    detector.published = base
    data = encode_delta(
        detector.diff(target), step=1, base_step=0, base_hash=state_hash(base), state_hash=state_hash(target), total=64,
        extra_metadata={HEADER_KEY: base64.b64encode(zstandard.compress(header)).decode(), FILE_HASH_KEY: "0" * 64},
    )  # fmt: skip
    patch = tmp_path / "p.safetensors"
    patch.write_bytes(data)
    assert main(["apply", str(old), str(patch), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unexpected" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_diff_and_apply_refuse_to_replace_a_target_that_is_not_a_regular_file(tmp_path, pair, capsys, kind):
    """Medium 5: ``-o`` onto a FIFO or device replaced it with a regular file."""
    old, new = pair
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(b"keep")
        target.symlink_to(tmp_path / "elsewhere")
    before = os.lstat(target).st_mode
    assert main(["diff", str(old), str(new), "-o", str(target)]) == 1
    patch = tmp_path / "p.safetensors"
    assert main(["diff", str(old), str(new), "-o", str(patch)]) == 0
    assert main(["apply", str(old), str(patch), "-o", str(target)]) == 1
    assert os.lstat(target).st_mode == before and not stat.S_ISREG(before)
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("steps", [["--step", "-5"], ["--step", str(10**23)], ["--step", "3", "--base-step", "3"],
                                   ["--base-step", "-1"]])  # fmt: skip
def test_diff_refuses_steps_that_apply_would_refuse(tmp_path, pair, steps, capsys):
    """Low 3: ``--step 1e23`` or ``--step -5`` wrote a patch that ``apply`` then refused."""
    old, new = pair
    out = tmp_path / "p.safetensors"
    assert main(["diff", str(old), str(new), "-o", str(out), *steps]) == 1
    assert not out.exists() and capsys.readouterr().err.startswith("error: ")


def test_encode_delta_refuses_steps_readers_cannot_parse():
    for step in (-1, 10**19, 2.0):
        with pytest.raises(FormatError, match="readers refuse"):
            encode_delta({}, step=step, base_step=0, base_hash="a", state_hash="b", total=0)


def test_a_two_byte_file_is_refused_cleanly_by_parse_header():
    for data, size in ((b"\x01\x02", None), (b"\x01\x02", 10**6)):
        with pytest.raises(FormatError, match="shorter than the 8-byte"):
            parse_header(data, file_size=size)
