"""Command line: ``rlsync {diff,apply,inspect,ls,verify}`` (also ``python -m rlsync``).

Every command exits non-zero with a one-line error on failure and never leaves
a partial output file (outputs are written to a temporary name, then renamed).
Parsing imports nothing heavy: ``rlsync --help`` is instant; the commands are in
:mod:`rlsync.commands`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from .errors import BucketError, SyncError
from .registry import Kind, names

MAX_ERROR_CHARS = 600  # hostile files can make messages long (names, shapes); the error stays one readable line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsync", description="Sparse bf16 weight sync: files and buckets.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bars on stderr for verify, diff and apply (default: only on a terminal)",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("diff", help="write a delta that turns OLD into NEW")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--codec", choices=names(Kind.CODEC), help="delta codec (default: the library's default codec)")
    p.add_argument("--step", type=int, help="step recorded for NEW (default: its anchor metadata's step, else base step + 1)")
    p.add_argument("--base-step", type=int, help="step recorded for OLD (default: its anchor metadata's step, else step - 1, else 0)")
    p.set_defaults(command_name="diff")
    p = sub.add_parser("apply", help="apply PATCH to BASE and write the result")
    p.add_argument("base", type=Path)
    p.add_argument("patch", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(command_name="apply")
    p = sub.add_parser("inspect", help="describe an anchor, a delta or any safetensors file")
    p.add_argument("file", type=Path)
    p.set_defaults(command_name="inspect")
    p = sub.add_parser("ls", help="list the versions published in a bucket")
    p.add_argument("bucket", help="path, file://PATH or hf://buckets/OWNER/NAME[/PREFIX]")
    p.set_defaults(command_name="ls")
    p = sub.add_parser("verify", help="replay a bucket's chain and check every hash")
    p.add_argument("bucket")
    p.set_defaults(command_name="verify")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from . import commands

    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL, format="%(levelname)s %(name)s: %(message)s")
    try:
        getattr(commands, f"cmd_{args.command_name}")(args)
    except (SyncError, BucketError, OSError) as exc:
        print(f"error: {commands.printable(exc)[:MAX_ERROR_CHARS]}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug, not a refusal: still one line, and the tests look for it
        print(f"error: unexpected {type(exc).__name__}: {commands.printable(exc)[:MAX_ERROR_CHARS]}", file=sys.stderr)
        return 2
    return 0
