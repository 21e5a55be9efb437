"""``python app.py`` on the rate-limited Hub stand-in, as a user runs it: versions published, requests, 429s.

    python -m benchmarks.hub_app --replicas 2 --tier free --seconds 200

Starts the Hub stand-in (:mod:`testing.hub.server`) with the tier's real limits per token in fixed
5-minute windows, runs ``python app.py --bucket hf://buckets/...`` (the TRL trainer, the env and
``--replicas`` replicas, every role on one token, each pacing itself: :mod:`rlsync.bucket.budget`)
for ``--seconds`` from its start, then stops it (SIGTERM). Prints one JSON object: the versions
published while it ran (from the stand-in's own metadata, looked at every second: reading the bucket
while the app holds the stand-in's storage is not possible), the seconds from the start to the first
publish and the steady rate from then on (start-up excluded), the requests per class and their highest
share of the limit in any window, and the 429 answers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_app_bench"
BUCKET = "bench/app"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tier", default="free")
    parser.add_argument("--seconds", type=float, default=200.0)
    args = parser.parse_args(argv)

    from env_space.environments import get_environment
    from rlsync.bucket.budget import WINDOW_S, RequestClass, Tier, scaled_limit
    from rlsync.layout import ANCHOR_FILE, DELTA_FILE
    from rlsync.spaces.tiny_model import tiny_model_path
    from testing.hub.server import HubServer

    tiny_model_path(environments=get_environment)  # built before app.py needs it
    server = HubServer(Path(tempfile.mkdtemp(prefix="hub-app-")))
    server.add_token(TOKEN)
    server.create_bucket(BUCKET)
    server.limit(Tier(args.tier), window_s=WINDOW_S)
    url = f"hf://buckets/{BUCKET}"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_TELEMETRY", "GRADIO_ANALYTICS_ENABLED")},
        "PYTHONPATH": f"{ROOT / 'shared'}{os.pathsep}{ROOT}", "HF_ENDPOINT": server.url, "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HUB_TIER": args.tier, "HUB_PACING": "1",
        "GRADIO_SERVER_NAME": "127.0.0.1",
    }  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="hub-app-log-")) / "app.log"
    started = time.time()
    app = subprocess.Popen(
        [sys.executable, "app.py", "--bucket", url, "--replicas", str(args.replicas), "--port", str(port)],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    first_seen: dict[int, float] = {}  # version -> seconds from the start to its first file in the bucket
    try:
        while (now := time.time()) < started + args.seconds:
            time.sleep(min(1.0, started + args.seconds - now))
            with server._lock:
                keys = list(server.buckets.get(BUCKET, {}))
            for k in keys:
                if (m := ANCHOR_FILE.match(k) or DELTA_FILE.match(k)) is not None:
                    first_seen.setdefault(int(m.group(1)), round(time.time() - started, 1))
    finally:
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(timeout=120)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    versions = set(first_seen)
    first = min(first_seen.values(), default=None)
    usage = {}
    for cls in RequestClass:
        times = [r.time for r in server.usage(cls, TOKEN) if r.time <= started + args.seconds]
        per_window: dict[int, int] = {}
        for t in times:
            per_window[int((t - started) // WINDOW_S)] = per_window.get(int((t - started) // WINDOW_S), 0) + 1
        usage[cls.value] = {
            "requests": len(times), "max_share_of_limit": round(max(per_window.values(), default=0)
                                                                / scaled_limit(Tier(args.tier), cls, WINDOW_S), 3),
        }  # fmt: skip
    figures = _role_figures(server, args.replicas)
    result = {
        "tier": args.tier, "replicas": args.replicas, "seconds": args.seconds, "versions": len(versions),
        "seconds_per_version": round(args.seconds / max(1, len(versions)), 1),
        # from the first publish on (start-up, imports and the first anchor, excluded): the steady rate
        "first_publish_s": first, "versions_after_first": max(0, len(versions) - 1),
        "steady_seconds_per_version": None if first is None or len(versions) < 2
        else round((args.seconds - first) / (len(versions) - 1), 1),
        "requests": usage,
        "throttled_429": server.throttled(TOKEN), **figures, "app_log": str(log),
    }  # fmt: skip
    server.close()
    print(json.dumps(result))
    return result


def _role_figures(server, replicas: int) -> dict:
    """What gated the version rate, from the roles' own reports left in the bucket (read after the app
    stopped, so not counted above): the trainer's steps, its time waiting for samples and computing,
    each role's time waiting for its request budget and its requests by kind."""
    from huggingface_hub import constants

    from rlsync.bucket.budget import BudgetConfig, RequestMeter
    from rlsync.bucket.hf import HfBucket
    from rlsync.layout import metrics_key, status_key
    from rlsync.spaces.exchange import get_json

    constants.ENDPOINT, constants.HF_HUB_OFFLINE = server.url, False
    bucket = HfBucket(BUCKET, token=TOKEN, meter=RequestMeter(BudgetConfig(enabled=False)))
    trainer = get_json(bucket, metrics_key("trainer")) or {}
    flow = trainer.get("flow") or {}
    hubs = {"trainer": trainer.get("hub") or {}, "env": (get_json(bucket, metrics_key("env")) or {}).get("hub") or {}}
    for i in range(replicas):
        hubs[f"replica-{i}"] = (get_json(bucket, status_key(f"replica-{i}")) or {}).get("hub") or {}
    budget_wait = {role: hub.get("waited_s") for role, hub in hubs.items()}
    return {
        "trainer_steps": flow.get("steps"), "trainer_wall_s": flow.get("wall_s"),
        "trainer_wait_for_samples_s": flow.get("wait_s_total"), "trainer_step_compute_s": flow.get("step_compute_s"),
        "coalescing": trainer.get("coalescing"), "budget_wait_s": budget_wait,
        # each role's whole-run requests by kind, as of its last report (status/metrics: every 30 s)
        "requests_by_kind": {role: hub.get("by_kind") for role, hub in hubs.items()},
    }  # fmt: skip


if __name__ == "__main__":
    main()
