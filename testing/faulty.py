"""A fault-injecting bucket wrapper for tests and soak runs.

:class:`FaultyBucket` wraps any :class:`Bucket` and, driven by a seeded random generator, injects
the failures a remote object store shows in practice:

- **latency**: every operation first sleeps `latency` seconds;
- **server errors**: with probability `error_rate` an operation fails before it runs with
  `TransientBucketError("503 ...")`;
- **throttling**: with probability `throttle_rate` an operation fails before it runs with
  `TransientBucketError("429 ...", retry_after=retry_after)`;
- **uploads cut short**: with probability `truncate_rate` a `put`/`put_file` stores only a prefix of
  the bytes under the key and then raises `TransientBucketError`, as a connection broken mid-upload
  would against a store whose writes are not atomic. A reader may then see the partial object until
  the writer retries, so consumers must verify what they read (sizes, hashes);
- **listings that lag behind writes** (eventual consistency): a key newly created by `put`/`put_file`
  is left out of the next `list_lag` results of `list()`; `get`/`exists` see it at once, and
  overwriting a key that already exists does not hide it.

Given the same seed and the same sequence of calls, the same faults are injected. Counts of what
was injected, by kind, are kept in :attr:`FaultyBucket.injected`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Iterable

from rlsync.bucket import Bucket, BucketWrapper, ObjectInfo, validate_key
from rlsync.errors import TransientBucketError

__all__ = ["FaultyBucket", "ReadCountingBucket"]

logger = logging.getLogger(__name__)

FAULT_KINDS = ("latency", "error", "throttle", "truncate", "lag")


class FaultyBucket(BucketWrapper):
    """Wrap a bucket and inject latency, transient errors, throttling, truncated uploads and lagging listings.

    Every operation draws one number from the seeded generator to decide on an error or throttle
    (checked in that order); `put`/`put_file` draw a second one to decide on truncation (and a third
    for where to cut).

    Args:
        inner ([`Bucket`]):
            The bucket that really stores the objects.
        seed (`int`, *optional*, defaults to 0):
            Seed of the fault generator.
        latency (`float`, *optional*, defaults to 0.0):
            Seconds slept before every operation.
        error_rate (`float`, *optional*, defaults to 0.0):
            Probability that an operation fails with a transient 503.
        throttle_rate (`float`, *optional*, defaults to 0.0):
            Probability that an operation fails with a 429 carrying `retry_after`.
        retry_after (`float`, *optional*, defaults to 0.05):
            The `retry_after` of injected 429s, in seconds.
        truncate_rate (`float`, *optional*, defaults to 0.0):
            Probability that a non-empty upload stores only a strict prefix of its bytes, then fails.
        list_lag (`int`, *optional*, defaults to 0):
            Number of `list()` calls a newly written key stays invisible to.

    Raises:
        `ValueError`: a rate is outside `[0, 1]`, `error_rate + throttle_rate > 1`, or a delay or lag is negative.
    """

    def __init__(
        self,
        inner: Bucket,
        *,
        seed: int = 0,
        latency: float = 0.0,
        error_rate: float = 0.0,
        throttle_rate: float = 0.0,
        retry_after: float = 0.05,
        truncate_rate: float = 0.0,
        list_lag: int = 0,
    ) -> None:
        rates = {"error_rate": error_rate, "throttle_rate": throttle_rate, "truncate_rate": truncate_rate}
        for name, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if error_rate + throttle_rate > 1.0:
            raise ValueError("error_rate + throttle_rate must not exceed 1")
        if latency < 0 or retry_after < 0 or list_lag < 0:
            raise ValueError("latency, retry_after and list_lag must not be negative")
        super().__init__(inner)
        self.seed = seed
        self.latency = latency
        self.error_rate = error_rate
        self.throttle_rate = throttle_rate
        self.retry_after = retry_after
        self.truncate_rate = truncate_rate
        self.list_lag = list_lag
        #: Number of faults injected so far, by kind (`latency`, `error`, `throttle`, `truncate`,
        #: `lag`: keys left out of a listing, counted once per listing).
        self.injected: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._list_calls = 0
        self._hidden_until: dict[str, int] = {}  # key -> last list call number that must not show it

    def _before(self, op: str, key: str) -> None:
        """Sleep, then maybe raise an injected 503 or 429."""
        if self.latency > 0:
            with self._lock:
                self.injected["latency"] += 1
            time.sleep(self.latency)
        with self._lock:
            draw = self._random.random()
            if draw < self.error_rate:
                self.injected["error"] += 1
                kind = "error"
            elif draw < self.error_rate + self.throttle_rate:
                self.injected["throttle"] += 1
                kind = "throttle"
            else:
                return
        if kind == "error":
            logger.debug("injecting 503 into %s %s", op, key)
            raise TransientBucketError(f"503 Service Unavailable (injected) during {op} {key}")
        logger.debug("injecting 429 into %s %s", op, key)
        raise TransientBucketError(
            f"429 Too Many Requests (injected) during {op} {key}", retry_after=self.retry_after
        )

    def _cut(self, size: int) -> int | None:
        """Where to cut an upload of `size` bytes, or None to let it through."""
        with self._lock:
            draw = self._random.random()
            if size == 0 or draw >= self.truncate_rate:
                return None
            self.injected["truncate"] += 1
            return self._random.randrange(size)

    def _note_write(self, key: str) -> None:
        """Hide a newly created key from the next `list_lag` listings."""
        if self.list_lag == 0 or self.inner.exists(key):
            return
        with self._lock:
            self._hidden_until[key] = self._list_calls + self.list_lag

    def _put(self, key: str, size: int, write_all, read_all) -> None:
        validate_key(key)
        self._before("put", repr(key))
        cut = self._cut(size)
        self._note_write(key)
        if cut is None:
            write_all()
            return
        self.inner.put(key, read_all()[:cut])
        logger.debug("injected truncation of %r at %d/%d bytes", key, cut, size)
        raise TransientBucketError(
            f"connection reset (injected) during put {key!r}: upload cut short after {cut} of {size} bytes"
        )

    def put(self, key: str, data: bytes) -> None:
        self._put(key, len(data), lambda: self.inner.put(key, data), lambda: bytes(data))

    def put_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        self._put(key, path.stat().st_size, lambda: self.inner.put_file(key, path), path.read_bytes)

    def get(self, key: str) -> bytes:
        self._before("get", repr(key))
        return self.inner.get(key)

    def get_file(self, key: str, path: str | Path) -> None:
        self._before("get", repr(key))
        self.inner.get_file(key, path)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        self._before("get", repr(key))
        return self.inner.get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self._before("get", repr(key))
        self.inner.get_file_limited(key, path, max_bytes)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._before("list", f"prefix {prefix!r}")
        with self._lock:
            self._list_calls += 1
            call = self._list_calls
            self._hidden_until = {k: last for k, last in self._hidden_until.items() if last >= call}
            hidden = set(self._hidden_until)
        objects = self.inner.list(prefix)
        visible = [o for o in objects if o.key not in hidden]
        if len(visible) != len(objects):
            with self._lock:
                self.injected["lag"] += len(objects) - len(visible)
        return visible

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._before("delete", repr(keys[0]) if len(keys) == 1 else f"{len(keys)} keys")
        self.inner.delete(keys)  # lag bookkeeping of deleted keys expires in list()

    def exists(self, key: str) -> bool:
        self._before("exists", repr(key))
        return self.inner.exists(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, seed={self.seed})"


class ReadCountingBucket(BucketWrapper):
    """Wrap a bucket and count the size-limited reads (``get_limited``) and the bytes they returned: a
    deterministic measure of what a reader costs (each read is a request on the Hub)."""

    def __init__(self, inner: Bucket) -> None:
        super().__init__(inner)
        self.reads = self.bytes = 0

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        self.reads += 1
        data = self.inner.get_limited(key, max_bytes)
        self.bytes += len(data)
        return data
