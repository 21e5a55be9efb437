"""The run lock: one trainer publishes to a bucket at a time.

Object stores offer no compare-and-swap, so the lock is advisory plus fencing:

* a publisher takes the lock (``lock.json``: owner, epoch, heartbeat) before its
  first publish; another owner's lock with a fresh heartbeat makes it refuse
  with :class:`RunLockedError`;
* the same owner (a restarted trainer, e.g. after a crash or a Space restart)
  takes over at once with the next epoch;
* before every publish the publisher re-reads the lock and stops with
  :class:`FencedError` if the epoch moved on, so a trainer that was taken over
  cannot write into the chain again. Every lock read goes to the bucket itself
  (:meth:`~rlsync.bucket.base.Bucket.get_uncached`), never to a watched
  bucket's cache, which a failing events feed can leave stale.

Two publishers that start within the same instant could both believe they hold
the lock; fencing limits the damage to at most one publish.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import time

from ..bucket import Bucket
from ..errors import FencedError, FormatError, ObjectNotFoundError, ObjectTooLargeError, RunLockedError
from ..jsonlimits import loads_bounded
from ..layout import LOCK_KEY, MAX_BASE_EPOCH, MAX_EPOCH
from ..limits import MAX_LOCK_BYTES

logger = logging.getLogger(__name__)

DEFAULT_LOCK_TTL_S = 600.0
MAX_CLOCK_SKEW_S = 300.0


@dataclasses.dataclass(frozen=True)
class RunLock:
    owner: str
    epoch: int
    heartbeat: float


def parse_lock(data: bytes) -> RunLock:
    """Parse and check a lock object.

    Raises:
        FormatError: not JSON, wrong types, an owner of more than 256 characters,
            an epoch outside ``[0, MAX_EPOCH]``, a non-finite heartbeat.
    """
    doc = loads_bounded(data, what=LOCK_KEY, max_bytes=MAX_LOCK_BYTES)
    if not isinstance(doc, dict):
        raise FormatError(f"{LOCK_KEY} is not a JSON object")
    owner, epoch, heartbeat = doc.get("owner"), doc.get("epoch"), doc.get("heartbeat")
    if not isinstance(owner, str) or not 0 < len(owner) <= 256:
        raise FormatError(f"{LOCK_KEY}: invalid owner")
    if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
        raise FormatError(f"{LOCK_KEY}: invalid epoch {epoch!r}")
    if type(heartbeat) not in (int, float) or not math.isfinite(heartbeat):
        raise FormatError(f"{LOCK_KEY}: invalid heartbeat {heartbeat!r}")
    return RunLock(owner, epoch, float(heartbeat))


def read_lock(bucket: Bucket) -> RunLock | None:
    """The current lock, or ``None``; a malformed lock counts as absent (logged)."""
    try:
        return _read_lock_strict(bucket)
    except ObjectNotFoundError:
        return None
    except (FormatError, ObjectTooLargeError) as exc:
        logger.warning("ignoring malformed %s: %s", LOCK_KEY, exc)
        return None


def _read_lock_strict(bucket: Bucket) -> RunLock:
    # From the bucket itself: a cached lock may be stale, and a trainer taken over would not see it.
    return parse_lock(bucket.get_uncached(LOCK_KEY, MAX_LOCK_BYTES))


def is_fresh(lock: RunLock, ttl_s: float, now: float) -> bool:
    """Whether ``lock``'s heartbeat is younger than ``ttl_s``; a heartbeat further in the
    future than the clock skew allows is not (it could otherwise lock trainers out forever)."""
    age = now - lock.heartbeat
    return -MAX_CLOCK_SKEW_S <= age < ttl_s


def write_lock(bucket: Bucket, lock: RunLock) -> None:
    bucket.put(LOCK_KEY, json.dumps(dataclasses.asdict(lock)).encode())


def acquire(
    bucket: Bucket,
    owner: str,
    ttl_s: float = DEFAULT_LOCK_TTL_S,
    *,
    floor: int = 0,
    refused: collections.Counter[str] | None = None,
) -> RunLock:
    """Take the run lock for ``owner``.

    The new epoch is above the current lock's and above ``floor`` (the highest epoch the
    pointer names). A garbage lock object, or one whose epoch leaves no room (above
    :data:`~rlsync.layout.MAX_BASE_EPOCH`), counts as no lock (counted in ``refused``), but the
    trainer that held it may still run under its epoch, so the new epoch then also passes the
    clock in seconds: the two never share an epoch (nor the keys written under it).

    Raises:
        RunLockedError: another owner holds it and its heartbeat is younger than ``ttl_s``, or
            ``floor`` leaves no epoch.
    """
    try:
        current: RunLock | None = _read_lock_strict(bucket)
        if current.epoch > MAX_BASE_EPOCH:
            raise FormatError(f"{LOCK_KEY}: epoch {current.epoch} leaves no room (above {MAX_BASE_EPOCH})")
    except ObjectNotFoundError:
        current = None
    except (FormatError, ObjectTooLargeError) as exc:
        logger.warning("ignoring malformed %s: %s", LOCK_KEY, exc)
        if refused is not None:
            refused[LOCK_KEY] += 1
        current, floor = None, max(floor, int(time.time()))
    now = time.time()
    if current is not None and current.owner != owner and is_fresh(current, ttl_s, now):
        raise RunLockedError(
            f"{bucket.url} is locked by trainer {current.owner!r} (heartbeat {now - current.heartbeat:.0f}s ago); "
            f"stop it, or wait {ttl_s:.0f}s after it stops"
        )
    epoch = max(current.epoch if current else 0, floor) + 1
    if epoch > MAX_EPOCH:
        raise RunLockedError(f"{bucket.url}: no run-lock epoch is left above {epoch - 1}")
    lock = RunLock(owner, epoch, now)
    write_lock(bucket, lock)
    confirmed = read_lock(bucket)
    if confirmed != lock:
        raise RunLockedError(f"lost the race for the run lock of {bucket.url} to {confirmed.owner if confirmed else '?'}")
    logger.info("run lock taken by %s (epoch %d)", owner, lock.epoch)
    return lock


def check_fence(bucket: Bucket, lock: RunLock) -> RunLock:
    """Check that ``lock`` is still the bucket's lock epoch.

    A takeover always writes a valid lock of another epoch, so a missing, garbage or
    cut-short lock object (a hostile write, or an upload of this trainer's own heartbeat
    cut short) is not one: the lock is written again with a fresh heartbeat and the
    trainer goes on.

    Returns:
        The lock held now (``lock``, or its rewrite with a fresh heartbeat).

    Raises:
        FencedError: another owner or epoch holds the lock.
    """
    try:
        current = _read_lock_strict(bucket)
    except (ObjectNotFoundError, FormatError, ObjectTooLargeError) as exc:
        logger.warning("%s is unreadable or missing (%s); writing this trainer's lock again", LOCK_KEY, exc)
        restored = dataclasses.replace(lock, heartbeat=time.time())
        write_lock(bucket, restored)
        return _confirm(bucket, restored)
    if current.epoch != lock.epoch or current.owner != lock.owner:
        raise _fenced(lock, current)
    return lock


def _confirm(bucket: Bucket, lock: RunLock) -> RunLock:
    """``lock`` if the bucket holds exactly it (right after rewriting it); else :class:`FencedError`."""
    current = read_lock(bucket)
    if current != lock:
        raise _fenced(lock, current)
    return lock


def _fenced(lock: RunLock, current: RunLock | None) -> FencedError:
    return FencedError(
        f"trainer {lock.owner!r} (epoch {lock.epoch}) was taken over by "
        f"{current.owner if current else 'nobody'!r}; refusing to publish"
    )
