"""Calling user code (reward functions, verifiers, remote environments) with a time bound.

A reward function may raise, hang or return NaN. :func:`call_bounded` runs one call
on its own daemon thread and waits at most ``timeout_s``; the caller gets either the
value or a short failure reason, never an exception. A call that overstays is
abandoned: Python cannot stop a thread, so it keeps running in the background until
it returns, and :data:`MAX_ABANDONED` bounds how many such threads may pile up
before further calls are refused outright (reason ``"saturated"``).

:class:`FailureCounts` keeps the reasons for the panel and ``metrics/env.json``.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_ABANDONED", "BoundedResult", "FailureCounts", "ScoringFailure", "call_bounded", "finite_reward"]

#: Abandoned (timed-out, still running) calls tolerated before new calls are refused.
MAX_ABANDONED = 16

_abandoned: set[threading.Thread] = set()
_lock = threading.Lock()


class ScoringFailure(Exception):
    """Raised by a scorer that already knows why a sample failed; the reason is counted as is."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BoundedResult:
    """What a bounded call gave: ``value`` when ``failure`` is ``None``, else the failure reason."""

    __slots__ = ("failure", "value")

    def __init__(self, value: Any = None, failure: str | None = None) -> None:
        self.value = value
        self.failure = failure

    @property
    def ok(self) -> bool:
        return self.failure is None


def _abandoned_alive() -> int:
    with _lock:
        _abandoned.difference_update([t for t in _abandoned if not t.is_alive()])
        return len(_abandoned)


def call_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> BoundedResult:
    """Run ``fn(*args, **kwargs)`` with a time bound.

    Args:
        fn: The function (user code).
        timeout_s: Seconds to wait for it.

    Returns:
        ``BoundedResult(value)``, or a failure: ``"timeout"``, ``"saturated"`` (too many earlier
        calls still running), ``"error:<ExceptionType>"``, or a :class:`ScoringFailure`'s reason.
    """
    if _abandoned_alive() >= MAX_ABANDONED:
        return BoundedResult(failure="saturated")
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - user code: anything it raises is a failure
            box["error"] = exc

    thread = threading.Thread(target=target, name="bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _lock:
            _abandoned.add(thread)
        return BoundedResult(failure="timeout")
    if "error" in box:
        error = box["error"]
        return BoundedResult(
            failure=error.reason if isinstance(error, ScoringFailure) else f"error:{type(error).__name__}"
        )
    return BoundedResult(box.get("value"))


def finite_reward(value: Any) -> BoundedResult:
    """Check that ``value`` is a finite real number (``bool`` counts as 0/1).

    Returns:
        ``BoundedResult(float)`` or a failure ``"not_a_number"`` / ``"non_finite"``.
    """
    if isinstance(value, (str, bytes)):
        return BoundedResult(failure="not_a_number")
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return BoundedResult(failure="not_a_number")
    return BoundedResult(reward) if math.isfinite(reward) else BoundedResult(failure="non_finite")


class FailureCounts:
    """Thread-safe counts of failure reasons, keyed ``"<where>: <reason>"``."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, where: str, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[f"{where}: {reason}"] += n

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
