"""The ``rlsync`` commands (``diff``, ``apply``, ``inspect``, ``ls``, ``verify``): what :mod:`rlsync.cli` runs
once it has parsed a command line (so ``rlsync --help`` imports neither torch nor safetensors)."""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import os
import re
import stat
from pathlib import Path

import safetensors.torch
import torch
import zstandard

from .bucket import Bucket, BucketSettings, open_bucket
from .cli_views import anchor_folder_files, describe_json
from .codecs import DEFAULT_CODEC
from .codecs.checks import decompress_frame
from .detect import ChangeDetector
from .dtypes import dtype_name
from .errors import FormatError, SyncError
from .files import read_regular, write_atomic
from .delta_format import decode_delta, encode_delta
from .format import file_kind, metadata_int, parse_header, read_header_file, shaped_nbytes
from .hashing import state_hash
from .jsonlimits import loads_bounded
from .limits import MAX_HEADER_BYTES, MAX_METADATA_BYTES
from .progress import progress_bar

HEADER_KEY = "file_header"
FILE_HASH_KEY = "file_sha256"


def printable(text: object) -> str:
    """``text`` with control and other non-printable characters escaped (bucket and file
    strings are untrusted and must not reach the terminal raw)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))



def _load(path: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """Tensors of a safetensors file (a regular file, checked before reading) and its bytes."""
    data = read_regular(path)
    parse_header(data)
    try:
        return safetensors.torch.load(data), data
    except Exception as exc:
        raise FormatError(f"{path}: unreadable safetensors data: {exc}") from None


def check_output(path: Path) -> None:
    """Refuse an output path that exists and is not a regular file (a device, FIFO, socket,
    folder or symlink): writing would replace it (as root, ``-o /dev/null`` would replace the device).

    Raises:
        SyncError: naming the path and what it is.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise SyncError(f"{path} exists and is not a regular file; refusing to replace it")


def _anchor_step(data: bytes) -> int | None:
    """The step in an rlsync anchor's metadata, or ``None`` for a plain safetensors file."""
    _, metadata = parse_header(data)
    try:
        return metadata_int(metadata, "step") if file_kind(metadata) == "anchor" else None
    except FormatError:
        return None


def cmd_diff(args: argparse.Namespace) -> None:
    check_output(args.output)
    with progress_bar(4, "diff: load", enabled=args.progress, unit="stage") as bar:
        _diff(args, bar)


def _diff(args: argparse.Namespace, bar) -> None:
    old, old_data = _load(args.old)
    new, new_data = _load(args.new)
    bar.update()
    bar.set_description("diff: compare")
    step = args.step if args.step is not None else _anchor_step(new_data)
    base_step = args.base_step if args.base_step is not None else _anchor_step(old_data)
    if step is None:  # plain checkpoints: NEW is one step after OLD unless told
        step = base_step + 1 if base_step is not None else 1
    if base_step is None:
        base_step = step - 1
    if not 0 <= base_step < step:
        raise SyncError(f"--step {step} must exceed --base-step {base_step}, both non-negative")
    detector = ChangeDetector(dtype=None)
    detector.published = old
    if not detector.compatible(new):
        raise FormatError("the two checkpoints differ in tensor names, shapes or dtypes; a delta cannot express that")
    changes = detector.diff(new)
    total = sum(t.numel() for t in new.values())
    bar.update()
    bar.set_description("diff: encode")
    header_len = 8 + int.from_bytes(new_data[:8], "little")
    data = encode_delta(
        changes,
        step=step,
        base_step=base_step,
        base_hash=state_hash(old),
        state_hash=state_hash(new),
        total=total,
        codec=args.codec or DEFAULT_CODEC,
        extra_metadata={
            HEADER_KEY: base64.b64encode(zstandard.compress(new_data[:header_len])).decode(),
            FILE_HASH_KEY: hashlib.sha256(new_data).hexdigest(),
        },
    )
    bar.update()
    bar.set_description("diff: write")
    write_atomic(args.output, lambda f: f.write(data))
    bar.update()
    changed = sum(c.index.size for c in changes.values())
    print(f"{args.output}: {len(data):,} bytes, {changed:,}/{total:,} elements changed ({100 * changed / max(total, 1):.3f}%), "
          f"{len(data) / max(changed, 1):.3f} bytes per changed element")  # fmt: skip


def stored_header(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> bytes:
    """The new file's header stored in a patch, checked against the verified ``tensors``.

    The header must name exactly these tensors with their dtypes and shapes, laid
    out back to back from offset 0 (so the data written after it is exactly the
    tensors), and the patch must carry the SHA-256 of the whole new file, which
    :func:`cmd_apply` checks before the output appears.

    Raises:
        FormatError: bad base64, a zstd frame that is not exactly one frame of at
            most a header's size, or a header that disagrees with the tensors.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", metadata.get(FILE_HASH_KEY, "")):
        raise FormatError(f"the patch stores a file header but no valid {FILE_HASH_KEY!r} covering it")
    try:
        blob = base64.b64decode(metadata[HEADER_KEY], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError(f"stored file header is not base64: {exc}") from None
    header_bytes = decompress_frame(blob, what="stored file header", max_size=8 + MAX_HEADER_BYTES)
    body = sum(t.numel() * t.element_size() for t in tensors.values())
    header, _ = parse_header(header_bytes, file_size=len(header_bytes) + body)
    if len(header_bytes) != 8 + int.from_bytes(header_bytes[:8], "little"):
        raise FormatError("stored file header has bytes after its JSON")
    if header.keys() != tensors.keys():
        raise FormatError("stored file header names other tensors than the patched checkpoint")
    offset = 0
    for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
        info, tensor = header[name], tensors[name]
        if info["dtype"] != dtype_name(tensor.dtype) or info["shape"] != list(tensor.shape):
            raise FormatError(f"stored file header gives {name!r} another dtype or shape than the verified tensor")
        if info["data_offsets"] != [offset, offset + tensor.numel() * tensor.element_size()]:
            raise FormatError(f"stored file header places {name!r} elsewhere than right after the previous tensor")
        offset = info["data_offsets"][1]
    return header_bytes


def cmd_apply(args: argparse.Namespace) -> None:
    check_output(args.output)
    base, _ = _load(args.base)
    data = read_regular(args.patch)
    _, metadata = parse_header(data)
    if metadata.get("base_hash") != state_hash(base):  # before decoding: a context codec reads the base
        raise SyncError(f"{args.patch} was made for another base than {args.base} (base hash differs)")
    delta = decode_delta(data, base)
    with progress_bar(len(delta.patches), "apply", enabled=args.progress, unit="tensor") as bar:
        for name, patch in delta.patches.items():
            patch.apply_(base[name])
            bar.update()
    if state_hash(base) != delta.state_hash:
        raise SyncError("result does not match the patch's state hash")
    if HEADER_KEY in metadata:  # reproduce the new file byte for byte: its own header, then its data in offset order
        header_bytes = stored_header(metadata, base)
        header, _ = parse_header(header_bytes, file_size=len(header_bytes) + sum(t.numel() * t.element_size() for t in base.values()))
        order = sorted(header, key=lambda n: header[n]["data_offsets"][0])

        def write(f):
            digest = hashlib.sha256(header_bytes)
            f.write(header_bytes)
            for name in order:
                raw = base[name].contiguous().reshape(-1).view(torch.uint8).numpy()
                digest.update(raw)
                f.write(raw.tobytes())
            if digest.hexdigest() != metadata[FILE_HASH_KEY]:
                raise SyncError(f"the file the patch describes does not match its {FILE_HASH_KEY} (header or metadata tampered with)")

        write_atomic(args.output, write)
    else:
        write_atomic(args.output, lambda f: f.write(safetensors.torch.save(base)))
    print(f"{args.output}: applied {delta.changed:,} changed elements; state hash {delta.state_hash[:16]} verified")


def _delta_table(metadata: dict[str, str]) -> dict[str, dict]:
    """The ``tensors`` table of a delta's metadata, with its fields' types checked."""
    table = loads_bounded(metadata.get("tensors", ""), what="metadata 'tensors'", max_bytes=MAX_METADATA_BYTES)
    if not isinstance(table, dict):
        raise FormatError("metadata 'tensors' is not a JSON object")
    for name, info in table.items():
        if (
            not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not isinstance(info.get("shape"), list)
            or not all(type(d) is int for d in info["shape"]) or type(info.get("count")) is not int
        ):  # fmt: skip
            raise FormatError(f"metadata 'tensors': malformed entry for {printable(name)[:80]}")
    return table


def cmd_inspect(args: argparse.Namespace) -> None:
    if args.file.is_dir():  # an anchor folder, as ``ls`` prints it: its files, each described
        files = anchor_folder_files(args.file)
        print(f"anchor folder: {printable(args.file)} ({len(files)} file(s), {sum(f.stat().st_size for f in files):,} bytes)")
        for path in files:
            print()
            cmd_inspect(argparse.Namespace(file=path))
        return
    if args.file.suffix == ".json":  # the pointer object (latest.json) or a sharded checkpoint's index
        print("\n".join(printable(line) for line in describe_json(args.file)))
        return
    header, metadata = read_header_file(args.file)
    lines: list[str] = []  # printed only once the whole file checked out
    size = args.file.stat().st_size
    lines.append(f"file: {printable(args.file)} ({size:,} bytes)")
    try:
        kind = file_kind(metadata)
    except FormatError:
        kind = None
    if kind is None:
        lines.append("kind: plain safetensors (not an rlsync anchor or delta)")
    for key in ("kind", "step", "base_step", "codec", "codec_version", "state_hash", "base_hash"):
        if key in ("step", "base_step") and key in metadata and kind is not None:
            lines.append(f"{key}: {metadata_int(metadata, key)}")
        elif key in metadata:
            lines.append(f"{key}: {printable(metadata[key])[:200]}")
    if kind == "delta":
        changed, total = metadata_int(metadata, "changed"), metadata_int(metadata, "total")
        table = _delta_table(metadata)
        lines.append(f"changed: {changed:,} of {total:,} elements ({100 * changed / max(total, 1):.4f}%)")
        lines.append(f"bytes per changed element: {size / max(changed, 1):.3f} (whole file)")
        stored: dict[str, int] = {}
        for entry, info in header.items():  # one pass: linear in the number of entries
            owner = entry.rsplit(".", 1)[0]
            stored[owner] = stored.get(owner, 0) + info["data_offsets"][1] - info["data_offsets"][0]
        lines.append(f"\n{'tensor':60s} {'dtype':6s} {'shape':>18s} {'changed':>10s} {'%':>8s} {'bytes':>10s}")
        for name, info in sorted(table.items()):
            numel = shaped_nbytes(info["shape"], 1, limit=1 << 62)
            pct = f"{100 * info['count'] / numel:8.3f}" if numel else f"{'-':>8s}"
            shape = printable(tuple(info["shape"]))[:40]
            lines.append(f"{printable(name):60s} {printable(info['dtype'])[:6]:6s} {shape:>18s} {info['count']:10,d} {pct} {stored.get(name, 0):10,d}")
    else:
        lines.append(f"tensors: {len(header)}")
        lines.append(f"\n{'tensor':60s} {'dtype':6s} {'shape':>18s} {'bytes':>12s}")
        for name, info in sorted(header.items()):
            start, end = info["data_offsets"]
            lines.append(f"{printable(name):60s} {info['dtype']:6s} {str(tuple(info['shape'])):>18s} {end - start:12,d}")
    print("\n".join(lines))


def open_existing(url: str) -> Bucket:
    """The bucket at ``url`` for reading, its Hub settings from the environment (a command is an entry point)."""
    return open_bucket(url, create=False, settings=BucketSettings.from_env())


def cmd_ls(args: argparse.Namespace) -> None:
    from .protocol import read_manifest

    bucket = open_existing(args.bucket)
    manifest = read_manifest(bucket)
    if manifest is None:
        raise SyncError(f"{printable(bucket.url)}: no pointer object (nothing published yet)")
    print(f"bucket: {printable(bucket.url)}\nrun: {printable(manifest.run_id) or '-'}\n"
          f"newest step: {manifest.step}  hash {printable(manifest.state_hash[:16])}")  # fmt: skip
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

    with progress_bar(None, "verify", enabled=args.progress) as bar:

        def checked(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = verify_bucket(open_existing(args.bucket), on_checked=checked)
    if not report.ok:
        raise SyncError(f"verification failed with {len(report.errors)} error(s): " + "; ".join(report.errors))
    raced = f" (raced a concurrent publish {len(report.raced)} time(s): replayed the newer pointer)" if report.raced else ""
    print(f"OK: {report.anchors_checked} anchor(s) and {report.deltas_checked} delta(s) verified up to step {report.newest_step}{raced}")
