"""Retry transient bucket failures with exponential backoff.

:class:`RetryingBucket` wraps any :class:`Bucket` and retries operations that raised
:class:`TransientBucketError` (5xx, 429, dropped connections). Every bucket operation is
idempotent (whole-object put, delete of a set of keys), so retrying is always safe. An operation
gives up after ``max_attempts`` attempts or once the next wait would take it past ``max_total``
seconds, whichever comes first, so one call never costs unbounded time (the policy is
:mod:`rlsync.retry`'s, shared by every retrying caller).
Permanent failures (:class:`ObjectNotFoundError`, :class:`InvalidKeyError`, any other
:class:`BucketError`) are raised at once.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from ..errors import BucketError, TransientBucketError
from ..retry import RetryPolicy, call_with_retries
from .base import Bucket, BucketWrapper, ObjectInfo

__all__ = ["RetryingBucket"]

_T = TypeVar("_T")


class RetryingBucket(BucketWrapper):
    """A bucket that retries transient failures of the bucket it wraps, as :class:`~rlsync.retry.RetryPolicy` says.

    The wait before retry `n` (1-based) is `min(max_delay, base_delay * 2**(n-1))` scaled by a random
    factor in `[0.5, 1.0]` (jitter, so many clients do not retry in lockstep). When the error carries
    `retry_after` (the server said how long to wait, bounded by the rate-limit window), the wait is at
    least that long, even beyond `max_delay`: retrying earlier would only be throttled again.

    Args:
        inner ([`Bucket`]):
            The bucket to wrap.
        max_attempts (`int`, *optional*, defaults to 6):
            Attempts per operation, the first included.
        base_delay (`float`, *optional*, defaults to 0.2):
            Wait before the first retry, in seconds (before jitter).
        max_delay (`float`, *optional*, defaults to 10.0):
            Cap on the exponential backoff, in seconds.
        max_total (`float`, *optional*, defaults to 120.0):
            Longest an operation may take, attempts and waits together, in seconds: a retry whose wait
            (including a server's `Retry-After`) would end past it is not made.
        sleep (`Callable[[float], None]`, *optional*, defaults to `time.sleep`):
            Called with each wait; tests pass a recorder.
        clock (`Callable[[], float]`, *optional*, defaults to `time.monotonic`):
            The clock `max_total` is measured on.

    Raises:
        `ValueError`: `max_attempts` is below 1 or a delay is negative.
    """

    def __init__(
        self,
        inner: Bucket,
        *,
        max_attempts: int = 6,
        base_delay: float = 0.2,
        max_delay: float = 10.0,
        max_total: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = RetryPolicy(max_attempts, base_delay, max_delay, max_total)
        super().__init__(inner)
        self.max_attempts = max_attempts
        self.max_total = max_total
        self._sleep = sleep
        self._clock = clock
        self._random = random.Random()

    def backoff(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (1-based); see :meth:`RetryPolicy.backoff`."""
        return self.policy.backoff(retry, retry_after, self._random)

    def _run(self, op: str, what: str, fn: Callable[[], _T]) -> _T:
        def give_up(err: BaseException, attempts: int, elapsed: float, why: str) -> BucketError:
            return BucketError(
                f"{op} {what} on {self.url} failed after {attempts} attempt"
                f"{'s' if attempts > 1 else ''} in {elapsed:.1f}s{why}; last error: {err}"
            )

        return call_with_retries(
            fn, policy=self.policy, retryable=TransientBucketError, give_up=give_up,
            describe=f"{op} {what} on {self.url}", sleep=self._sleep, clock=self._clock, rng=self._random,
        )  # fmt: skip

    def put(self, key: str, data: bytes) -> None:
        self._run("put", repr(key), lambda: self.inner.put(key, data))

    def put_file(self, key: str, path: str | Path) -> None:
        self._run("put", repr(key), lambda: self.inner.put_file(key, path))

    def get(self, key: str) -> bytes:
        return self._run("get", repr(key), lambda: self.inner.get(key))

    def get_file(self, key: str, path: str | Path) -> None:
        self._run("get", repr(key), lambda: self.inner.get_file(key, path))

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        return self._run("get", repr(key), lambda: self.inner.get_limited(key, max_bytes))

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self._run("get", repr(key), lambda: self.inner.get_file_limited(key, path, max_bytes))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._run("list", f"prefix {prefix!r}", lambda: self.inner.list(prefix))

    def list_limited(self, prefix: str, max_keys: int) -> tuple[list[ObjectInfo], bool]:
        return self._run("list", f"prefix {prefix!r}", lambda: self.inner.list_limited(prefix, max_keys))

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        what = repr(keys[0]) if len(keys) == 1 else f"{len(keys)} keys"
        self._run("delete", what, lambda: self.inner.delete(keys))

    def exists(self, key: str) -> bool:
        return self._run("exists", repr(key), lambda: self.inner.exists(key))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, max_attempts={self.max_attempts})"
