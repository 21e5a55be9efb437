"""A live view of a bucket's listing, so roles follow changes instead of listing in loops.

:class:`WatchedBucket` wraps a role's bucket. Its :meth:`~WatchedBucket.list` answers from a view
of the whole bucket kept fresh in a background thread, and :meth:`~WatchedBucket.wait` blocks until
something under the given prefixes changed (or a timeout), so an idle role makes no request:

- **feed** (:attr:`WatchMode.FEED`): on a backend that declares a change feed
  (:attr:`~rlsync.bucket.base.Capability.CHANGE_FEED`: the Hub) it follows the Hub's live-follow events feed
  (``huggingface_hub``'s ``BucketFollower``: one long-lived request per session, a listing only to
  reconcile when the feed cannot replay);
- **adaptive polling** (:attr:`WatchMode.POLL`), the fallback when the feed is off or unavailable:
  one listing per poll, the interval doubling from ``min_poll_s`` to ``max_poll_s`` while nothing
  changes and back to ``min_poll_s`` on a change or a local write (reports under
  :attr:`WatchConfig.quiet_prefixes` excepted).

Writes and deletes through the wrapper update the view at once (a role always sees its own
writes). Small objects read with :meth:`~WatchedBucket.get_limited` are cached by the Xet hash the
view holds for them, so ``latest.json`` and other pointers are downloaded only when they changed;
an object the view lists as larger than the reader allows is refused without a request. A check
that must see the newest object (the run lock's fence, the pointer before a publish) reads with
:meth:`~WatchedBucket.get_uncached`, never from the cache.

Every bucket object stays untrusted, and so does the feed: the view only holds keys, sizes and
hashes the server listed or announced, and only what passes :func:`~rlsync.bucket.base.validate_key`;
a malformed change is skipped and counted (:attr:`~WatchedBucket.malformed_events`). Everything is
bounded: a listing stops after :attr:`WatchConfig.max_listing_keys` keys per prefix (a prefix flooded
with keys is seen in part, its keys beyond the bound when they change), the cache holds at most
:attr:`WatchConfig.cache_bytes` and forgets deleted keys, the change log keeps the newest
:attr:`WatchConfig.max_changes` changes, and a feed whose sessions or batches keep failing
(:attr:`WatchConfig.feed_failures` in a row) is left for polling.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Iterable

from ..errors import ConfigurationError, ObjectNotFoundError, ObjectTooLargeError
from ..supervised import SupervisedThread
from .base import Bucket, BucketWrapper, Capability, ObjectInfo, backend_of, validate_prefix
from .watch_feed import ViewUpdater, WatchMode

__all__ = [
    "IDLE_WAIT_S", "WatchConfig", "WatchMode", "WatchedBucket", "generation", "listing_error", "meter_of",
    "wait_for_change", "watch",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: Longest a role waits on a watched bucket before it looks again by itself (changes wake it sooner).
IDLE_WAIT_S = 30.0
#: Objects up to this size read through :meth:`WatchedBucket.get_limited` are cached by hash.
CACHE_MAX_BYTES = 1 << 20


@dataclasses.dataclass
class WatchConfig:
    """Settings of a :class:`WatchedBucket`.

    Args:
        feed (`bool`, *optional*, defaults to True): Follow the Hub's events feed when it is
            served (env `HUB_FEED`); otherwise, and when it fails, poll.
        min_poll_s (`float`, *optional*, defaults to 1): Shortest polling interval (env `HUB_MIN_POLL_S`).
        max_poll_s (`float`, *optional*, defaults to 60): Longest polling interval, reached after
            a run of polls that found nothing new (env `HUB_MAX_POLL_S`).
        quiet_prefixes (`tuple[str, ...]`, *optional*): Keys under these prefixes are the roles'
            reports (status, metrics) that no role answers: writing one, or seeing another role's
            change, does not bring the polling interval back to `min_poll_s`, so an idle fleet's
            periodic reports cost no extra polls.
        prefixes (`tuple[str, ...]`, *optional*, defaults to the whole bucket): The prefixes the
            role reads: only these are listed and followed; other keys are asked of the bucket.
        max_listing_keys (`int`, *optional*, defaults to 20,000): Keys one listing of a prefix
            takes at most (a prefix flooded with keys costs a bounded number of pages; its keys
            beyond the bound join the view when the feed announces them) (env `HUB_MAX_LISTING_KEYS`).
        cache_bytes (`int`, *optional*, defaults to 16 MiB): Bytes of small objects cached, the
            least recently read dropped first (env `HUB_CACHE_BYTES`).
        max_changes (`int`, *optional*, defaults to 10,000): Changes the change log keeps for
            :meth:`WatchedBucket.wait` (a wait from before the oldest one kept counts as changed) (env `HUB_MAX_CHANGES`).
        feed_failures (`int`, *optional*, defaults to 3): Feed sessions or change batches failing in
            a row after which the watch polls instead (env `HUB_FEED_FAILURES`).
    """

    feed: bool = True
    min_poll_s: float = 1.0
    max_poll_s: float = 60.0
    quiet_prefixes: tuple[str, ...] = dataclasses.field(default=(), metadata={"env": None})
    prefixes: tuple[str, ...] = dataclasses.field(default=("",), metadata={"env": None})
    max_listing_keys: int = 20_000
    cache_bytes: int = 16 << 20
    max_changes: int = 10_000
    feed_failures: int = 3

    def __post_init__(self) -> None:
        for prefix in self.prefixes:
            validate_prefix(prefix)
        if not self.prefixes or min(self.max_listing_keys, self.max_changes, self.feed_failures) < 1 or self.cache_bytes < 0:
            raise ConfigurationError(f"invalid watch settings: {self}")


class _HashCache:
    """Small objects by key, each with the Xet hash it was read at; the least recently read dropped first.

    Args:
        max_bytes: Bytes held at most (an object over ``min(CACHE_MAX_BYTES, max_bytes)`` is not kept).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[str, tuple[str, bytes]] = collections.OrderedDict()  # least recent first

    def get(self, key: str, etag: str) -> bytes | None:
        """The bytes of ``key`` read at hash ``etag``, or ``None``."""
        cached = self._entries.get(key)
        if cached is None or cached[0] != etag:
            return None
        self._entries.move_to_end(key)
        return cached[1]

    def put(self, key: str, etag: str, data: bytes) -> None:
        """Keep ``data`` as ``key`` at hash ``etag`` (unless it is too large)."""
        if len(data) > min(CACHE_MAX_BYTES, self.max_bytes):
            return
        self.drop(key)
        self._entries[key] = (etag, data)
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            self.drop(next(iter(self._entries)))

    def drop(self, key: str, unless: str | None = None) -> None:
        """Forget ``key``, unless it is held at hash ``unless``."""
        entry = self._entries.get(key)
        if entry is not None and (unless is None or entry[0] != unless):
            del self._entries[key]
            self.bytes -= len(entry[1])


class _ChangeLog:
    """Which keys of a view changed at which of its generations, the newest `max_changes` of them (the
    view's lock is held by the caller).

    Args:
        max_changes: Changes kept; a wait from before the oldest one kept counts as changed.
    """

    def __init__(self, max_changes: int) -> None:
        self.max_changes = max_changes
        #: The view's generation: one more at each change.
        self.generation = 0
        self._at: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> generation, oldest first
        self._forgotten = 0  # the newest generation whose changes the log no longer holds

    def __len__(self) -> int:
        return len(self._at)

    def at(self, key: str) -> int:
        """The generation of `key`'s last change held (0: none)."""
        return self._at.get(key, 0)

    def record(self, key: str | None) -> None:
        """A new generation, in which `key` changed (``None``: the view appeared: what changed before it is
        not known, and a wait from before it counts as changed)."""
        self.generation += 1
        if key is None:
            self._forgotten = self.generation
            return
        self._at.pop(key, None)
        self._at[key] = self.generation
        while len(self._at) > self.max_changes:
            _, gen = self._at.popitem(last=False)
            self._forgotten = max(self._forgotten, gen)

    def changed_since(self, start: int, prefixes: tuple[str, ...], *, outside: bool = False) -> bool:
        """Whether a key under `prefixes` (with `outside`: a key under none of them) changed after generation
        `start`; a change older than the log holds counts."""
        if self._forgotten > start:
            return True
        for key, gen in reversed(self._at.items()):
            if gen <= start:
                return False
            if key.startswith(prefixes) != outside:
                return True
        return False


class WatchedBucket(BucketWrapper):
    """A bucket whose listings come from a live view (see the module docstring).

    Args:
        inner ([`Bucket`]): The bucket (usually a `RetryingBucket` around an `HfBucket`).
        config ([`WatchConfig`], *optional*): Settings; defaults to `WatchConfig()`.
    """

    def __init__(self, inner: Bucket, config: WatchConfig | None = None) -> None:
        super().__init__(inner)
        self.config = config if config is not None else WatchConfig()
        #: The backend under the wrappers: its capabilities decide metering and the feed.
        self.backend = backend_of(inner)
        self.meter = self.backend.meter if Capability.METERED in self.backend.capabilities else None
        self._cond = threading.Condition()
        self._view: dict[str, ObjectInfo] | None = None
        self._log = _ChangeLog(self.config.max_changes)
        self._cache = _HashCache(self.config.cache_bytes)
        self._stop = threading.Event()
        self._poke = threading.Event()
        use_feed = self.config.feed and Capability.CHANGE_FEED in self.backend.capabilities
        self.mode = WatchMode.FEED if use_feed else WatchMode.POLL
        self.polls = 0
        #: Why the newest listing failed (the view is as of the last good one), or ``None``.
        self.listing_error: str | None = None
        #: Listings cut at `config.max_listing_keys` (a prefix flooded with keys).
        self.truncated_listings = 0
        #: Feed changes skipped as malformed (a path that is not a string, an unknown operation, ...).
        self.malformed_events = 0
        #: Feed sessions or change batches that failed.
        self.feed_errors = 0
        #: Reads refused because the view lists the object as larger than the reader allows.
        self.refused_too_large = 0
        self._updater = ViewUpdater(self)  # follows the feed, else polls (mode, polls and feed_errors are ours)
        self._thread = SupervisedThread(self._updater.run, name=f"watch-{self.url}", stop=self._stop)
        self._thread.start()

    # -- the view ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the first listing is in (until then :meth:`list` asks the bucket)."""
        return self._view is not None

    @property
    def cache_bytes(self) -> int:
        """Bytes of small objects cached (at most `config.cache_bytes`)."""
        return self._cache.bytes

    @property
    def changes_held(self) -> int:
        """Entries in the change log (at most `config.max_changes`)."""
        return len(self._log)

    @property
    def generation(self) -> int:
        """The view's generation: one more at each change (pass it to :meth:`wait`)."""
        return self._log.generation

    def _covers(self, key: str) -> bool:
        return key.startswith(self.config.prefixes)

    def _set(self, key: str, info: ObjectInfo | None) -> None:
        """Record one key's new state (the condition is held)."""
        old = self._view.get(key) if self._view is not None else None
        same = old is None and info is None or (
            old is not None and info is not None and (old.size, old.etag) == (info.size, info.etag)
        )
        if self._view is None or same:
            return
        if info is None:
            self._view.pop(key, None)
        else:
            self._view[key] = info
        self._cache.drop(key, unless=info.etag if info is not None else None)
        self._log.record(key)

    def _cache_put(self, key: str, etag: str, data: bytes) -> None:
        with self._cond:
            self._cache.put(key, etag, data)

    # -- reading -------------------------------------------------------------------------------

    def _ready_view(self, timeout: float = 30.0) -> dict[str, ObjectInfo] | None:
        """The view, once the first listing is in; ``None`` if it failed or the watch is closed
        (callers then ask the bucket: a closed watch answers like the bucket it wraps)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._view is not None or self.listing_error is not None or self._stop.is_set(), timeout
            )
            return None if self._stop.is_set() else self._view

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects under `prefix`, from the view (a real listing until the first view is ready, or for a
        prefix outside the watched ones)."""
        view = self._ready_view() if self._covers(prefix) else None
        if view is None:
            return self.inner.list(prefix)
        with self._cond:
            return sorted((o for k, o in view.items() if k.startswith(prefix)), key=lambda o: o.key)

    def wait(self, stop: threading.Event, timeout: float, prefixes: Iterable[str] = ("",), since: int | None = None) -> bool:
        """Block until a key under `prefixes` changed after generation `since` (default: now), `stop`
        is set, or `timeout` seconds passed; returns whether something changed.

        Until the first listing is in, the view sees no change: a wait then lasts at most
        `config.min_poll_s` (the caller reads the bucket itself again, as through an unready view), and
        the view's arrival counts as a change."""
        prefixes = tuple(prefixes)
        deadline = time.monotonic() + timeout
        with self._cond:
            start = self.generation if since is None else since
            while not self._log.changed_since(start, prefixes) and not stop.is_set():
                if self._view is None:
                    deadline = min(deadline, time.monotonic() + self.config.min_poll_s)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return self._log.changed_since(start, prefixes)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """:meth:`Bucket.get_limited`, answered from the cache while the view holds the same hash, refused
        when the view lists it larger than `max_bytes`, and without a request for a key the view does
        not hold (when it holds the key's whole prefix).

        Raises:
            [`ObjectNotFoundError`]: the view has no such key (or the backend has none).
            [`ObjectTooLargeError`]: the object holds more than `max_bytes` bytes.
        """
        view = self._ready_view(0.0) if self._covers(key) else None
        if view is not None and key not in view and not self.truncated_listings:
            raise ObjectNotFoundError(f"get {key!r} in {self.url} failed: no such object")
        info = (view or {}).get(key)
        if info is not None and info.size > max_bytes:
            self.refused_too_large += 1
            raise ObjectTooLargeError(f"{key}: {info.size:,} bytes, more than the {max_bytes:,} allowed")
        with self._cond:
            cached = self._cache.get(key, info.etag) if info is not None and info.etag else None
            if cached is not None:
                return cached
        data = self.inner.get_limited(key, max_bytes)
        after = (self._view or {}).get(key)
        if info is not None and info.etag and after is not None and after.etag == info.etag:
            self._cache_put(key, info.etag, data)
        return data

    def get_uncached(self, key: str, max_bytes: int) -> bytes:
        """:meth:`get_limited` from the bucket itself, whatever the view and the cache hold."""
        return self.inner.get_limited(key, max_bytes)

    def exists(self, key: str) -> bool:
        view = self._ready_view(0.0) if self._covers(key) else None
        if view is not None and key in view:
            return True
        return self.inner.exists(key)

    # -- writing (the view follows at once) ----------------------------------------------------

    def _wrote(self, key: str, size: int, since: int) -> None:
        """Record a write through this wrapper made when the view was at generation `since`: unless
        the feed announced the key meanwhile (then the view has its hash already, keep it)."""
        with self._cond:  # a key outside the watched prefixes (the role's own reports) stays out of the view
            announced = self._view is not None and key in self._view and self._log.at(key) > since
            if self._covers(key) and not announced:
                self._set(key, ObjectInfo(key, size, None))
            self._cond.notify_all()
        if self.mode is WatchMode.POLL and not key.startswith(self.config.quiet_prefixes):
            self._poke.set()  # other roles answer writes: look again soon

    def put(self, key: str, data: bytes) -> None:
        since = self.generation
        self.inner.put(key, data)
        self._wrote(key, len(data), since)

    def put_file(self, key: str, path: str | Path) -> None:
        since = self.generation
        self.inner.put_file(key, path)
        self._wrote(key, Path(path).stat().st_size, since)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.inner.delete(keys)
        with self._cond:
            for key in keys:
                self._set(key, None)
                self._cache.drop(key)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop following (the feed's session ends at its next event or keep-alive). `inner` stays
        open (a watch is a view; the bucket under it may be shared), and answers from now on."""
        self._stop.set()
        self._poke.set()
        with self._cond:
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, mode={self.mode.value})"


def watch(bucket: Bucket, config: WatchConfig | None = None) -> Bucket:
    """`bucket` as a :class:`WatchedBucket` when its backend is metered (requests are counted), else itself.

    Args:
        bucket ([`Bucket`]): A role's bucket.
        config ([`WatchConfig`], *optional*): Settings.

    Returns:
        [`Bucket`]: the watched bucket, or `bucket` unchanged (a local folder lists for free).
    """
    if isinstance(bucket, WatchedBucket) or Capability.METERED not in backend_of(bucket).capabilities:
        return bucket
    return WatchedBucket(bucket, config)


def meter_of(bucket: Bucket):
    """The :class:`~rlsync.bucket.budget.RequestMeter` of a watched metered bucket, else `None`."""
    return bucket.meter if isinstance(bucket, WatchedBucket) else None


def listing_error(bucket: Bucket) -> str | None:
    """Why a watched bucket's newest listing failed (its view is that of the last good one), else `None`."""
    return bucket.listing_error if isinstance(bucket, WatchedBucket) else None


def generation(bucket: Bucket) -> int | None:
    """The view's generation of a :class:`WatchedBucket` (pass it to :func:`wait_for_change`), else `None`."""
    return bucket.generation if isinstance(bucket, WatchedBucket) else None


def wait_for_change(
    bucket: Bucket, stop: threading.Event, timeout: float, prefixes: Iterable[str] = ("",), since: int | None = None
) -> bool:
    """Wait for a change under `prefixes` (after generation `since`, default now) on a
    :class:`WatchedBucket`, or just `timeout` seconds on any other bucket; returns early when `stop`
    is set. Returns whether a change was seen."""
    if isinstance(bucket, WatchedBucket):
        return bucket.wait(stop, timeout, prefixes, since)
    stop.wait(timeout)
    return False

