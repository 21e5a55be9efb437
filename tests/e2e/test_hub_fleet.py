"""The fleet within the Hub's request budget: ``python app.py --bucket hf://...`` (the trainer, TRL
AsyncGRPOTrainer, the environment and two replicas, as a new user runs it) on the rate-limited Hub
stand-in (free tier, the window shortened to 30 s with the limits scaled to match), every role
sharing one token, as a deployment does.

Every role follows the events feed and paces itself to its share, so the Hub never answers 429,
no request goes to a telemetry endpoint, and every replica ends within 2 versions of the trainer.
About 2-3 minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from env_space.environments import get_environment
from rlsync.bucket.budget import RequestClass, Tier, scaled_limit
from rlsync.bucket.hf import HfBucket
from rlsync.layout import metrics_key, status_key
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import get_json
from rlsync.spaces.metrics import read_status
from rlsync.spaces.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_fleet_token"
BUCKET = "me/fleet"
WINDOW_S = 30
STEPS = 2
#: What the trainer role logs once its run ended: the final publish and the final metrics are written.
FINISHED = f"trainer finished at step {STEPS}"
#: After that, how long the replicas have to apply the final version (they follow the feed: seconds).
REPLICAS_APPLY_S = 10


def trained(hub) -> bool:
    """Whether the trainer saved its final checkpoint (at ``max_steps``), from the stand-in's metadata."""
    with hub._lock:
        keys = list(hub.buckets.get(BUCKET, {}))
    return f"checkpoints/{STEPS:010d}/COMPLETE.json" in keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_env_and_two_replicas_stay_within_the_free_tier(hub, tmp_path):
    tiny_model_path(environments=get_environment)  # built once, before the processes race for it
    hub.add_token(TOKEN)
    hub.create_bucket(BUCKET)
    hub.limit(Tier.FREE, window_s=WINDOW_S)
    url = f"hf://buckets/{BUCKET}"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_TELEMETRY", "GRADIO_ANALYTICS_ENABLED")},
        "PYTHONPATH": f"{ROOT / 'shared'}{os.pathsep}{ROOT}", "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
        "HUB_TIER": "free", "HUB_WINDOW_S": str(WINDOW_S), "HUB_PACING": "1",
        "TRAINER_BUCKET": url, "ROLLOUT_BUCKET": url, "ENV_BUCKET": url,
        "TRAINER_MAX_STEPS": str(STEPS), "TRAINER_BATCH_SIZE": "16", "TRAINER_ANCHOR_INTERVAL": "4",
        "ROLLOUT_STATUS_EVERY_S": "5", "ENV_METRICS_EVERY_S": "10", "TRAINER_METRICS_EVERY_S": "10",
    }  # fmt: skip
    log = tmp_path / "app.log"
    app = subprocess.Popen(
        [sys.executable, "app.py", "--bucket", url, "--replicas", "2", "--max-steps", str(STEPS), "--port", str(free_port())],
        cwd=ROOT, env={**env, "GRADIO_SERVER_NAME": "127.0.0.1"}, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        # Read only the stand-in's own metadata and the app's log while the app runs (no request of the
        # test's own in the window): the trainer is done once its final checkpoint is
        # there and it logged its end, which comes after its final publish (coalesced steps) and metrics.
        deadline = time.time() + 500
        while time.time() < deadline and app.poll() is None and not (trained(hub) and FINISHED in log.read_text()):
            time.sleep(1)
        assert FINISHED in log.read_text(), log.read_text()[-4000:]
        time.sleep(REPLICAS_APPLY_S)
    finally:
        app.send_signal(signal.SIGTERM)  # the roles stop cleanly; each replica writes its final status
        try:
            app.wait(timeout=120)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    hub.add_token("reader", "read")
    reader = HfBucket(BUCKET, token="reader")  # the test's own reads use another token: not in the budget
    manifest = read_manifest(reader)
    statuses = [read_status(reader, status_key(f"replica-{i}")) for i in range(2)]
    logs = log.read_text()[-4000:]
    assert manifest is not None and manifest.step >= 1, logs  # publishes may be coalesced: versions <= steps
    assert hub.throttled(TOKEN) == 0, logs
    for s in statuses:
        assert (s.applied_step or -10) >= manifest.step - 2, (statuses, manifest.step, logs)
        # its whole-run counts (a replica idle since the trainer's last step may have none in the last window)
        assert s.hub.tier is Tier.FREE and sum(s.hub.by_kind.values()) > 0 and s.hub.throttled == 0
    # the budget held in every fixed window (the stand-in counts per token and class)
    for cls in RequestClass:
        times = [r.time for r in hub.usage(cls, TOKEN)]
        if times:
            start = times[0]
            per_window: dict[int, int] = {}
            for t in times:
                per_window[int((t - start) // WINDOW_S)] = per_window.get(int((t - start) // WINDOW_S), 0) + 1
            assert max(per_window.values()) <= scaled_limit(Tier.FREE, cls, WINDOW_S), (cls, per_window)
    # the roles followed the feed and nothing phoned home
    assert hub.count("api", "/events$") >= 4  # trainer, env, 2 replicas (the panel's view too)
    assert hub.count("api", "/api/telemetry") == 0 and hub.count("api", "/api/agent-harnesses") == 0
    # each role reports its own counts for the panels
    trainer_metrics = get_json(reader, metrics_key("trainer"))
    assert trainer_metrics["opt_steps"] == STEPS and trainer_metrics["version"] == manifest.step, logs
    trainer_hub = trainer_metrics["hub"]
    assert trainer_hub["tier"] == "free" and sum(trainer_hub["by_kind"].values()) > 0 and trainer_hub["throttled"] == 0
