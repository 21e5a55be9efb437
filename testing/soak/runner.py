"""Runs the soak: one trial per ``(kind, seed)`` in a fresh folder, then the summary (``python -m testing.soak``)."""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from . import __doc__ as SOAK_DOC
from .invariants import TrialResult
from .kinds import DEFAULT_TRIALS, KINDS, TRIALS
from .report import format_table, summarize

logger = logging.getLogger("testing.soak")


def run_trial(kind: str, seed: int, root: Path, **kwargs: Any) -> TrialResult:
    """Run one trial of ``kind`` with its own seed in a fresh folder under ``root`` (removed if it passed)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{kind}-{seed}-", dir=root))
    t0 = time.perf_counter()
    try:
        result = TRIALS[kind](random.Random(seed), workdir, **kwargs)
    except Exception:
        result = TrialResult(kind)
        result.fail(f"trial crashed (seed {seed}):\n{traceback.format_exc()}")
    result.seconds = time.perf_counter() - t0
    if result.violations:
        logger.error("%s seed %d failed; files kept in %s", kind, seed, workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.soak", description=SOAK_DOC.split("\n\n")[0])
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="trials of every kind (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_TRIALS.items()) + ")",
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary as JSON to this file")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where trial buckets go (default: a temporary folder)"
    )
    parser.add_argument(
        "--log-level", default="CRITICAL", help="library log level (refusals are logged as errors by design)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.WARNING)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="rlsync-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    seeds = random.Random(args.seed)
    plan = [
        (kind, seeds.randrange(2**31))
        for kind in args.kinds
        for _ in range(args.trials if args.trials is not None else DEFAULT_TRIALS[kind])
    ]
    t0 = time.perf_counter()
    results = []
    for i, (kind, seed) in enumerate(plan, 1):
        result = run_trial(kind, seed, root)
        results.append(result)
        status = "ok" if not result.violations and not result.lost else f"FAILED ({len(result.violations)} violations)"
        print(
            f"[{i:>4}/{len(plan)}] {kind:<16} seed {seed:<10} {result.seconds:6.2f}s {status}",
            file=sys.stderr,
            flush=True,
        )
    wall = time.perf_counter() - t0
    summary = summarize(results)
    summary["wall_s"] = wall
    print(format_table(summary, wall))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if not args.workdir and not summary["violations"]:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if summary["lost"] or summary["violations"] else 0
