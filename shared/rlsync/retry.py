"""The retry policy: how long to wait before trying again, and how long a server may make us wait.

One place for both, used by every retrying caller:

- :class:`RetryPolicy` and :func:`call_with_retries`: exponential backoff with jitter, bounded in
  attempts and in total time (:class:`~rlsync.bucket.retry.RetryingBucket` retries every bucket
  operation with it, :class:`~rlsync.vllm.client.BucketSyncClient` a refused prefix-cache reset);
  :meth:`RetryPolicy.at_once` retries a race lost to a concurrent writer without waiting (a local
  bucket's write whose folder a delete removed, a verify replay whose files retention removed);
- :func:`retry_after_seconds`: the wait a server asked for, from ``Retry-After`` (seconds or an
  HTTP date) or the Hub's ``RateLimit`` header (``t=`` seconds to the reset once ``r=0``), read
  for the bucket's errors (:mod:`rlsync.bucket.hf`) and for the request meter's holds
  (:mod:`rlsync.bucket.budget`).

A server's answer is untrusted like every other input: a wait it asks for is bounded by the
rate-limit window (:data:`MAX_SERVER_WAIT_S` unless the caller knows a shorter one), since no
limit of the Hub lasts longer than its window; ``Retry-After: 1e9`` or ``t=999999999`` holds a
role for at most that long, and a value that is not a finite number counts as none.
:func:`ratelimit_info` reads the ``RateLimit`` headers for both: a header with a number
above :data:`MAX_RATELIMIT_NUMBER` (``t=`` of 400 digits, which overflowed a ``float``) is
ignored, as if the server had not sent it, so the request is retried as usual.
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Callable, Mapping, TypeVar

if TYPE_CHECKING:
    from huggingface_hub.utils import RateLimitInfo

__all__ = [
    "MAX_RATELIMIT_NUMBER", "MAX_SERVER_WAIT_S", "RetryPolicy", "call_with_retries", "ratelimit_info", "retry_after_seconds",
]  # fmt: skip

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The longest wait a server's answer may impose: the Hub's rate-limit window (5 minutes).
MAX_SERVER_WAIT_S = 300.0
#: The largest number a ``RateLimit`` header may carry (requests left, the limit, seconds to the reset, the
#: window); the Hub's are below 10**6.
MAX_RATELIMIT_NUMBER = 10**12


def _bounded(seconds: float, most: float) -> float | None:
    return min(most, max(0.0, seconds)) if math.isfinite(seconds) else None


def retry_after_seconds(
    headers: Mapping[str, str], window_s: float = MAX_SERVER_WAIT_S, now: Callable[[], float] = time.time
) -> float | None:
    """Seconds the server asked to wait, bounded to ``[0, window_s]``; ``None`` when it did not say.

    Args:
        headers: Response headers (any mapping; names are matched without regard to case).
        window_s: The longest wait accepted (the rate-limit window).
        now: The wall clock an HTTP-date ``Retry-After`` is measured against.

    Returns:
        The wait: ``Retry-After`` (a delay in seconds or an HTTP date), else the ``RateLimit``
        header's time to the reset when nothing is left; ``None`` for neither, or a value that is
        not a finite number or date.
    """
    lower = {str(name).lower(): value for name, value in headers.items()}
    value = str(lower.get("retry-after") or "").strip()
    if value:
        try:
            return _bounded(float(value), window_s)
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            when = None
        if when is not None and when.tzinfo is not None:
            return _bounded(when.timestamp() - now(), window_s)
    info = ratelimit_info(lower)
    if info is not None and info.remaining == 0:
        return _bounded(float(info.reset_in_seconds), window_s)
    return None


def ratelimit_info(headers: Mapping[str, str]) -> "RateLimitInfo | None":
    """The Hub's ``RateLimit`` / ``RateLimit-Policy`` headers; ``None`` when absent, malformed, or holding a
    number above :data:`MAX_RATELIMIT_NUMBER` (unusable: ignored, logged at debug level)."""
    from huggingface_hub.utils import parse_ratelimit_headers

    try:
        info = parse_ratelimit_headers(headers)
        numbers = (info.remaining, info.reset_in_seconds, info.limit, info.window_seconds) if info else ()
        usable = all(n is None or n <= MAX_RATELIMIT_NUMBER for n in numbers)
    except ValueError:  # a number past int()'s digit limit
        usable = False
    if not usable:
        logger.debug("ignoring a RateLimit header with a number above %d", MAX_RATELIMIT_NUMBER)
        return None
    return info


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a caller retries: the wait before retry ``n`` (1-based) is
    ``min(max_delay, base_delay * 2**(n-1))`` scaled by a random factor in ``[0.5, 1]`` (jitter, so many
    clients do not retry in lockstep), and at least what the server asked for (bounded by
    :func:`retry_after_seconds`).

    Args:
        max_attempts: Attempts per operation, the first included.
        base_delay: Wait before the first retry, in seconds (before jitter).
        max_delay: Cap on the exponential backoff, in seconds.
        max_total: Longest an operation may take, attempts and waits together: a retry whose wait
            would end past it is not made.

    Raises:
        ValueError: ``max_attempts`` is below 1 or a delay is negative.
    """

    max_attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    max_total: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.max_total < 0:
            raise ValueError("base_delay, max_delay and max_total must not be negative")

    @classmethod
    def at_once(cls, max_attempts: int) -> "RetryPolicy":
        """Retries with no wait and no time bound: for a race lost to a concurrent writer (the next attempt
        sees what it did), not for a server that needs sparing.

        Raises:
            ValueError: ``max_attempts`` is below 1.
        """
        return cls(max_attempts=max_attempts, base_delay=0.0, max_delay=0.0, max_total=math.inf)

    def backoff(self, retry: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), at least ``retry_after`` when given."""
        jitter = (rng or random).uniform(0.5, 1.0)
        delay = min(self.max_delay, self.base_delay * 2 ** (retry - 1)) * jitter
        return max(delay, retry_after) if retry_after is not None else delay


def call_with_retries(
    fn: Callable[[], _T],
    *,
    policy: RetryPolicy,
    retryable: type[BaseException] | tuple[type[BaseException], ...],
    give_up: Callable[[BaseException, int, float, str], BaseException],
    describe: str = "operation",
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> _T:
    """Call ``fn`` until it succeeds, retrying the ``retryable`` exceptions as ``policy`` says.

    An exception with a ``retry_after`` attribute (seconds, or ``None``) makes the wait at least that.

    Args:
        fn: The operation (must be safe to repeat).
        policy: Attempts, backoff and the total time allowed.
        retryable: The exceptions worth another attempt; any other is raised at once.
        give_up: Builds the exception raised when no attempt is left, from the last error, the
            attempts made, the seconds spent and why it stopped.
        describe: What is retried, for the log.
        sleep: Called with each wait (tests pass a recorder).
        clock: The monotonic clock ``max_total`` is measured on.
        rng: The source of jitter.

    Returns:
        What ``fn`` returned.
    """
    start = clock()
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except retryable as err:
            last = attempt == policy.max_attempts
            delay = 0.0 if last else policy.backoff(attempt, getattr(err, "retry_after", None), rng)
            elapsed = clock() - start
            if last or elapsed + delay > policy.max_total:
                why = "" if last else f" (the next wait, {delay:.1f}s, would pass the {policy.max_total:g}s limit)"
                raise give_up(err, attempt, elapsed, why) from err
            logger.warning("%s failed (attempt %d/%d): %s; retrying in %.2fs", describe, attempt, policy.max_attempts, err, delay)
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
