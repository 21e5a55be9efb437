"""A watched bucket before its first listing is in (issue 41, item 5).

At 16 replicas on one PRO token the first listing of a replica's watched prefixes waits ~15 s for its listing
share, and until then the view sees no change: a replica waiting on it for the trainer's first pointer slept
its whole idle wait (30 s) while the trainer published on. Until the view is in, a wait lasts at most
``min_poll_s`` (the caller reads the bucket itself again), and the view's arrival counts as a change.
"""

from __future__ import annotations

import threading

from rlsync.bucket import LocalBucket
from rlsync.bucket.base import BucketWrapper
from rlsync.bucket.watch import WatchConfig, WatchedBucket
from rlsync.layout import POINTER_KEY

NEVER_S = 3600.0


class HeldListing(BucketWrapper):
    """A bucket whose listings wait until :attr:`release` is set (a first listing waiting for its budget)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.release = threading.Event()

    def list(self, prefix: str = ""):
        assert self.release.wait(60), "the test never released the listing"
        return super().list(prefix)


def test_a_wait_before_the_first_listing_is_a_poll_and_the_view_arriving_is_a_change(tmp_path):
    held = HeldListing(LocalBucket(tmp_path / "bucket"))
    watched = WatchedBucket(held, WatchConfig(min_poll_s=0.05, prefixes=(POINTER_KEY,)))
    stop = threading.Event()
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(watched.wait(stop, NEVER_S, (POINTER_KEY,), 0)))
    try:
        assert not watched.ready
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "a wait on a view not listed yet sleeps its whole timeout"
        assert answers == [False]  # nothing seen: the caller reads the bucket itself and waits again
        since = watched.generation
        held.release.set()
        assert watched.wait(stop, 30.0, (POINTER_KEY,), since)  # the view came: what changed before it is unknown
        assert watched.ready
    finally:
        stop.set()
        held.release.set()
        waiter.join(10)
        watched.close()
