"""A live view of a bucket's listing, so roles follow changes instead of listing in loops.

:class:`WatchedBucket` wraps a role's bucket. Its :meth:`~WatchedBucket.list` answers from a view
of the whole bucket kept fresh in a background thread, and :meth:`~WatchedBucket.wait` blocks until
something under the given prefixes changed (or a timeout), so an idle role makes no request:

- **feed** (:attr:`WatchMode.FEED`): on a Hub bucket it follows the Hub's live-follow events feed
  (``huggingface_hub``'s ``BucketFollower``: one long-lived request per session, a listing only to
  reconcile when the feed cannot replay);
- **adaptive polling** (:attr:`WatchMode.POLL`), the fallback when the feed is off or unavailable:
  one listing per poll, the interval doubling from ``min_poll_s`` to ``max_poll_s`` while nothing
  changes and back to ``min_poll_s`` on a change or a local write (reports under
  :attr:`WatchConfig.quiet_prefixes` excepted).

Writes and deletes through the wrapper update the view at once (a role always sees its own
writes). Small objects read with :meth:`~WatchedBucket.get_limited` are cached by the Xet hash the
view holds for them, so ``latest.json`` and other pointers are downloaded only when they changed.

Every bucket object stays untrusted: the view only holds keys, sizes and hashes the server listed
or announced, and only what passes :func:`~rlsync.bucket.base.validate_key`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from pathlib import Path
from typing import Iterable

from ..errors import BucketError, InvalidKeyError, ObjectNotFoundError
from .base import Bucket, BucketWrapper, ObjectInfo, validate_key

__all__ = [
    "IDLE_WAIT_S", "WatchConfig", "WatchMode", "WatchedBucket", "generation", "hub_backend", "listing_error", "meter_of",
    "wait_for_change", "watch",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: Longest a role waits on a watched bucket before it looks again by itself (changes wake it sooner).
IDLE_WAIT_S = 30.0
#: Objects up to this size read through :meth:`WatchedBucket.get_limited` are cached by hash.
CACHE_MAX_BYTES = 1 << 20


class WatchMode(str, enum.Enum):
    """How a :class:`WatchedBucket` learns about changes."""

    FEED = "feed"
    POLL = "poll"


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
    """

    feed: bool = True
    min_poll_s: float = 1.0
    max_poll_s: float = 60.0
    quiet_prefixes: tuple[str, ...] = dataclasses.field(default=(), metadata={"env": None})


def hub_backend(bucket: Bucket):
    """The :class:`~rlsync.bucket.hf.HfBucket` under `bucket` (through retry/watch wrappers), or `None`."""
    while isinstance(bucket, BucketWrapper):
        bucket = bucket.inner
    return bucket if type(bucket).__name__ == "HfBucket" else None


class WatchedBucket(BucketWrapper):
    """A bucket whose listings come from a live view (see the module docstring).

    Args:
        inner ([`Bucket`]): The bucket (usually a `RetryingBucket` around an `HfBucket`).
        config ([`WatchConfig`], *optional*): Settings; defaults to `WatchConfig()`.
    """

    def __init__(self, inner: Bucket, config: WatchConfig | None = None) -> None:
        super().__init__(inner)
        self.config = config if config is not None else WatchConfig()
        self._hub = hub_backend(inner)
        self.meter = getattr(self._hub, "meter", None)
        self._cond = threading.Condition()
        self._view: dict[str, ObjectInfo] | None = None
        self._changed_at: dict[str, int] = {}  # key -> generation of its last change
        self.generation = 0
        self._cache: dict[str, tuple[str, bytes]] = {}
        self._stop = threading.Event()
        self._poke = threading.Event()
        use_feed = self.config.feed and self._hub is not None
        self.mode = WatchMode.FEED if use_feed else WatchMode.POLL
        self.polls = 0
        #: Why the newest listing failed (the view is as of the last good one), or ``None``.
        self.listing_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.url}", daemon=True)
        self._thread.start()

    # -- the view ------------------------------------------------------------------------------

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
        self.generation += 1
        self._changed_at[key] = self.generation

    def _replace(self, listing: list[ObjectInfo]) -> bool:
        """Replace the view by a full listing; returns whether a key outside the quiet prefixes changed."""
        fresh = {o.key: o for o in listing}
        with self._cond:
            if self._view is None:
                self._view = fresh
                self.generation += 1
                self._cond.notify_all()
                return True
            before = self.generation
            for key in set(self._view) | set(fresh):
                self._set(key, fresh.get(key))
            self._cond.notify_all()
            quiet = self.config.quiet_prefixes
            return any(g > before and not k.startswith(quiet) for k, g in self._changed_at.items())

    def _apply_changes(self, changes) -> None:
        """Apply a batch of the feed's changes (``BucketFileChange``)."""
        hub = self._hub
        with self._cond:
            for change in changes:
                key = hub.paths.local_key(change.path) if hub is not None else change.path
                try:
                    validate_key(key or "")
                except InvalidKeyError:
                    continue
                if change.op == "delete":
                    self._set(key, None)
                else:
                    old = (self._view or {}).get(key)
                    size = change.size if isinstance(change.size, int) else (old.size if old else 0)
                    etag = change.xet_hash if isinstance(change.xet_hash, str) else None
                    self._set(key, ObjectInfo(key, size, etag))
            self._cond.notify_all()

    def _list_inner(self) -> list[ObjectInfo] | None:
        try:
            listing = self.inner.list("")
        except BucketError as exc:
            logger.warning("watch %s: listing failed: %s", self.url, exc)
            with self._cond:
                self.listing_error = str(exc)
                self._cond.notify_all()  # a first view waited for will not come from this listing
            return None
        self.listing_error = None
        return listing

    # -- background thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self.mode is WatchMode.FEED:
            self._follow()
            if self._stop.is_set():
                return
            logger.warning("watch %s: the events feed is unavailable; polling every %g-%gs instead",
                           self.url, self.config.min_poll_s, self.config.max_poll_s)  # fmt: skip
            self.mode = WatchMode.POLL
        self._poll()

    def _follow(self) -> None:
        from huggingface_hub._bucket_live_follow import BucketFollower

        from .hf_transport import metering

        hub = self._hub
        watcher = self

        class _Follower(BucketFollower):
            def run(self) -> None:  # counted and paced as the role's requests
                with metering(hub.meter):
                    super().run()

        def reconcile() -> None:
            listing = watcher._list_inner()
            if listing is not None:
                watcher._replace(listing)

        follower = _Follower(
            endpoint=hub._api.endpoint, bucket_id=hub.bucket_id, token=hub._token or None,
            on_changes=self._apply_changes, on_reconcile=reconcile, is_alive=lambda: not self._stop.is_set(),
        )  # fmt: skip
        follower.run()  # in this thread: it returns when the feed cannot be followed, or on close

    def _poll(self) -> None:
        interval = self.config.min_poll_s
        while not self._stop.is_set():
            listing = self._list_inner()
            self.polls += 1
            changed = listing is not None and self._replace(listing)
            interval = self.config.min_poll_s if changed else min(self.config.max_poll_s, interval * 2)
            self._poke.wait(interval)
            if self._poke.is_set():
                self._poke.clear()
                interval = self.config.min_poll_s

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
        """Objects under `prefix`, from the view (a real listing until the first view is ready)."""
        view = self._ready_view()
        if view is None:
            return self.inner.list(prefix)
        with self._cond:
            return sorted((o for k, o in view.items() if k.startswith(prefix)), key=lambda o: o.key)

    def wait(self, stop: threading.Event, timeout: float, prefixes: Iterable[str] = ("",), since: int | None = None) -> bool:
        """Block until a key under `prefixes` changed after generation `since` (default: now), `stop`
        is set, or `timeout` seconds passed; returns whether something changed."""
        prefixes = tuple(prefixes)
        deadline = time.monotonic() + timeout
        with self._cond:
            start = self.generation if since is None else since

            def changed() -> bool:
                return any(g > start and k.startswith(prefixes) for k, g in self._changed_at.items())

            while not changed() and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return changed()

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        """:meth:`Bucket.get_limited`, answered from the cache while the view holds the same hash, and
        without a request for a key the view does not hold.

        Raises:
            [`ObjectNotFoundError`]: the view has no such key (or the backend has none).
        """
        view = self._ready_view(0.0)
        if view is not None and key not in view:
            raise ObjectNotFoundError(f"get {key!r} in {self.url} failed: no such object")
        info = (view or {}).get(key)
        cached = self._cache.get(key)
        if info is not None and info.etag and cached is not None and cached[0] == info.etag:
            if len(cached[1]) > max_bytes:
                return self.inner.get_limited(key, max_bytes)  # let the backend refuse it as it does
            return cached[1]
        data = self.inner.get_limited(key, max_bytes)
        after = (self._view or {}).get(key)
        if info is not None and info.etag and after is not None and after.etag == info.etag and len(data) <= CACHE_MAX_BYTES:
            self._cache[key] = (info.etag, data)
        return data

    def exists(self, key: str) -> bool:
        view = self._ready_view(0.0)
        if view is not None and key in view:
            return True
        return self.inner.exists(key)

    # -- writing (the view follows at once) ----------------------------------------------------

    def _wrote(self, key: str, size: int) -> None:
        with self._cond:
            self._set(key, ObjectInfo(key, size, None))
            self._cache.pop(key, None)
            self._cond.notify_all()
        if self.mode is WatchMode.POLL and not key.startswith(self.config.quiet_prefixes):
            self._poke.set()  # other roles answer writes: look again soon

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._wrote(key, len(data))

    def put_file(self, key: str, path: str | Path) -> None:
        self.inner.put_file(key, path)
        self._wrote(key, Path(path).stat().st_size)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.inner.delete(keys)
        with self._cond:
            for key in keys:
                self._set(key, None)
                self._cache.pop(key, None)
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
    """`bucket` as a :class:`WatchedBucket` when it is on the Hub (where requests are counted), else itself.

    Args:
        bucket ([`Bucket`]): A role's bucket.
        config ([`WatchConfig`], *optional*): Settings.

    Returns:
        [`Bucket`]: the watched bucket, or `bucket` unchanged (a local folder lists for free).
    """
    if isinstance(bucket, WatchedBucket) or hub_backend(bucket) is None:
        return bucket
    return WatchedBucket(bucket, config)


def meter_of(bucket: Bucket):
    """The :class:`~rlsync.bucket.budget.RequestMeter` of a watched Hub bucket, else `None`."""
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

