"""Results of calling user code (reward functions, verifiers, remote environments).

A reward function may raise, hang or return NaN; the callers that bound it
(:func:`env_space.isolation.call_bounded`, :mod:`env_space.sources.reward_worker`)
give either its value or a short failure reason (:class:`BoundedResult`), never an
exception.

:class:`FailureCounts` keeps the reasons for the panel and ``metrics/env.json``.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any

from rlsync.errors import RefusedObjectError

__all__ = ["BoundedResult", "FailureCounts", "ScoringFailure", "finite_reward"]


class ScoringFailure(RefusedObjectError):
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
