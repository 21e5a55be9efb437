"""Keeping a :class:`~rlsync.bucket.watch.WatchedBucket`'s view fresh (:class:`ViewUpdater`): following the
Hub's events feed, else adaptive polling; and reading one untrusted feed change (:func:`change_info`).
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable

from ..errors import BucketError, InvalidKeyError
from .base import ObjectInfo, validate_key

__all__ = ["ViewUpdater", "WatchMode", "change_info"]

logger = logging.getLogger(__name__)

#: A feed change's operations (``BucketFileChange.op``).
_FEED_OPS = frozenset({"add", "update", "delete"})


class WatchMode(str, enum.Enum):
    """How a :class:`~rlsync.bucket.watch.WatchedBucket` learns about changes."""

    FEED = "feed"
    POLL = "poll"


def change_info(
    change: Any, *, local_key: Callable[[str], str | None], covers: Callable[[str], bool], view: dict[str, ObjectInfo] | None
) -> tuple[str, ObjectInfo | None] | None:
    """The key and new state a feed change announces.

    Args:
        change: A ``BucketFileChange`` (untrusted).
        local_key: The key of a bucket path (``None``: not this bucket's).
        covers: Whether a key is under the watched prefixes.
        view: The view as it is (the size of an update that does not say it).

    Returns:
        ``(key, info)`` (``info`` ``None`` for a delete), or ``None`` for a change outside the watched
        prefixes or not for this bucket.

    Raises:
        ValueError: a malformed change.
    """
    path, op = getattr(change, "path", None), getattr(change, "op", None)
    if not isinstance(path, str) or op not in _FEED_OPS:
        raise ValueError(f"a change with path {type(path).__name__} and operation {op!r}")
    key = local_key(path)
    if key is None:
        return None
    try:
        validate_key(key)
    except InvalidKeyError:
        raise ValueError("a change whose path is not a valid key") from None
    if not covers(key):
        return None
    if op == "delete":
        return key, None
    size, etag = getattr(change, "size", None), getattr(change, "xet_hash", None)
    if size is not None and (type(size) is not int or size < 0):
        raise ValueError(f"a change with size {size!r}"[:100])
    if etag is not None and not isinstance(etag, str):
        raise ValueError(f"a change with hash of type {type(etag).__name__}")
    old = (view or {}).get(key)
    return key, ObjectInfo(key, size if size is not None else (old.size if old else 0), etag)


class ViewUpdater:
    """The background job of a watched bucket: follow the feed (when its mode is feed) until it cannot,
    then poll, writing the view from the listings and the feed's changes; its figures (``mode``, ``polls``,
    ``feed_errors``, ``malformed_events``) are the watched bucket's.

    Args:
        watched: The :class:`~rlsync.bucket.watch.WatchedBucket` whose view it keeps fresh.
    """

    def __init__(self, watched: Any) -> None:
        self.watched = watched
        self.errors_in_row = 0
        self.follower: Any = None

    def replace(self, listing: list[ObjectInfo], complete: bool) -> bool:
        """Bring the view to a listing of the watched prefixes; returns whether a key outside the quiet
        prefixes changed. Keys missing from a listing cut short are kept (the feed tells their deletes)."""
        watched = self.watched
        fresh = {o.key: o for o in listing}
        with watched._cond:
            if watched._view is None:
                watched._view = fresh
                watched._log.record(None)  # a wait from before the view saw nothing: it looks again
                watched._cond.notify_all()
                return True
            before = watched.generation
            for key in (set(watched._view) | set(fresh)) if complete else set(fresh):
                watched._set(key, fresh.get(key))
            watched._cond.notify_all()
            return watched._log.changed_since(before, watched.config.quiet_prefixes, outside=True)

    def apply_changes(self, changes) -> None:
        """Apply a batch of the feed's changes (``BucketFileChange``); malformed ones are skipped and counted."""
        watched = self.watched
        skipped = 0
        local_key = watched.backend.local_key
        with watched._cond:
            for change in changes:
                try:
                    found = change_info(change, local_key=local_key, covers=watched._covers, view=watched._view)
                except ValueError as exc:
                    skipped += 1
                    if watched.malformed_events + skipped == 1:
                        logger.warning("watch %s: skipped a malformed feed change: %s", watched.url, exc)
                    continue
                if found is not None:
                    watched._set(*found)
            watched.malformed_events += skipped
            watched._cond.notify_all()

    def run(self) -> None:
        """Follow, then poll, until the watch is closed."""
        watched = self.watched
        if watched.mode is WatchMode.FEED:
            self.follow()
            if watched._stop.is_set():
                return
            logger.warning("watch %s: the events feed is unavailable; polling every %g-%gs instead",
                           watched.url, watched.config.min_poll_s, watched.config.max_poll_s)  # fmt: skip
            watched.mode = WatchMode.POLL
        self.poll()

    def feed_failed(self, what: str) -> None:
        """Count a failed feed session or batch; after `config.feed_failures` in a row, stop following."""
        watched = self.watched
        what = watched.backend.scrub(what)  # a server may echo the token
        watched.feed_errors += 1
        self.errors_in_row += 1
        logger.warning("watch %s: the events feed failed (%s, %d in a row)", watched.url, what, self.errors_in_row)
        if self.errors_in_row >= watched.config.feed_failures and self.follower is not None:
            self.follower.stop()

    def follow(self) -> None:
        """Follow the Hub's events feed in this thread: it returns when the feed cannot be followed, or on close."""
        from huggingface_hub._bucket_live_follow import BucketFollower

        from .hf_transport import metering

        watched = self.watched
        hub = watched.backend
        updater = self

        class _Follower(BucketFollower):
            def run(self) -> None:  # counted and paced as the role's requests
                with metering(hub.meter):
                    super().run()

            def _follow_once(self) -> bool:
                try:
                    healthy = super()._follow_once()
                except Exception as exc:  # noqa: BLE001 - counted here, handled (retried or given up) by the follower
                    updater.feed_failed(f"{type(exc).__name__}: {exc}"[:300])
                    raise
                if healthy:
                    updater.errors_in_row = 0
                return healthy

            def _sleep(self, delay: float) -> None:  # back off no longer than polling would wait
                super()._sleep(min(delay, watched.config.max_poll_s))

        def reconcile() -> None:
            found = self.list_watched()
            if found is not None:
                self.replace(*found)

        def on_changes(changes) -> None:
            try:
                self.apply_changes(changes)
            except Exception as exc:  # noqa: BLE001 - the batch is replayed; in a row, the watch polls instead
                updater.feed_failed(f"a batch of changes could not be applied: {type(exc).__name__}: {exc}"[:300])
                raise

        endpoint, token = hub.feed_connection()
        self.follower = _Follower(
            endpoint=endpoint, bucket_id=hub.bucket_id, token=token,
            on_changes=on_changes, on_reconcile=reconcile, is_alive=lambda: not watched._stop.is_set(),
        )  # fmt: skip
        self.follower.run()

    def poll(self) -> None:
        """List every interval, doubling it from ``min_poll_s`` to ``max_poll_s`` while nothing changes."""
        watched = self.watched
        interval = watched.config.min_poll_s
        while not watched._stop.is_set():
            found = self.list_watched()
            watched.polls += 1
            changed = found is not None and self.replace(*found)
            interval = watched.config.min_poll_s if changed else min(watched.config.max_poll_s, interval * 2)
            watched._poke.wait(interval)
            if watched._poke.is_set():
                watched._poke.clear()
                interval = watched.config.min_poll_s

    def list_watched(self) -> tuple[list[ObjectInfo], bool] | None:
        """A listing of the watched prefixes, each cut at `config.max_listing_keys`, and whether it is whole."""
        watched = self.watched
        listing: list[ObjectInfo] = []
        complete = True
        try:
            for prefix in watched.config.prefixes:
                part, whole = watched.inner.list_limited(prefix, watched.config.max_listing_keys)
                listing += part
                complete = complete and whole
        except BucketError as exc:
            logger.warning("watch %s: listing failed: %s", watched.url, exc)
            with watched._cond:
                watched.listing_error = str(exc)
                watched._cond.notify_all()  # a first view waited for will not come from this listing
            return None
        if not complete:
            watched.truncated_listings += 1
            log = logger.warning if watched.truncated_listings == 1 else logger.debug
            log("watch %s: a listing was cut at %d keys per prefix (a flooded prefix is seen in part)",
                watched.url, watched.config.max_listing_keys)  # fmt: skip
        watched.listing_error = None
        return listing, complete
