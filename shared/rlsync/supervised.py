"""Background threads that never die silently.

Every role runs loops in background threads (a replica's fetching, a watched bucket's events feed,
the trainer's rollout reader...). An exception escaping such a loop used to end its thread with a
traceback on stderr and nothing else: the role went on, stale for good. A :class:`SupervisedThread`
logs the exception with its traceback, counts it in :attr:`SupervisedThread.crashes`, and runs the
loop again after a backoff (doubling from ``backoff_s`` to ``max_backoff_s``, back to ``backoff_s``
after a run that lasted ``max_backoff_s``), until ``stop`` is set. A thread that must not be run
again (``restart=False``: a role's main loop, which holds state a second run would duplicate) stops
loudly instead: logged at ``ERROR``, counted, and its error kept in :attr:`SupervisedThread.error`
for the role's status.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0


class SupervisedThread(threading.Thread):
    """A daemon thread running ``target(*args)`` under supervision (see the module docstring).

    Args:
        target: The loop; returning ends the thread.
        name: The thread's name (in every log line about it).
        stop: Set to end the thread: no restart once set, and the backoff wait ends at once
            (``None``: a thread that ends only when ``target`` returns or fails with ``restart=False``).
        args: Arguments of ``target``.
        restart: Run ``target`` again after an exception; ``False``: stop loudly.
        backoff_s: The first wait before a restart.
        max_backoff_s: The longest wait before a restart.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        *,
        name: str,
        stop: threading.Event | None = None,
        args: Iterable[Any] = (),
        restart: bool = True,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._loop = target
        self._loop_args = tuple(args)
        self._stop_event = stop if stop is not None else threading.Event()
        self.restart = restart
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        #: Exceptions that escaped the loop.
        self.crashes = 0
        #: The last one, as ``"Type: message"`` (``None`` before the first).
        self.error: str | None = None

    def run(self) -> None:
        delay = self.backoff_s
        while True:
            started = time.monotonic()
            try:
                self._loop(*self._loop_args)
                return
            except Exception as exc:  # noqa: BLE001 - the point: no exception ends a role's thread unseen
                self.crashes += 1
                self.error = f"{type(exc).__name__}: {exc}"
                if not self.restart or self._stop_event.is_set():
                    logger.exception("thread %s failed and stopped (crash %d)", self.name, self.crashes)
                    return
                if time.monotonic() - started >= self.max_backoff_s:
                    delay = self.backoff_s  # it ran well for a while: a new failure, not the same one again
                logger.exception("thread %s failed (crash %d); restarting in %.1fs", self.name, self.crashes, delay)
            if self._stop_event.wait(delay):
                return
            delay = min(2 * delay, self.max_backoff_s)


def crashes(threads: Iterable[threading.Thread]) -> int:
    """The crashes counted by the supervised ones among ``threads``."""
    return sum(t.crashes for t in threads if isinstance(t, SupervisedThread))
