"""Run ``python app.py`` as a new user would and record what they see: ``python scripts/panel_screenshots.py``.

Starts ``app.py`` with its default settings on a fresh temporary bucket and a free port, opens the
panel in headless Chromium (:mod:`testing.panel_browser`) after ``--shots-after`` seconds, and saves
a full-page screenshot of each of the four tabs to ``--out``. The app keeps running until
``--seconds``; then it is stopped (SIGTERM) and the script prints (the app's whole terminal output is
saved to ``--log``):

- the browser console's warnings and errors (the script fails if there are any);
- the app's terminal output: its line count and its last lines;
- the flow figures of the run (``metrics/trainer.json`` -> ``flow``, ``metrics/env.json``): samples
  scored and trained, the share trained, expired and stale counts, the trainer's waiting, and the
  env's mean reward over its first and last minute.

Exit status 1 on a console warning or error, or when the app died.
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testing.panel_browser import TABS, ConsoleLog, open_browser  # noqa: E402

#: Seconds the page is given to draw a tab's plots after it is selected.
DRAW_S = 6.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"the panel did not come up in {timeout:.0f}s")


def screenshots(url: str, out: Path) -> list[tuple[str, str]]:
    """A full-page screenshot of each tab in ``out``; returns the console's warnings and errors."""
    console = ConsoleLog()
    with open_browser() as browser:
        page = browser.new_page()
        console.attach(page)
        page.goto(url)
        page.locator("#start-all").wait_for(timeout=120_000)
        for label, elem_id in [*list(TABS.items())[1:], *list(TABS.items())[:1]]:  # the overview last: its plots are warm
            page.get_by_role("tab", name=label).click()
            page.wait_for_timeout(DRAW_S * 1000)
            page.screenshot(path=str(out / f"{elem_id.removeprefix('tab-')}.png"), full_page=True)
    return console.problems()


def flow_figures(bucket: Path) -> dict:
    """The run's flow figures from its metrics objects."""
    trainer = json.loads((bucket / "metrics" / "trainer.json").read_bytes())
    env = json.loads((bucket / "metrics" / "env.json").read_bytes())
    flow, scored = trainer["flow"], env["scored"]
    rows = [r for r in env.get("rows", []) if isinstance(r.get("mean_reward"), (int, float))]
    t0, t1 = rows[0]["time"], rows[-1]["time"]

    def mean(rs: list[dict]) -> float:
        return sum(r["mean_reward"] * r["count"] for r in rs) / max(sum(r["count"] for r in rs), 1)

    return {
        "scored": scored, "trained": flow["trained"], "share_trained": flow["trained"] / max(scored, 1),
        "expired_unread": flow["expired_unread"], "dropped_stale": flow["dropped_stale"],
        "cancelled_stale": env.get("cancelled_stale"), "wait_share": flow["wait_share"], "steps": flow["steps"],
        "staleness": flow["staleness"], "versions": trainer.get("version"),
        "reward_first_minute": mean([r for r in rows if r["time"] < t0 + 60]),
        "reward_last_minute": mean([r for r in rows if r["time"] > t1 - 60]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shots-after", type=float, default=180.0, help="seconds of app.py before the screenshots")
    parser.add_argument("--seconds", type=float, default=270.0, help="seconds app.py runs in all")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots", help="folder of the screenshots")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "rlsync-demo-app.log", help="app.py's output")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory(prefix="rlsync-shots-") as tmp:
        bucket = Path(tmp) / "bucket"
        env = {k: v for k, v in os.environ.items() if k not in ("SPACE_ID", "PANEL_AUTH", "PORT", "GRADIO_SERVER_PORT")}
        log_path = args.log
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "app.py", "--bucket", str(bucket), "--port", str(port)], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                wait_up(url, proc)
                started = time.monotonic()
                time.sleep(max(0.0, args.shots_after - (time.monotonic() - started)))
                problems = screenshots(url, args.out)
                time.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(120)
        figures = flow_figures(bucket)
    lines = log_path.read_text(errors="replace").splitlines()
    print(f"app.py ran {args.seconds:.0f}s; its terminal: {len(lines)} lines (saved to {log_path}); the last 12:")
    print("\n".join(f"    {line}" for line in lines[-12:]))
    print("flow:", json.dumps(figures, indent=1))
    print(f"browser console: {len(problems)} warnings/errors")
    for kind, text in problems:
        print(f"    {kind}: {text[:300]}")
    return 1 if problems or proc.returncode not in (0, -signal.SIGTERM) else 0


if __name__ == "__main__":
    sys.exit(main())
