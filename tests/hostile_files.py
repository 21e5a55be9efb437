"""Hostile inputs for every CLI command (issue 11): patches whose stored header was tampered
with, decompression bombs, hostile JSON, hostile shapes, zero differences, extra zstd frames,
non-regular files, and buckets with hostile pointers or planted files.

:func:`make_files` writes them into a folder; :data:`PATCH_CASES` and :data:`BUCKET_CASES`
name them by class.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
import zstandard

from rlsync.cli import main
from rlsync.commands import FILE_HASH_KEY, HEADER_KEY
from rlsync.layout import POINTER_KEY
from rlsync.protocol import FixedInterval, Publisher

NAMES = ("model.a.weight", "model.b.weight", "model.c.weight")


def base_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """OLD and NEW: three bf16 tensors, about 10% of NEW's elements changed."""
    gen = torch.Generator().manual_seed(0)
    old = {n: (torch.randn(16, 8, generator=gen) * 0.02).to(torch.bfloat16) for n in NAMES}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        bits = t.view(torch.int16)
        bits[torch.rand(bits.shape, generator=gen) < 0.1] += 1
    return old, new


def _header_of(patch: bytes) -> tuple[dict[str, str], dict[str, Any]]:
    from rlsync.format import parse_header

    _, metadata = parse_header(patch)
    raw = zstandard.decompress(base64.b64decode(metadata[HEADER_KEY]))
    return metadata, json.loads(raw[8:])


def _with_metadata(patch: bytes, edit: Callable[[dict[str, str]], None]) -> bytes:
    from rlsync.format import parse_header

    _, metadata = parse_header(patch)
    edit(metadata)
    return safetensors.torch.save(safetensors.torch.load(patch), metadata=metadata)


def _stored(header: dict[str, Any] | bytes, *, trailing: bytes = b"") -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return base64.b64encode(zstandard.compress(struct.pack("<Q", len(raw)) + raw + trailing)).decode()


def _tampered_header(patch: bytes, edit: Callable[[dict[str, Any]], None], *, trailing: bytes = b"") -> bytes:
    metadata, header = _header_of(patch)
    edit(header)
    return _with_metadata(patch, lambda m: m.update({HEADER_KEY: _stored(header, trailing=trailing)}))


def _swap_shape(h: dict[str, Any]) -> None:
    h[NAMES[0]]["shape"] = h[NAMES[0]]["shape"][::-1]


def _move_boundary(h: dict[str, Any]) -> None:
    first, second = sorted((n for n in h if n != "__metadata__"), key=lambda n: h[n]["data_offsets"][0])[:2]
    h[first]["data_offsets"][1] += 2
    h[second]["data_offsets"][0] += 2


def _bomb_frame(size: int) -> bytes:
    """A real zstd frame of ``size`` zero bytes that declares its size (made in 1 MiB pieces)."""
    import io

    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=size, closefd=False) as writer:
        chunk = bytes(1 << 20)
        for _ in range(size >> 20):
            writer.write(chunk)
    return out.getvalue()


def _frame_declaring(size: int) -> bytes:
    return struct.pack("<I", 0xFD2FB528) + bytes([0b1110_0000]) + struct.pack("<Q", size) + bytes([0x01, 0x00, 0x00])


def _raw_file(header: bytes, body: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + body


def _delta_entries_edit(patch: bytes, edit: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
    from rlsync.format import parse_header

    _, metadata = parse_header(patch)
    entries = safetensors.torch.load(patch)
    edit(entries)
    return safetensors.torch.save(entries, metadata=metadata)


def _zero_difference_delta(old: dict[str, torch.Tensor], codec: str) -> bytes:
    """A delta declaring every element of every tensor changed, each by zero."""
    import numpy as np

    from rlsync.dtypes import bits_to_numpy, int_view
    from rlsync.delta_format import Change, encode_delta
    from rlsync.hashing import state_hash

    changes = {}
    for n, t in old.items():
        bits = bits_to_numpy(int_view(t)).reshape(-1)
        changes[n] = Change(np.arange(t.numel(), dtype=np.int64), bits, bits.copy(), t.dtype, tuple(t.shape))
    total = sum(t.numel() for t in old.values())
    h = state_hash(old)
    return encode_delta(changes, step=1, base_step=0, base_hash=h, state_hash=h, total=total, codec=codec)


def _appended_to_entry(patch: bytes, extra: bytes) -> bytes:
    name = f"{NAMES[0]}.val"

    def edit(entries: dict[str, torch.Tensor]) -> None:
        entries[name] = torch.frombuffer(bytearray(entries[name].numpy().tobytes() + extra), dtype=torch.uint8)

    return _delta_entries_edit(patch, edit)


def _many_entries_delta(count: int) -> bytes:
    """A delta-kind file naming ``count`` tensors (linear-time ``inspect``; ``apply`` refuses it)."""
    from rlsync.format import FORMAT_NAME, FORMAT_VERSION

    entries = {}
    table = {}
    for i in range(count):
        name = f"model.layers.{i}.w"
        entries[f"{name}.pos"] = torch.zeros(1, dtype=torch.uint8)
        entries[f"{name}.val"] = torch.zeros(1, dtype=torch.uint8)
        table[name] = {"dtype": "BF16", "shape": [4], "count": 1, "gap_bytes": 1}
    metadata = {
        "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "kind": "delta", "sparse": "True", "step": "1",
        "base_step": "0", "base_hash": "0" * 64, "state_hash": "1" * 64, "codec": "gapzz", "codec_version": "1",
        "changed": str(count), "total": str(4 * count), "tensors": json.dumps(table),
    }  # fmt: skip
    return safetensors.torch.save(entries, metadata=metadata)


def _huge_dims_header(entries: int, dims: int) -> bytes:
    header = {f"t{i}": {"dtype": "BF16", "shape": [10**18] * dims, "data_offsets": [0, 2]} for i in range(entries)}
    return _raw_file(json.dumps(header).encode(), bytes(2))


def make_patches(folder: Path) -> dict[str, Path]:
    """OLD, NEW, a valid PATCH, and every hostile patch or input file, by case name."""
    folder.mkdir(parents=True, exist_ok=True)
    old, new = base_states()
    paths = {"old": folder / "old.safetensors", "new": folder / "new.safetensors", "patch": folder / "patch.safetensors"}
    safetensors.torch.save_file(old, paths["old"], metadata={"note": "old"})
    safetensors.torch.save_file(new, paths["new"], metadata={"note": "new"})
    assert main(["diff", str(paths["old"]), str(paths["new"]), "-o", str(paths["patch"])]) == 0
    patch = paths["patch"].read_bytes()
    cases: dict[str, bytes] = {
        # finding 2: the stored header changed, the tensors verified
        "header_dtype_bf16_to_f16": _tampered_header(patch, lambda h: h[NAMES[0]].update(dtype="F16")),
        "header_shape_swapped": _tampered_header(patch, _swap_shape),
        "header_boundary_moved": _tampered_header(patch, _move_boundary),
        "header_metadata_replaced": _tampered_header(patch, lambda h: h.update(__metadata__={"note": "evil"})),
        "header_tensor_renamed": _tampered_header(patch, lambda h: h.update({"model.evil": h.pop(NAMES[0])})),
        "header_trailing_bytes": _tampered_header(patch, lambda h: None, trailing=b"    "),
        "header_hash_missing": _with_metadata(patch, lambda m: m.pop(FILE_HASH_KEY)),
        # finding 3: decompression bombs and junk in the header path
        "header_bomb_150MB": _with_metadata(patch, lambda m: m.update({HEADER_KEY: base64.b64encode(_bomb_frame(150 << 20)).decode()})),
        "header_declares_2_40": _with_metadata(patch, lambda m: m.update({HEADER_KEY: base64.b64encode(_frame_declaring(2**40)).decode()})),
        "header_no_content_size": _with_metadata(patch, lambda m: m.update(
            {HEADER_KEY: base64.b64encode(zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 100)).decode()})),
        "header_bad_base64": _with_metadata(patch, lambda m: m.update({HEADER_KEY: "!!not base64!!"})),
        "header_junk": _with_metadata(patch, lambda m: m.update({HEADER_KEY: base64.b64encode(zstandard.compress(b"junk" * 10)).decode()})),
        "header_two_frames": _with_metadata(patch, lambda m: m.update(
            {HEADER_KEY: base64.b64encode(base64.b64decode(m[HEADER_KEY]) * 2).decode()})),
        # finding 4: hostile metadata JSON
        "tensors_deeply_nested": _with_metadata(patch, lambda m: m.update(tensors="[" * 200_000 + "]" * 200_000)),
        "tensors_5000_digit_int": _with_metadata(patch, lambda m: m.update(tensors=m["tensors"].replace('"count":', '"count":' + "9" * 5000 + ",\"x\":", 1))),
        "tensors_wrong_types": _with_metadata(patch, lambda m: m.update(tensors=json.dumps({NAMES[0]: {"dtype": 5, "shape": "ab", "count": "x"}}))),
        "step_5000_digits": _with_metadata(patch, lambda m: m.update(step="9" * 5000)),
        "header_deeply_nested": _raw_file(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
        "header_5000_digit_offset": _raw_file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}", b"x"),
        "header_length_2_63": _raw_file(b"{}", length=2**63),
        # finding 5: hostile shapes and sizes
        "shape_60_huge_dims_3MB": _huge_dims_header(2500, 60),
        "shape_too_many_dims": _huge_dims_header(1, 100),
        "inspect_20000_tensors": _many_entries_delta(20_000),
        # finding 7: amplification and extra zstd frames
        "zero_difference_gapzz": _zero_difference_delta(old, "gapzz"),
        "zero_difference_trl": _zero_difference_delta(old, "trl"),
        "zstd_trailing_garbage": _appended_to_entry(patch, b"garbage"),
        "zstd_second_frame": _appended_to_entry(patch, zstandard.compress(b"more")),
        "zstd_trailing_skippable": _appended_to_entry(patch, struct.pack("<II", 0x184D2A50, 4) + b"skip"),
        "truncated": patch[: len(patch) // 2],
    }
    for name, data in cases.items():
        paths[name] = folder / f"{name}.safetensors"
        paths[name].write_bytes(data)
    paths["fifo"] = folder / "fifo.safetensors"
    os.mkfifo(paths["fifo"])
    paths["dev_zero_link"] = folder / "zero.safetensors"
    paths["dev_zero_link"].symlink_to("/dev/zero")
    return paths


# Cases that are well-formed files inspect may describe (exit 0); every other command refuses them.
INSPECTABLE = {
    "header_dtype_bf16_to_f16", "header_shape_swapped", "header_boundary_moved", "header_metadata_replaced",
    "header_tensor_renamed", "header_trailing_bytes", "header_hash_missing", "header_bomb_150MB", "header_declares_2_40",
    "header_no_content_size", "header_bad_base64", "header_junk", "header_two_frames", "inspect_20000_tensors",
    "zero_difference_gapzz", "zero_difference_trl", "zstd_trailing_garbage", "zstd_second_frame", "zstd_trailing_skippable",
}  # fmt: skip


def make_buckets(folder: Path) -> dict[str, Path]:
    """A valid bucket and hostile ones (pointer, planted files), by case name."""
    from tests.helpers import master_state, rl_step

    good = folder / "good"
    pub = Publisher(_local(good), policy=FixedInterval(2), run_id="run\x1b[31mRED\x07")
    master = master_state()
    for step in range(4):
        rl_step(master, step)
        pub.publish(step, master)
    pointer = json.loads((good / POINTER_KEY).read_text())
    buckets = {"good": good}

    def variant(name: str, edit: Callable[[Path], None]) -> None:
        import shutil

        path = folder / name
        shutil.copytree(good, path, symlinks=True)
        edit(path)
        buckets[name] = path

    def pointer_doc(doc: dict[str, Any]) -> Callable[[Path], None]:
        return lambda p: (p / POINTER_KEY).write_text(json.dumps(doc))

    variant("anchor_without_files", pointer_doc({**pointer, "anchors": [{**pointer["anchors"][0], "files": []}] + pointer["anchors"][1:]}))
    variant("pointer_deeply_nested", lambda p: (p / POINTER_KEY).write_bytes(b"[" * 200_000 + b"]" * 200_000))
    variant("pointer_5000_digit_step", lambda p: (p / POINTER_KEY).write_bytes(
        (p / POINTER_KEY).read_bytes().replace(b'"step": ', b'"step": ' + b"9" * 5000 + b", \"x\": ", 1)))
    variant("pointer_6GB_sparse", lambda p: os.truncate(p / POINTER_KEY, 6 << 30))
    variant("pointer_fifo", lambda p: ((p / POINTER_KEY).unlink(), os.mkfifo(p / POINTER_KEY)))
    variant("shard_links_dev_zero", lambda p: [(f.unlink(), f.symlink_to("/dev/zero")) for f in p.glob("anchors/*/*.safetensors")])
    variant("delta_6GB_sparse", lambda p: [os.truncate(f, 6 << 30) for f in p.glob("deltas/*.safetensors")])
    buckets["missing_folder"] = folder / "no-such-bucket"
    return buckets


def _local(path: Path):
    from rlsync.bucket import LocalBucket

    return LocalBucket(path)
