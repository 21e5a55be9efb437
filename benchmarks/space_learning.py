"""Learning on free hardware: the three Space pages on the tiny model, started with no click, until the reward rises.

Launches ``python -m trainer_space.app``, ``env_space.app`` and ``rollout_space.app`` as the Spaces runtime starts
duplicates (``SYSTEM=spaces``, a ``SPACE_ID`` of another owner, only the bucket set), on a fresh local bucket in which
each role is recorded as started by its owner (``control/desired/``), so each page starts its role at boot. On a
machine of at least 6 cores each process gets 2 of its own (``cpu-basic``: 2 vCPU per Space); otherwise they share.
Prints the seconds from launch to the first published version, and to the first minute of scored samples whose mean
reward is at least ``--rise`` above the first minute's; stops at the rise or after ``--minutes``.

``--hub`` runs the stand-in run instead: the template exported (``python -m rlsync.spaces.deploy --export``), its
three Spaces run as duplicates of a new owner ``bench`` by the Spaces runtime stand-in
(:class:`testing.spaces_runtime.SpaceProcess`: the runtime's variables, the template's, only ``HF_TOKEN``) against
the Hub stand-in in its own process (:class:`testing.hub.process.HubProcess`) at the free tier's rate limits, on the
owner's default bucket ``hf://buckets/bench/rl-sync``, with ``TRAINER_REPORT_TO=none`` (:data:`NO_TRACKIO`). The
benchmark creates that bucket and records each role
``running`` in it with the owner's token before launch (what Start records), so each Space starts at boot; it reads
the bucket with a token of its own (not counted against the owner's), and adds the Hub requests per role (each role's
own count, from its metrics) and per token (the stand-in's count, with 429s) against the free tier's limits.

    python -m benchmarks.space_learning --minutes 10
    python -m benchmarks.space_learning --hub --minutes 10
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
from collections.abc import Callable
from pathlib import Path

from env_space.environments import get_environment
from rlsync.bucket import Bucket, LocalBucket
from rlsync.errors import BucketError
from rlsync.layout import status_key
from rlsync.protocol import read_manifest
from rlsync.roles import Role
from rlsync.spaces.desired import Wanted, write_desired
from rlsync.spaces.metrics import EnvMetrics, HubCounts, read_metrics
from rlsync.spaces.settings import instance_id
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
CORES_PER_SPACE = 2  # cpu-basic
#: The new owner of the duplicates in the stand-in run, its token, and the benchmark's own reader's.
OWNER, OWNER_TOKEN, OBSERVER_TOKEN = "bench", "hf_bench_write_token", "hf_observer_read_token"
#: The one variable the owner sets besides ``HF_TOKEN`` in the stand-in run: on a Space the trainer logs to the
#: owner's Trackio Space, which the stand-in cannot host (it has no Spaces API), so Trackio's start would fail.
NO_TRACKIO = {"TRAINER_REPORT_TO": "none"}


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


def watch(
    bucket: Bucket, launched: float, minutes: float, rise: float, alive: Callable[[], None]
) -> tuple[float | None, float | None, float | None]:
    """Poll ``bucket`` every 5 s until the rise or ``minutes`` after ``launched``: seconds to the first version, the
    first minute's mean reward, and the time of the rise. A read that fails (a bucket error) is tried again."""
    first_version_s = base = risen = None
    rows: dict[tuple[float, int], tuple[float, int]] = {}
    while time.time() - launched < minutes * 60 and risen is None:
        time.sleep(5)
        try:
            if first_version_s is None and read_manifest(bucket) is not None:
                first_version_s = time.time() - launched
            env = read_metrics(bucket, EnvMetrics) or EnvMetrics()
        except BucketError:
            continue  # read again at the next poll
        rows.update({(r.time, r.version): (r.mean_reward, r.count) for r in env.rows if r.time is not None})
        base, risen = rise_time(rows, rise)
        alive()
    return first_version_s, base, risen


def figures(launched: float, minutes: float, rise: float, first: float | None, base, risen, manifest) -> dict:
    return {
        "cores": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "minutes_max": minutes,
        "launch_to_first_version_s": first, "reward_first_minute": base,
        "launch_to_reward_rise_s": None if risen is None else risen - launched, "rise": rise,
        "versions": manifest.step if manifest else None,
    }  # fmt: skip


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

        def alive() -> None:
            assert all(p.poll() is None for p in procs), f"a Space process ended; see its log in {logs}"

        try:
            first, base, risen = watch(bucket, launched, minutes, rise, alive)
        finally:
            for p in procs:
                p.terminate()  # SIGTERM, as before a restart
            for p in procs:
                p.wait(300)
        manifest = read_manifest(bucket)
    return {**figures(launched, minutes, rise, first, base, risen, manifest), "pinned_2_per_space": pinned}


def run_hub(minutes: float, rise: float, logs: Path | None = None) -> dict:
    """The stand-in run (``--hub``): see the module's docstring."""
    from huggingface_hub import HfApi, constants

    from rlsync.bucket.budget import HUB_LIMITS, WINDOW_S, BudgetConfig, RequestMeter, Tier
    from rlsync.bucket.hf import HfBucket
    from rlsync.spaces import deploy
    from rlsync.spaces.metrics import TrainerMetrics, read_status
    from testing.hub.process import HubProcess
    from testing.spaces_runtime import SpaceProcess, template_variables

    tiny_model_path(environments=get_environment)
    with tempfile.TemporaryDirectory(prefix="rlsync-space-learning-hub-") as tmp:
        logs = logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        export, hub_root = Path(tmp) / "template", Path(tmp) / "hub"
        hub_root.mkdir()
        assert deploy.main(["--export", str(export)], out=open(os.devnull, "w")) == 0  # noqa: SIM115
        hub = HubProcess(hub_root)
        spaces: list[SpaceProcess] = []
        try:
            hub.add_user(OWNER, OWNER_TOKEN)
            hub.add_user("observer", OBSERVER_TOKEN)
            hub.limit(Tier.FREE.value, WINDOW_S)
            os.environ["HF_ENDPOINT"] = constants.ENDPOINT = hub.url
            constants.HF_HUB_OFFLINE = False

            def bucket_of(token: str) -> HfBucket:
                return HfBucket(f"{OWNER}/rl-sync", token=token, api=HfApi(endpoint=hub.url, token=token),
                                meter=RequestMeter(BudgetConfig(enabled=False)))  # fmt: skip

            HfApi(endpoint=hub.url, token=OWNER_TOKEN).create_bucket(f"{OWNER}/rl-sync")
            owners = bucket_of(OWNER_TOKEN)
            for role in Role:  # what the owner's Start records
                instance = instance_id({"SPACE_ID": f"{OWNER}/rl-sync-{role}"})
                write_desired(owners, role, Wanted.RUNNING, instance=instance)
            bucket = bucket_of(OBSERVER_TOKEN)
            launched = time.time()
            for role in (Role.TRAINER, Role.ENV, Role.ROLLOUT):
                template, space_id = f"rl-sync-{role}", f"{OWNER}/rl-sync-{role}"
                spaces.append(SpaceProcess(
                    export / template, space_id, hub, secrets={"HF_TOKEN": OWNER_TOKEN},
                    variables={**template_variables(export, template), **NO_TRACKIO}, log=logs / f"{role}.log",
                ))  # fmt: skip

            def alive() -> None:
                assert all(s.proc.poll() is None for s in spaces), f"a Space process ended; see its log in {logs}"

            first, base, risen = watch(bucket, launched, minutes, rise, alive)
            manifest = read_manifest(bucket, uncached=True)
            replica = read_status(bucket, status_key(instance_id({"SPACE_ID": f"{OWNER}/rl-sync-{Role.ROLLOUT}"})))
            per_role = {Role.TRAINER: (read_metrics(bucket, TrainerMetrics) or TrainerMetrics()).hub,
                        Role.ENV: (read_metrics(bucket, EnvMetrics) or EnvMetrics()).hub,
                        Role.ROLLOUT: replica.hub if replica else None}  # fmt: skip
            usage = hub.usage()
        finally:
            for space in spaces:
                space.close()
            hub.close()
    return {
        **figures(launched, minutes, rise, first, base, risen, manifest), "bucket": f"hf://buckets/{OWNER}/rl-sync",
        "free_tier_limits_per_5min": {cls.value: n for cls, n in HUB_LIMITS[Tier.FREE].items()},
        "requests_by_role": {str(role): _counts(c) for role, c in per_role.items()},
        "requests_by_token": {name: usage.get(token) for name, token in (("owner (3 Spaces)", OWNER_TOKEN),
                                                                      ("benchmark reads", OBSERVER_TOKEN))},
    }  # fmt: skip


def _counts(hub: HubCounts | None) -> dict | None:
    """A role's own Hub request counts (its meter's), as of its last metrics write: this window's and the limits it
    reports, the run's by kind."""
    if hub is None:
        return None
    return {"api_this_window": hub.api, "resolver_this_window": hub.resolver,
            "limits": [hub.api_limit, hub.resolver_limit], "run_total_by_kind": hub.by_kind,
            "throttled": hub.throttled, "waited_s": round(hub.waited_s, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="stop after this long without the rise")
    parser.add_argument("--rise", type=float, default=0.1, help="the rise of the mean reward to wait for")
    parser.add_argument("--logs", type=Path, help="keep the three processes' logs in this folder")
    parser.add_argument("--hub", action="store_true", help="the stand-in run: exported duplicates on the Hub stand-in")
    args = parser.parse_args()
    print(json.dumps((run_hub if args.hub else run)(args.minutes, args.rise, args.logs), indent=2))


if __name__ == "__main__":
    main()
