"""The panel in headless Chromium (Playwright driving Debian's ``/usr/bin/chromium``), for tests and scripts.

:func:`open_browser` launches Chromium with the project's flags and a fresh profile folder;
:class:`ConsoleLog` records what the page writes to the browser console, so that a test or a
script can fail on any warning or error (:meth:`ConsoleLog.problems`).

Needs the ``playwright`` Python package (no ``playwright install``: Debian's Chromium is used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from typing import Any

#: Debian's Chromium, or the executable named by ``RLSYNC_CHROMIUM`` (a Chromium unpacked elsewhere).
CHROMIUM = os.environ.get("RLSYNC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
#: Browser console message types that fail a check.
PROBLEM_TYPES = ("warning", "error")
#: The panel's tabs: tab label -> ``elem_id`` of the tab.
TABS = {"Overview": "tab-overview", "Trainer": "tab-trainer", "Rollout": "tab-rollout", "Environment": "tab-env"}


@dataclasses.dataclass
class ConsoleLog:
    """Console messages and uncaught page errors of one page, as ``(type, text)``."""

    messages: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def attach(self, page: Any) -> None:
        """Record ``page``'s console messages and uncaught errors from now on."""
        page.on("console", lambda message: self.messages.append((message.type, message.text)))
        page.on("pageerror", lambda error: self.messages.append(("error", str(error))))

    def problems(self) -> list[tuple[str, str]]:
        """The warnings and errors recorded so far."""
        return [(kind, text) for kind, text in self.messages if kind in PROBLEM_TYPES]


@contextlib.contextmanager
def open_browser(viewport: tuple[int, int] = (1400, 1000)) -> Iterator[Any]:
    """A Chromium browser context (fresh ``--user-data-dir``), closed on exit.

    Args:
        viewport: Page width and height in pixels.
    """
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="rlsync-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=list(CHROMIUM_ARGS), headless=True,
            viewport={"width": viewport[0], "height": viewport[1]},
        )  # fmt: skip
        try:
            yield context
        finally:
            context.close()
