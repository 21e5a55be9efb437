"""The run lock: one trainer publishes to a bucket at a time.

Object stores offer no compare-and-swap, so the lock is advisory plus fencing:

* a publisher takes the lock (``lock.json``: owner, epoch, heartbeat) before its
  first publish; another owner's lock with a fresh heartbeat makes it refuse
  with :class:`RunLockedError`;
* the same owner (a restarted trainer, e.g. after a crash or a Space restart)
  takes over at once with the next epoch;
* before every publish the publisher re-reads the lock and stops with
  :class:`FencedError` if the epoch moved on, so a trainer that was taken over
  cannot write into the chain again.

Two publishers that start within the same instant could both believe they hold
the lock; fencing limits the damage to at most one publish.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from ..bucket import Bucket, ObjectNotFoundError
from ..errors import SyncError

logger = logging.getLogger(__name__)

LOCK_KEY = "lock.json"
DEFAULT_LOCK_TTL_S = 600.0


class RunLockedError(SyncError):
    """Another trainer holds the run lock."""


class FencedError(SyncError):
    """This trainer's lock was taken over; it must stop publishing."""


@dataclasses.dataclass(frozen=True)
class RunLock:
    owner: str
    epoch: int
    heartbeat: float


def read_lock(bucket: Bucket) -> RunLock | None:
    """The current lock, or ``None``; a malformed lock counts as absent (logged)."""
    try:
        doc = json.loads(bucket.get(LOCK_KEY))
        return RunLock(str(doc["owner"]), int(doc["epoch"]), float(doc["heartbeat"]))
    except ObjectNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: deeply nested JSON
        logger.warning("ignoring malformed %s: %s", LOCK_KEY, exc)
        return None


def write_lock(bucket: Bucket, lock: RunLock) -> None:
    bucket.put(LOCK_KEY, json.dumps(dataclasses.asdict(lock)).encode())


def acquire(bucket: Bucket, owner: str, ttl_s: float = DEFAULT_LOCK_TTL_S) -> RunLock:
    """Take the run lock for ``owner``.

    Raises:
        RunLockedError: another owner holds it and its heartbeat is younger than ``ttl_s``.
    """
    current = read_lock(bucket)
    now = time.time()
    if current is not None and current.owner != owner and now - current.heartbeat < ttl_s:
        raise RunLockedError(
            f"{bucket.url} is locked by trainer {current.owner!r} (heartbeat {now - current.heartbeat:.0f}s ago); "
            f"stop it, or wait {ttl_s:.0f}s after it stops"
        )
    lock = RunLock(owner, (current.epoch + 1) if current else 1, now)
    write_lock(bucket, lock)
    confirmed = read_lock(bucket)
    if confirmed != lock:
        raise RunLockedError(f"lost the race for the run lock of {bucket.url} to {confirmed.owner if confirmed else '?'}")
    logger.info("run lock taken by %s (epoch %d)", owner, lock.epoch)
    return lock


def check_fence(bucket: Bucket, lock: RunLock) -> None:
    """Raise :class:`FencedError` unless ``lock`` is still the bucket's lock epoch."""
    current = read_lock(bucket)
    if current is None or current.epoch != lock.epoch or current.owner != lock.owner:
        raise FencedError(
            f"trainer {lock.owner!r} (epoch {lock.epoch}) was taken over by "
            f"{current.owner if current else 'nobody'!r}; refusing to publish"
        )
