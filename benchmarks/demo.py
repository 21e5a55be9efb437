"""Demo regime benchmark: the CPU demo's trainer (TRL), environment and one replica for a fixed time.

Runs the three roles as processes on a fresh local bucket for ``--minutes`` (what
``python app.py`` runs, without the panel), then reads the bucket's figures and prints:

- the median % of elements changed per delta after warm-up (versions after ``--warmup``),
  and per-version sizes against the anchor and against the TRL layout (6 bytes per
  changed bf16 element plus the header);
- the environment's mean reward over the first and the last minute of samples;
- the flow: samples scored by the env and trained by the trainer (the share that reached
  the loss), trained samples per minute, dropped stale, expired unread, cancelled, the
  staleness histogram of trained samples and the trainer's waiting time.

``--pacing`` picks how tasks are issued: ``queue`` (the env keeps ``queue_depth`` batches
waiting, the old pacing), ``demand`` (the trainer's ``control/demand.json``), or ``both``
(the default: one after the other in the same invocation, printed side by side).

    python -m benchmarks.demo                          # the demo defaults, 5 minutes per pacing
    python -m benchmarks.demo --set TRAINER_LORA_RANK=8 --set ROLLOUT_LORA=1   # the LoRA demo (docs/lora.md)
    python -m benchmarks.demo --pacing demand --minutes 3 --set TRAINER_LR=2e-5 --set TRAINER_ADAM_EPSILON=1e-8

In a LoRA run the versions and sizes are the adapter chain's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from env_space.environments import get_environment
from rlsync.adapters import adapter_bucket
from rlsync.bucket import LocalBucket
from rlsync.protocol import read_manifest
from rlsync.spaces.metrics import EnvMetrics, FlowFigures, TrainerMetrics, read_metrics
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]


def run(minutes: float, overrides: dict[str, str], warmup: int) -> dict:
    tiny_model_path(environments=get_environment)
    with tempfile.TemporaryDirectory(prefix="rlsync-demo-") as tmp:
        bucket_dir = Path(tmp) / "bucket"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "shared"), str(ROOT))), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TRAINER_BUCKET": str(bucket_dir), "ROLLOUT_BUCKET": str(bucket_dir), "ENV_BUCKET": str(bucket_dir),
               "ROLLOUT_REPLICA_ID": "r0", **overrides}  # fmt: skip
        procs = [
            subprocess.Popen([sys.executable, "-m", m, "--log-level", "WARNING"], cwd=ROOT, env=env,
                             stdout=open(Path(tmp) / f"{m}.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip
            for m in ("trainer_space", "env_space", "rollout_space")
        ]
        start = time.time()
        try:
            time.sleep(minutes * 60)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(120)
        bucket = LocalBucket(bucket_dir)
        trainer = read_metrics(bucket, TrainerMetrics) or TrainerMetrics()
        env = read_metrics(bucket, EnvMetrics) or EnvMetrics()
        manifest = read_manifest(adapter_bucket(bucket)) or read_manifest(bucket)
    deltas = [r for r in trainer.publishes if r.kind == "delta" and r.version > warmup]
    anchor = next((r.nbytes for r in trainer.publishes if r.kind == "anchor"), None)
    env_rows = [r for r in env.rows if r.time is not None]
    t0 = min((r.time for r in env_rows), default=start)
    t1 = max((r.time for r in env_rows), default=start)

    def reward(lo: float, hi: float) -> float | None:
        rows = [r for r in env_rows if lo <= r.time <= hi]
        n = sum(r.count for r in rows)
        return sum(r.mean_reward * r.count for r in rows) / n if n else None

    first, last = reward(t0, t0 + 60), reward(t1 - 60, t1)
    return {
        "settings": overrides, "minutes": minutes, "load_avg": os.getloadavg()[0],
        **flow_figures(trainer.flow or FlowFigures(), env), "reward_rise": None if first is None or last is None else last - first,
        "versions": manifest.step if manifest else None,
        "median_changed_pct_after_warmup": statistics.median(r.changed_pct or 0.0 for r in deltas) if deltas else None,
        "median_delta_vs_anchor": statistics.median(r.nbytes / anchor for r in deltas) if deltas and anchor else None,
        "median_delta_vs_trl_layout": statistics.median(r.nbytes / r.trl_nbytes for r in deltas if r.trl_nbytes) if deltas else None,
        "median_bytes_per_changed_element": statistics.median(r.nbytes / r.changed for r in deltas if r.changed) if deltas else None,
        "anchor_bytes": anchor,
        "reward_first_minute": reward(t0, t0 + 60), "reward_last_minute": reward(t1 - 60, t1),
    }


def flow_figures(flow: FlowFigures, env: EnvMetrics) -> dict[str, Any]:
    """Scored, trained and dropped samples, their rates and the trainer's waiting, from the metrics objects."""
    scored, trained, wall = env.scored or 0, flow.trained or 0, flow.wall_s or 0.0
    return {
        "scored": scored, "trained": trained, "trained_share": trained / scored if scored else None,
        "trained_per_min": 60 * trained / wall if wall else None, "trainer_wall_s": wall,
        "wait_share": flow.wait_share, "wait_share_after_first_step": flow.wait_share_after_first_step,
        "dropped_stale": flow.dropped_stale,
        "expired_unread": flow.expired_unread, "cancelled_stale": env.cancelled_stale,
        "dropped_degenerate": flow.dropped_degenerate, "staleness_trained": flow.staleness,
    }


ROWS = ("scored", "trained", "trained_share", "trained_per_min", "wait_share", "wait_share_after_first_step",
        "dropped_stale", "expired_unread",
        "cancelled_stale", "staleness_trained", "reward_first_minute", "reward_last_minute", "reward_rise", "versions",
        "median_changed_pct_after_warmup", "load_avg")  # fmt: skip


def side_by_side(results: dict[str, dict]) -> str:
    """The figures of each pacing in columns."""
    names = list(results)

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return json.dumps(value) if isinstance(value, dict) else str(value)

    lines = [f"{'':34}" + "".join(f"{n:>26}" for n in names)]
    lines += [f"{row:34}" + "".join(f"{cell(results[n].get(row)):>26}" for n in names) for row in ROWS]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=10, help="versions excluded from the median")
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE", help="role settings (environment variables)")
    parser.add_argument("--pacing", choices=("queue", "demand", "both"), default="both", help="task pacing (both: side by side)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    settings = dict(s.split("=", 1) for s in args.set)
    pacings = ("queue", "demand") if args.pacing == "both" else (args.pacing,)
    result = {p: run(args.minutes, {**settings, "TRAINER_PACING": p}, args.warmup) for p in pacings}
    print(json.dumps(result, indent=2))
    print(side_by_side(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
