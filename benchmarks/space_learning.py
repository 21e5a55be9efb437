"""Learning on free hardware: the three Space pages on the tiny model, started with no click, until the reward rises.

Launches ``python -m trainer_space.app``, ``env_space.app`` and ``rollout_space.app`` as the Spaces runtime starts
duplicates (``SYSTEM=spaces``, a ``SPACE_ID`` of another owner, only the bucket set), on a fresh local bucket in which
each role is recorded as started by its owner (``control/desired/``), so each page starts its role at boot. On a
machine of at least 6 cores each process gets 2 of its own (``cpu-basic``: 2 vCPU per Space); otherwise they share.
Prints the seconds from launch to the first published version, and to the first minute of scored samples whose mean
reward is at least ``--rise`` above the first minute's; stops at the rise or after ``--minutes``.

    python -m benchmarks.space_learning --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from env_space.environments import get_environment
from rlsync.bucket import LocalBucket
from rlsync.protocol import read_manifest
from rlsync.roles import Role
from rlsync.spaces.desired import Wanted, instance_id, write_desired
from rlsync.spaces.metrics import EnvMetrics, read_metrics
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
CORES_PER_SPACE = 2  # cpu-basic


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def space_env(role: Role, bucket: Path, port: int) -> dict[str, str]:
    """The variables the Spaces runtime gives a duplicate of ``role`` by the owner ``bench``."""
    return {
        **os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "shared"), str(ROOT))), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "SYSTEM": "spaces", "SPACE_ID": f"bench/rl-sync-{role}",
        "SPACE_AUTHOR_NAME": "bench",
        "SPACE_HOST": f"bench-rl-sync-{role}.hf.space", "GRADIO_SERVER_NAME": "127.0.0.1", "PORT": str(port),
        f"{role.env_prefix}_BUCKET": str(bucket), "TRAINER_REPORT_TO": "none", "OMP_NUM_THREADS": str(CORES_PER_SPACE),
    }  # fmt: skip


def rise_time(rows: dict[tuple[float, int], tuple[float, int]], rise: float) -> tuple[float | None, float | None]:
    """The first minute's mean reward and the end of the first 60 s window whose mean is ``rise`` above it."""
    times = sorted(rows)
    if not times:
        return None, None

    def mean(lo: float, hi: float) -> float | None:
        picked = [rows[t] for t in times if lo <= t[0] <= hi]
        n = sum(c for _, c in picked)
        return sum(m * c for m, c in picked) / n if n else None

    t0 = times[0][0]
    base = mean(t0, t0 + 60)
    for t, _ in times:
        if t >= t0 + 120 and (m := mean(t - 60, t)) is not None and base is not None and m >= base + rise:
            return base, t
    return base, None


def run(minutes: float, rise: float, logs: Path | None = None) -> dict:
    tiny_model_path(environments=get_environment)
    cores = os.cpu_count() or 1
    pinned = cores >= 3 * CORES_PER_SPACE
    with tempfile.TemporaryDirectory(prefix="rlsync-space-learning-") as tmp:
        bucket, logs = LocalBucket(Path(tmp) / "bucket"), logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for role in Role:
            write_desired(bucket, role, Wanted.RUNNING, instance=instance_id({"SPACE_ID": f"bench/rl-sync-{role}"}))
        procs = []
        launched = time.time()
        for i, role in enumerate((Role.TRAINER, Role.ENV, Role.ROLLOUT)):
            cpus = set(range(i * CORES_PER_SPACE, (i + 1) * CORES_PER_SPACE)) if pinned else None
            procs.append(subprocess.Popen(
                [sys.executable, "-m", f"{role}_space.app"], cwd=ROOT, env=space_env(role, bucket.root, free_port()),
                stdout=open(logs / f"{role}.log", "w"), stderr=subprocess.STDOUT,
                preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None,
            ))  # fmt: skip
        first_version_s = None
        rows: dict[tuple[float, int], tuple[float, int]] = {}
        base = risen = None
        try:
            while time.time() - launched < minutes * 60 and risen is None:
                time.sleep(5)
                if first_version_s is None and read_manifest(bucket) is not None:
                    first_version_s = time.time() - launched
                env = read_metrics(bucket, EnvMetrics) or EnvMetrics()
                rows.update({(r.time, r.version): (r.mean_reward, r.count) for r in env.rows if r.time is not None})
                base, risen = rise_time(rows, rise)
                assert all(p.poll() is None for p in procs), f"a Space process ended; see its log in {logs}"
        finally:
            for p in procs:
                p.terminate()  # SIGTERM, as before a restart
            for p in procs:
                p.wait(300)
        manifest = read_manifest(bucket)
    return {
        "cores": cores, "pinned_2_per_space": pinned, "load_avg_1min": os.getloadavg()[0], "minutes_max": minutes,
        "launch_to_first_version_s": first_version_s, "reward_first_minute": base,
        "launch_to_reward_rise_s": None if risen is None else risen - launched, "rise": rise,
        "versions": manifest.step if manifest else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="stop after this long without the rise")
    parser.add_argument("--rise", type=float, default=0.1, help="the rise of the mean reward to wait for")
    parser.add_argument("--logs", type=Path, help="keep the three processes' logs in this folder")
    args = parser.parse_args()
    print(json.dumps(run(args.minutes, args.rise, args.logs), indent=2))


if __name__ == "__main__":
    main()
