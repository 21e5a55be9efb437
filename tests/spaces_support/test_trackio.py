"""Trackio: TRAINER_REPORT_TO=trackio writes one local Trackio run with TRL's loss and reward
and our sync figures (the anchor and delta bytes of each publish), read back through Trackio's
own storage. Runs in a child process: Trackio fixes its database folder (TRACKIO_DIR) on import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_space.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
from transformers import AutoTokenizer
from env_space.environments import get_environment
from rlsync.spaces.tiny_model import tiny_model_path
from tests.trl_feed import ScoreFeeder
from trainer_space.trainer import Trainer, TrainerConfig

trainer = Trainer(TrainerConfig.from_env())
with ScoreFeeder(trainer.bucket, AutoTokenizer.from_pretrained(str(tiny_model_path(environments=get_environment)))):
    trainer.run()
from trackio.sqlite_storage import SQLiteStorage
runs = SQLiteStorage.get_runs("rlsync-test")
print("RESULT", json.dumps({"runs": runs, "logs": SQLiteStorage.get_logs("rlsync-test", runs[0]),
                            "published": [(r.step, r.kind, r.nbytes) for r in trainer.transfer.records]}, default=str))
"""


def test_report_to_defaults_to_trackio_only_on_a_space(monkeypatch):
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert TrainerConfig().report_targets() == []
    monkeypatch.setenv("SPACE_ID", "user/trainer")
    assert TrainerConfig().report_targets() == ["trackio"]
    assert TrainerConfig(report_to="none").report_targets() == []
    grpo = TrainerConfig(trackio_project="p", trackio_space_id="u/t", trackio_bucket_id="u/b").grpo_config("/tmp/x")
    assert (grpo.report_to, grpo.project, grpo.trackio_space_id, grpo.trackio_bucket_id) == (["trackio"], "p", "u/t", "u/b")


def test_a_trackio_run_holds_trl_logs_and_the_sync_figures(bucket, tmp_path):
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "TRACKIO_DIR": str(tmp_path / "trackio"), "TRAINER_BUCKET": str(bucket.root),
        "TRAINER_REPORT_TO": "trackio", "TRAINER_TRACKIO_PROJECT": "rlsync-test", "TRAINER_MAX_STEPS": "3",
        "TRAINER_ANCHOR_INTERVAL": "10", "TRAINER_POLL_S": "0.1", "TRAINER_CHECKPOINT_EVERY": "0", "TRAINER_LR": "1e-3",
    }  # fmt: skip
    env.pop("SPACE_ID", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(result["runs"]) == 1
    logs = result["logs"]
    train = [row for row in logs if "train/loss" in row]
    assert len(train) == 3 and all(isinstance(row["train/reward"], float) for row in train)
    published = {step: (kind, nbytes) for step, kind, nbytes in result["published"]}
    logged = {row["sync/version"]: row for row in logs if "sync/version" in row}
    assert set(logged) == set(published) and 0 in published and len(published) >= 3  # the initial anchor and the final publish too
    for version, (kind, nbytes) in published.items():
        assert logged[version][f"sync/{kind}_bytes"] == nbytes
    assert logged[0]["step"] == 0 and logged[max(published)]["step"] == 3  # on TRL's optimizer-step axis
