"""``python app.py`` on the rate-limited Hub stand-in, as a user runs it: versions published, requests, 429s.

    python -m benchmarks.hub_app --replicas 2 --tier free --seconds 200

Starts the Hub stand-in (:mod:`testing.hub.server`) with the tier's real limits per token in fixed
5-minute windows, runs ``python app.py --bucket hf://buckets/...`` (the TRL trainer, the env and
``--replicas`` replicas, every role on one token, each pacing itself: :mod:`rlsync.bucket.budget`)
for ``--seconds`` from its start, then stops it (SIGTERM). Prints one JSON object: the versions
published while it ran (from the stand-in's own metadata: reading the bucket while the app holds the
stand-in's storage is not possible), the requests per class and their highest share of the limit in
any window, and the 429 answers.
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
    try:
        time.sleep(args.seconds)
        with server._lock:
            keys = list(server.buckets.get(BUCKET, {}))
    finally:
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(timeout=120)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    versions = {int(m.group(1)) for k in keys if (m := ANCHOR_FILE.match(k) or DELTA_FILE.match(k))}
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
    result = {
        "tier": args.tier, "replicas": args.replicas, "seconds": args.seconds, "versions": len(versions),
        "seconds_per_version": round(args.seconds / max(1, len(versions)), 1), "requests": usage,
        "throttled_429": server.throttled(TOKEN), "app_log": str(log),
    }  # fmt: skip
    server.close()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
