"""Command line: ``python -m shared {diff,apply,inspect,ls,verify}``.

Every command exits non-zero with a one-line error on failure and never leaves
a partial output file (outputs are written to a temporary name, then renamed).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import safetensors.torch
import torch
import zstandard

from .bucket import BucketError, open_bucket
from .codecs import DEFAULT_CODEC, list_codecs
from .detect import ChangeDetector
from .errors import FormatError, SyncError
from .format import decode_delta, encode_delta, file_kind, parse_header, read_header_file
from .hashing import state_hash

HEADER_KEY = "file_header"


def _load(path: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """Tensors of a safetensors file and its raw header (length prefix + JSON)."""
    data = path.read_bytes()
    parse_header(data)
    n = int.from_bytes(data[:8], "little")
    try:
        return safetensors.torch.load(data), data[: 8 + n]
    except Exception as exc:
        raise FormatError(f"{path}: unreadable safetensors data: {exc}") from None


def _write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_diff(args: argparse.Namespace) -> None:
    old, _ = _load(args.old)
    new, new_header = _load(args.new)
    detector = ChangeDetector(dtype=None)
    detector.published = old
    if not detector.compatible(new):
        raise FormatError("the two checkpoints differ in tensor names, shapes or dtypes; a delta cannot express that")
    changes = detector.diff(new)
    total = sum(t.numel() for t in new.values())
    data = encode_delta(
        changes,
        step=args.step,
        base_step=args.base_step,
        base_hash=state_hash(old),
        state_hash=state_hash(new),
        total=total,
        codec=args.codec,
        extra_metadata={HEADER_KEY: base64.b64encode(zstandard.compress(new_header)).decode()},
    )
    _write_atomic(args.output, lambda f: f.write(data))
    changed = sum(c.index.size for c in changes.values())
    print(f"{args.output}: {len(data):,} bytes, {changed:,}/{total:,} elements changed ({100 * changed / max(total, 1):.3f}%), "
          f"{len(data) / max(changed, 1):.3f} bytes per changed element")  # fmt: skip


def cmd_apply(args: argparse.Namespace) -> None:
    base, _ = _load(args.base)
    data = args.patch.read_bytes()
    base_hash = state_hash(base)
    delta = decode_delta(data, base)
    if delta.base_hash != base_hash:
        raise SyncError(f"{args.patch} was made for another base than {args.base} (base hash differs)")
    for name, patch in delta.patches.items():
        patch.apply_(base[name])
    if state_hash(base) != delta.state_hash:
        raise SyncError("result does not match the patch's state hash")
    _, metadata = parse_header(data)
    if HEADER_KEY in metadata:  # reproduce the new file byte for byte: its own header, then its data in offset order
        header_bytes = zstandard.decompress(base64.b64decode(metadata[HEADER_KEY]))
        header, _ = parse_header(header_bytes, file_size=len(header_bytes) + sum(t.numel() * t.element_size() for t in base.values()))
        order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
        if set(order) != set(base):
            raise FormatError("stored header names other tensors than the patched checkpoint")

        def write(f):
            f.write(header_bytes)
            for name in order:
                f.write(base[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

        _write_atomic(args.output, write)
    else:
        _write_atomic(args.output, lambda f: f.write(safetensors.torch.save(base)))
    print(f"{args.output}: applied {delta.changed:,} changed elements; state hash {delta.state_hash[:16]} verified")


def cmd_inspect(args: argparse.Namespace) -> None:
    header, metadata = read_header_file(args.file)
    size = args.file.stat().st_size
    print(f"file: {args.file} ({size:,} bytes)")
    try:
        kind = file_kind(metadata)
    except FormatError:
        kind = None
    if kind is None:
        print("kind: plain safetensors (not an rlsync anchor or delta)")
    for key in ("kind", "step", "base_step", "codec", "codec_version", "state_hash", "base_hash"):
        if key in metadata:
            print(f"{key}: {metadata[key]}")
    if kind == "delta":
        changed, total = int(metadata["changed"]), int(metadata["total"])
        print(f"changed: {changed:,} of {total:,} elements ({100 * changed / max(total, 1):.4f}%)")
        print(f"bytes per changed element: {size / max(changed, 1):.3f} (whole file)")
        table = json.loads(metadata["tensors"])
        print(f"\n{'tensor':60s} {'dtype':6s} {'shape':>18s} {'changed':>10s} {'%':>8s} {'bytes':>10s}")
        for name, info in sorted(table.items()):
            numel = 1
            for d in info["shape"]:
                numel *= d
            stored = sum(
                header[e]["data_offsets"][1] - header[e]["data_offsets"][0] for e in header if e.rsplit(".", 1)[0] == name
            )
            print(f"{name:60s} {info['dtype']:6s} {str(tuple(info['shape'])):>18s} {info['count']:10,d} "
                  f"{100 * info['count'] / max(numel, 1):8.3f} {stored:10,d}")  # fmt: skip
    else:
        print(f"tensors: {len(header)}")
        print(f"\n{'tensor':60s} {'dtype':6s} {'shape':>18s} {'bytes':>12s}")
        for name, info in sorted(header.items()):
            start, end = info["data_offsets"]
            print(f"{name:60s} {info['dtype']:6s} {str(tuple(info['shape'])):>18s} {end - start:12,d}")


def cmd_ls(args: argparse.Namespace) -> None:
    from .protocol import read_manifest

    bucket = open_bucket(args.bucket)
    manifest = read_manifest(bucket)
    if manifest is None:
        raise SyncError(f"{bucket.url}: no pointer object (nothing published yet)")
    print(f"bucket: {bucket.url}\nrun: {manifest.run_id or '-'}\nnewest step: {manifest.step}  hash {manifest.state_hash[:16]}")
    print(f"catch-up for a new replica: {manifest.catchup_bytes():,} bytes\n")
    print(f"{'step':>8s} {'kind':7s} {'base':>8s} {'bytes':>14s} {'changed %':>10s}  key")
    rows = [(a.step, "anchor", "", a.nbytes, "", a.files[0].key.rsplit("/", 1)[0] + "/") for a in manifest.anchors]
    rows += [
        (d.step, "delta", str(d.base_step), d.nbytes, f"{100 * d.changed / max(d.total, 1):.3f}", d.file.key + (f" (+{len(d.parts)} more parts)" if d.parts else ""))
        for d in manifest.deltas
    ]
    for step, kind, base, nbytes, pct, key in sorted(rows):
        print(f"{step:8d} {kind:7s} {base:>8s} {nbytes:14,d} {pct:>10s}  {key}")


def cmd_verify(args: argparse.Namespace) -> None:
    from .protocol.verify import verify_bucket

    report = verify_bucket(open_bucket(args.bucket))
    for err in report.errors:
        print(f"FAIL: {err}", file=sys.stderr)
    if not report.ok:
        raise SyncError(f"verification failed with {len(report.errors)} error(s)")
    print(f"OK: {report.anchors_checked} anchor(s) and {report.deltas_checked} delta(s) verified up to step {report.newest_step}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shared", description="Sparse bf16 weight sync: files and buckets.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("diff", help="write a delta that turns OLD into NEW")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--codec", default=DEFAULT_CODEC, choices=list_codecs())
    p.add_argument("--step", type=int, default=1, help="step recorded for NEW (default 1)")
    p.add_argument("--base-step", type=int, default=0, help="step recorded for OLD (default 0)")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("apply", help="apply PATCH to BASE and write the result")
    p.add_argument("base", type=Path)
    p.add_argument("patch", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(func=cmd_apply)
    p = sub.add_parser("inspect", help="describe an anchor, a delta or any safetensors file")
    p.add_argument("file", type=Path)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("ls", help="list the versions published in a bucket")
    p.add_argument("bucket", help="path, file://PATH or hf://buckets/OWNER/NAME[/PREFIX]")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("verify", help="replay a bucket's chain and check every hash")
    p.add_argument("bucket")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (SyncError, BucketError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
