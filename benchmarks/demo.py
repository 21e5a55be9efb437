"""Demo regime benchmark: the CPU demo's trainer (TRL), environment and one replica for a fixed time.

Runs the three roles as processes on a fresh local bucket for ``--minutes`` (what
``python app.py`` runs, without the panel), then reads the bucket's figures and prints:

- the median % of elements changed per delta after warm-up (versions after ``--warmup``),
  and per-version sizes against the anchor, against the TRL layout (6 bytes per
  changed bf16 element plus the header), and per changed element;
- the environment's mean reward over the first and the last minute of samples.

    python -m benchmarks.demo                          # the demo defaults, 5 minutes
    python -m benchmarks.demo --minutes 3 --set TRAINER_LR=2e-5 --set TRAINER_ADAM_EPSILON=1e-8
    python -m benchmarks.demo --set TRAINER_LORA_RANK=8 --set ROLLOUT_LORA=1   # the LoRA demo (docs/lora.md)

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

from env_space.environments import get_environment
from rlsync.adapters import adapter_bucket
from rlsync.bucket import LocalBucket
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import get_json, metrics_key
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]


def run(minutes: float, overrides: dict[str, str], warmup: int) -> dict:
    tiny_model_path(environments=get_environment)
    with tempfile.TemporaryDirectory(prefix="rlsync-demo-") as tmp:
        bucket_dir = Path(tmp) / "bucket"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
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
        trainer = (get_json(bucket, metrics_key("trainer")) or {}).get("rows", [])
        env_rows = (get_json(bucket, metrics_key("env")) or {}).get("rows", [])
        manifest = read_manifest(adapter_bucket(bucket)) or read_manifest(bucket)
    deltas = [r for r in trainer if r.get("kind") == "delta" and r["version"] > warmup]
    anchor = next((r["nbytes"] for r in trainer if r.get("kind") == "anchor"), None)
    t0 = min((r["time"] for r in env_rows), default=start)
    t1 = max((r["time"] for r in env_rows), default=start)

    def reward(lo: float, hi: float) -> float | None:
        rows = [r for r in env_rows if lo <= r["time"] <= hi]
        n = sum(r["count"] for r in rows)
        return sum(r["mean_reward"] * r["count"] for r in rows) / n if n else None

    return {
        "settings": overrides, "minutes": minutes, "load_avg": os.getloadavg()[0],
        "versions": manifest.step if manifest else None,
        "median_changed_pct_after_warmup": statistics.median(r["changed_pct"] for r in deltas) if deltas else None,
        "median_delta_vs_anchor": statistics.median(r["nbytes"] / anchor for r in deltas) if deltas and anchor else None,
        "median_delta_vs_trl_layout": statistics.median(r["nbytes"] / r["trl_nbytes"] for r in deltas) if deltas else None,
        "median_bytes_per_changed_element": statistics.median(r["nbytes"] / r["changed"] for r in deltas if r["changed"]) if deltas else None,
        "anchor_bytes": anchor,
        "reward_first_minute": reward(t0, t0 + 60), "reward_last_minute": reward(t1 - 60, t1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=10, help="versions excluded from the median")
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE", help="role settings (environment variables)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args.minutes, dict(s.split("=", 1) for s in args.set), args.warmup)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
