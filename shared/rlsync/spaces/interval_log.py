"""One log line per interval per role: what the role did since its last line.

A role counts what it does (:meth:`IntervalLog.add`), keeps its newest figures
(:meth:`IntervalLog.note`) and calls :meth:`IntervalLog.flush` from its loop; every
``every_s`` seconds that writes one INFO line, rendered by the role, and starts a new
interval. The per-event lines (each publish, each applied version, each task batch)
are DEBUG lines (``--log-level debug``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds between two summary lines of a role.
SUMMARY_EVERY_S = 20.0

#: Renders one interval: ``(counts, newest figures, seconds)`` -> the line, or ``None`` for no line.
Render = Callable[[collections.Counter, dict[str, Any], float], "str | None"]


class IntervalLog:
    """Counts of one role, logged as one line per interval.

    Args:
        logger: Where the line goes (INFO).
        render: Makes the line from the interval's counts, the newest figures and its length in seconds.
        every_s: Seconds between lines.
        clock: Seconds, monotonic.
    """

    def __init__(
        self, logger: logging.Logger, render: Render, every_s: float = SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.logger = logger
        self.render = render
        self.every_s = every_s
        self.clock = clock
        self.counts: collections.Counter = collections.Counter()
        self.latest: dict[str, Any] = {}
        self._since = clock()
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        """Add to this interval's counts."""
        with self._lock:
            self.counts.update(amounts)

    def note(self, **values: Any) -> None:
        """Keep the newest value of some figures (a version, a loss)."""
        with self._lock:
            self.latest.update(values)

    def flush(self, force: bool = False) -> None:
        """Log the interval's line once ``every_s`` have passed (``force``: now), then start a new interval."""
        now = self.clock()
        with self._lock:
            if not force and now - self._since < self.every_s:
                return
            counts, elapsed = self.counts, now - self._since
            self.counts, self._since = collections.Counter(), now
            latest = dict(self.latest)
        line = self.render(counts, latest, elapsed) if counts else None
        if line:
            self.logger.info("%s", line)
