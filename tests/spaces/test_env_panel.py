"""The environment panel in a real browser: pick a reasoning-gym source and its settings before Start, then see
rewards per task type, scoring failures and recent episodes.

Starts ``python -m env_space.app`` (the env Space alone, no model) on a temporary bucket. The test plays the
replicas: it answers the published tasks by writing rollouts objects (correct, wrong, malformed) into the bucket.
Needs playwright and Debian's Chromium at ``/usr/bin/chromium``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from env_space.sources import open_environment
from env_space.sources.settings import ReasoningGymConfig
from rlsync.bucket import LocalBucket
from rlsync.layout import rollout_key
from rlsync.spaces.exchange import Sample, write_samples

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SPEC = "reasoning_gym:leg_counting=2,basic_arithmetic"
MARK = "PANEL-SYSTEM-PROMPT. Answer inside <answer></answer>."

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)


def _wait(what: str, check, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n--- log ---\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture
def panel(tmp_path):
    """``python -m env_space.app`` on 127.0.0.1, the toy task preselected; yields (url, bucket path, log path)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bucket, log = tmp_path / "bucket", tmp_path / "panel.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENV_", "SPACE_ID", "PANEL_AUTH"))}
    env.update({"ENV_BUCKET": str(bucket), "ENV_ENVIRONMENT": "reverse", "ENV_TASKS_PER_BATCH": "2",
                "ENV_QUEUE_DEPTH": "1", "PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1",
                "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)])})  # fmt: skip
    with open(log, "wb") as out:
        command = ["timeout", "300", sys.executable, "-m", "env_space.app"]  # stops by itself whatever happens
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/"

            def up() -> bool:
                assert process.poll() is None, log.read_text(errors="replace")[-3000:]
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        return response.status == 200
                except OSError:
                    return False

            _wait("the panel", up, 120, log)
            yield url, bucket, log
        finally:
            process.terminate()
            process.wait(30)


def _answer_published_tasks(bucket_path: Path, log: Path) -> int:
    """Play a replica: answer the first task batch with correct, wrong and malformed completions."""
    tasks_dir = bucket_path / "tasks"
    first = _wait(
        "a published task batch", lambda: sorted(tasks_dir.glob("*.json")) if tasks_dir.exists() else [], 60, log
    )
    doc = json.loads(first[0].read_bytes())
    assert doc["env"] == "reasoning_gym:leg_counting=2,basic_arithmetic=1"
    source = open_environment(SPEC, settings=ReasoningGymConfig(level=0, system_prompt=MARK))
    answers = {t.task_id: t for t in source.tasks(doc["n"], seed=doc["seed"])}
    samples = []
    for t in doc["tasks"]:
        assert t["prompt"] == answers[t["task_id"]].prompt and t["prompt"].startswith(MARK)  # the form's settings
        for completion in (f"<answer>{answers[t['task_id']].answer}</answer>", "<answer>-1</answer>", "no tag"):
            samples.append(Sample(t["task_id"], t["prompt"], completion, [1], [2], [-0.5], 0))
    write_samples(LocalBucket(bucket_path), rollout_key(doc["batch"], "r0"), samples, batch=doc["batch"])
    return len(samples)


def test_pick_a_source_and_its_settings_then_see_rewards_per_task_type(panel):
    url, bucket_path, log = panel
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(url)
            assert not page.locator("#reasoning_gym-cfg-level").is_visible()  # the toy task has no source settings
            selector = page.locator("#cfg-environment input")
            selector.click()
            selector.fill(SPEC)
            selector.press("Enter")
            page.locator("#reasoning_gym-cfg-level").wait_for(state="visible", timeout=20_000)
            page.locator("#reasoning_gym-cfg-level input").fill("0")
            page.locator("#reasoning_gym-cfg-system_prompt textarea").fill(MARK)
            page.locator("#start-env").click()
            _wait("running", lambda: "running" in page.locator("#status-env").inner_text(), 60, log)
            written = _answer_published_tasks(bucket_path, log)

            by_type = _wait(
                "rewards per task type on the page",
                lambda: (text := page.locator("#env-by-type").inner_text()) and "reasoning_gym" in text and text,
                60,
                log,
            )
            assert "leg_counting" in by_type or "basic_arithmetic" in by_type
            metrics = json.loads((bucket_path / "metrics" / "env.json").read_bytes())
            assert sum(v["count"] for v in metrics["by_type"].values()) == written
            episodes = page.locator("#episodes").inner_text()
            assert "<answer>-1</answer>" in episodes or "no tag" in episodes
            page.locator("#stop-env").click()
        finally:
            browser.close()
