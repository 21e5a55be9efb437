"""The combined panel in a real browser (headless Chromium driven by Playwright).

Starts ``python app.py --no-autostart --fresh`` on a temporary bucket, presses
Start in the page, waits until the recent-publishes table shows published
versions, sets the anchor interval to 2 with the anchor controls, and checks,
from the page and from the bucket's ``latest.json``, that the anchors published
after the change come every 2 versions. Then the trainer tab's Stop and Start
buttons stop the trainer and resume it from the bucket. Every tab is shown with
its plots drawn, and the browser console holds no warning and no error (issue 31:
Gradio's native plots logged 24-28 Vega-Lite warnings per page load).

Needs the ``playwright`` Python package and Debian's Chromium at
``/usr/bin/chromium`` (no ``playwright install``); skipped otherwise
(:mod:`testing.panel_browser`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEW_INTERVAL = 2
SCREENSHOT = "/tmp/panel.png"
TIMEOUT_SCREENSHOT = "/tmp/panel-timeout.png"
# Small settings so that versions are published every fraction of a second on 2 CPU cores.
APP_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "GRADIO_ANALYTICS_ENABLED": "False",
    "GRADIO_SERVER_NAME": "127.0.0.1",
    "TRAINER_BATCH_SIZE": "4",
    "ENV_TASKS_PER_BATCH": "2",
    "ROLLOUT_SAMPLES_PER_TASK": "2",
    "ROLLOUT_MAX_NEW_TOKENS": "6",
}

pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install playwright)")
from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402

from testing.panel_browser import CHROMIUM, TABS, ConsoleLog, open_browser  # noqa: E402
from testing.served import LoggedProcess, poll_until  # noqa: E402

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """The ``app.py`` subprocess and where it writes."""

    def __init__(self, tmp_path: Path) -> None:
        self.bucket = tmp_path / "bucket"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = tmp_path / "app.log"
        env = {k: v for k, v in os.environ.items() if k not in ("SPACE_ID", "PANEL_AUTH", "PORT", "GRADIO_SERVER_PORT")}
        env.update(APP_ENV)
        cmd = [
            sys.executable,
            "app.py",
            "--no-autostart",
            "--fresh",
            "--bucket",
            str(self.bucket),
            "--port",
            str(self.port),
            "--replicas",
            "1",
        ]
        self.process = LoggedProcess(cmd, cwd=ROOT, env=env, log=self.log_path)

    def log_tail(self, n: int = 4000) -> str:
        return self.process.log_tail(n)

    def wait_ready(self, timeout: float = 120) -> None:
        self.process.wait_served(self.url, "app.py", timeout)

    def manifest(self) -> dict | None:
        path = self.bucket / "latest.json"
        return json.loads(path.read_bytes()) if path.exists() else None

    def close(self) -> None:
        self.process.close()  # SIGTERM: app.py stops the roles and exits


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    running = App(tmp_path)
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()
        print(f"--- app.py log tail ---\n{running.log_tail()}")


def wait_for(what: str, check: Callable[[], object], timeout: float, app: App, page=None, every: float = 0.5) -> object:
    """Poll ``check`` until it returns something truthy; fail with the page's state and the app's log otherwise."""

    def describe() -> str:
        shown = ""
        if page is not None:
            page.screenshot(path=TIMEOUT_SCREENSHOT, full_page=True)
            selected = page.get_by_role("tab", selected=True).all_inner_texts()
            table = page.locator("#trainer-recent-publishes").inner_text()[:600]
            shown = f"selected tab: {selected}; trainer table: {table!r}; screenshot: {TIMEOUT_SCREENSHOT}\n"
        return f"{shown}--- app.py log tail ---\n{app.log_tail()}"

    return poll_until(what, check, timeout, describe, every)


def show_tab(page, label: str) -> None:
    """Click the tab ``label`` until the page shows it selected (a click can land before the tabs are wired)."""
    tab = page.get_by_role("tab", name=label)
    for _ in range(3):
        tab.click()
        try:
            page.get_by_role("tab", name=label, selected=True).wait_for(timeout=5_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the {label} tab was not selected after 3 clicks")


def publishes_from_page(page) -> list[tuple[int, str]]:
    """``(version, kind)`` rows of the trainer tab's recent-publishes table, as the page shows them."""
    text = page.locator("#trainer-recent-publishes").inner_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "% changed" not in lines:
        return []
    cells = lines[lines.index("% changed") + 1 :]
    rows = []
    for i in range(0, len(cells) - 3, 4):
        version, kind = cells[i], cells[i + 1]
        if version.isdigit() and kind in ("anchor", "delta"):
            rows.append((int(version), kind))
    return rows


def test_panel_start_and_anchor_interval(app: App) -> None:
    t0 = time.monotonic()
    console = ConsoleLog()
    with open_browser() as browser:
        page = browser.new_page()
        console.attach(page)
        page.goto(app.url)
        page.locator("#start-all").wait_for(timeout=60_000)
        assert "stopped" in page.locator("#overview-status").inner_text()
        assert app.manifest() is None, "--no-autostart published weights before Start was pressed"

        # Start from the page; the trainer tab then shows the publishes.
        page.locator("#start-all").click()
        show_tab(page, "Trainer")
        rows = wait_for(
            "publishes in the page's table",
            lambda: len(publishes_from_page(page)) >= 3 and publishes_from_page(page),
            150,
            app,
            page,
        )
        assert "running" in page.locator("#trainer-status-trainer").inner_text()
        print(f"first publishes visible after {time.monotonic() - t0:.0f}s: {rows[:5]}")

        # Change the anchor interval in the page.
        page.locator("#trainer-anchor-policy label").filter(has_text="fixed").click()
        page.locator("#trainer-anchor-interval input").fill(str(NEW_INTERVAL))
        page.locator("#trainer-anchor-apply").click()
        wait_for(
            "the Apply confirmation",
            lambda: f'"interval": {NEW_INTERVAL}' in page.locator("#trainer-anchor-result").inner_text(),
            30,
            app,
            page,
        )
        applied_at = app.manifest()["step"]
        control = json.loads((app.bucket / "control" / "publisher.json").read_bytes())
        assert control == {"policy": "fixed", "interval": NEW_INTERVAL}
        wait_for(
            "the policy line",
            lambda: (
                f"every {NEW_INTERVAL} publishes" in page.locator("#trainer-anchor-policy-current").inner_text()
            ),
            30,
            app,
            page,
        )

        # A publish already under way when Apply landed may still use the old policy.
        first_new = applied_at + 2
        wait_for(
            "six publishes after the change",
            lambda: max((v for v, _ in publishes_from_page(page)), default=-1) >= first_new + 5,
            120,
            app,
            page,
        )
        rows = sorted(r for r in publishes_from_page(page) if r[0] >= first_new)
        print(f"after Apply at version {applied_at}: {rows}")
        versions = [v for v, _ in rows]
        assert versions == list(range(versions[0], versions[-1] + 1)), f"the table skips versions: {rows}"
        anchors = [v for v, k in rows if k == "anchor"]
        assert len(anchors) >= 2, f"expected anchors every {NEW_INTERVAL} versions: {rows}"
        assert all(b - a == NEW_INTERVAL for a, b in itertools.pairwise(anchors)), (
            f"anchors not every {NEW_INTERVAL}: {rows}"
        )
        assert anchors[0] - versions[0] < NEW_INTERVAL and versions[-1] - anchors[-1] < NEW_INTERVAL, rows

        page.screenshot(path=SCREENSHOT, full_page=True)

        # The trainer tab's Stop stops publishing; its Start resumes from the bucket.
        page.locator("#trainer-stop-trainer").click()
        wait_for(
            "the trainer to stop",
            lambda: "stopped" in page.locator("#trainer-status-trainer").inner_text(),
            90,
            app,
            page,
        )
        stopped_at = app.manifest()["step"]
        time.sleep(3)
        assert app.manifest()["step"] == stopped_at, "the trainer kept publishing after Stop"
        wait_for(
            "the stopped trainer's last version in the page",
            lambda: max((v for v, _ in publishes_from_page(page)), default=-1) >= stopped_at,
            60,
            app,
            page,
        )
        # Cross-check with the bucket's pointer, once the stopped trainer's last version is on the page (while it
        # publishes, the page may lag behind the few versions the pointer retains): the retained anchors are
        # NEW_INTERVAL apart, and the page reports the same kinds as the pointer for the versions both show.
        manifest = app.manifest()
        kept = [a["step"] for a in manifest["anchors"]]
        new_kept = [s for s in kept if s >= first_new]
        assert len(new_kept) >= 2 and all(b - a == NEW_INTERVAL for a, b in itertools.pairwise(new_kept)), manifest
        bucket_kinds = {d["step"]: "delta" for d in manifest["deltas"]} | {
            a["step"]: "anchor" for a in manifest["anchors"]  # an anchor step also has a companion delta
        }
        page_rows = dict(publishes_from_page(page))
        common = set(page_rows) & set(bucket_kinds)
        assert common and all(page_rows[v] == bucket_kinds[v] for v in common), (page_rows, bucket_kinds)

        page.locator("#trainer-start-trainer").click()
        wait_for(
            "publishes after restarting the trainer", lambda: app.manifest()["step"] > stopped_at + 1, 120, app
        )
        wait_for(
            "the restarted trainer in the page",
            lambda: max((v for v, _ in publishes_from_page(page)), default=-1) > stopped_at,
            60,
            app,
            page,
        )

        assert "running" in page.locator("#trainer-status-trainer").inner_text()
        assert re.search(r"\breplica\b", page.locator("#trainer-fleet-table").inner_text())

        # Every tab with its plots drawn, and not one console warning or error on the way.
        for label in TABS:
            show_tab(page, label)
            page.wait_for_timeout(4000)
        drawn = page.locator("#overview-plot-staleness canvas, #overview-plot-staleness svg")
        assert drawn.count() >= 1, "the overview's staleness plot was not drawn"
        show_tab(page, "Trainer")
        # a TrainRow figure, drawn from metrics/trainer.json's typed rows (Vega's marks: not the empty plot's icon)
        page.locator("#trainer-plot-train-loss .marks").first.wait_for(timeout=30_000)
        assert console.problems() == [], console.problems()
    print(f"browser test took {time.monotonic() - t0:.0f}s")
