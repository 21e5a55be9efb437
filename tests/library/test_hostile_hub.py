"""Hostile inputs round 4 (issue 33, items 3, 6, 7, 8, 12, 13): the bucket layer against the Hub stand-in.

Every test drives the real huggingface_hub + hf_xet client through HF_ENDPOINT at the stand-in (the
``hub`` fixture) and writes its own hostile input: an oversized object, a key flood, a lock taken
over while the events feed fails, a feed event with a non-string path, an absurd ``Retry-After``.
"""

from __future__ import annotations

import threading
import time

import pytest

from rlsync.bucket.budget import BudgetConfig, RequestClass, RequestMeter
from rlsync.bucket.watch import WatchConfig, WatchedBucket, WatchMode, watch
from rlsync.errors import ObjectTooLargeError
from tests.library.test_hub_budget import BUCKET, TOKEN, api_kinds, hf, server, wait_until  # noqa: F401 - server is a fixture


# -- item 3: size-limited reads refuse from the listed size ----------------------------------------------


def test_an_oversized_object_is_refused_before_any_byte_is_downloaded(server, tmp_path):
    writer = hf()
    writer.put("control/publisher.json", b"\0" * (256 << 10))
    reader = hf()
    since = time.time()
    with pytest.raises(ObjectTooLargeError):
        reader.get_limited("control/publisher.json", 64 << 10)
    with pytest.raises(ObjectTooLargeError):
        reader.get_file_limited("control/publisher.json", tmp_path / "out", 64 << 10)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    assert api_kinds(server, since) == []  # the resolve's size was enough: no Xet token, no download
    assert len(server.usage("resolver", TOKEN, since)) == 2
    assert reader.get_limited("control/publisher.json", 1 << 20) == b"\0" * (256 << 10)


def test_a_watched_bucket_refuses_an_oversized_object_from_its_view_without_a_request(server):
    hf().put("latest.json", b"x" * 4096)
    watched = watch(hf())
    try:
        assert [o.key for o in watched.list()] == ["latest.json"]
        since = time.time()
        for _ in range(5):
            with pytest.raises(ObjectTooLargeError):
                watched.get_limited("latest.json", 1024)
        # the view's events feed may (re)connect meanwhile on a loaded machine: not a request for the object
        assert [kind for kind in api_kinds(server, since) if kind != "GET events"] == []
        assert watched.refused_too_large == 5
    finally:
        watched.close()


# -- item 6: a key flood cannot keep the view from becoming ready ---------------------------------------


def test_a_key_flood_does_not_keep_the_view_from_becoming_ready(server):
    writer = hf()
    writer.put("latest.json", b'{"v":1}')
    writer.put("tasks/0000000000.json", b"{}")
    server.plant(BUCKET, [f"tasks/{i:010d}.x{j}.json" for i in range(1, 30) for j in range(100)], like="tasks/0000000000.json")
    flooding = threading.Event()

    def flood() -> None:  # about 300 keys a second while the role starts
        n = 0
        while not flooding.is_set():
            server.plant(BUCKET, [f"tasks/9{n:09d}.f{j}.json" for j in range(30)], like="tasks/0000000000.json")
            n += 1
            time.sleep(0.1)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    watched = WatchedBucket(hf(), WatchConfig(max_listing_keys=500))
    try:
        wait_until(lambda: watched.ready, timeout=30)
        pages, listings = watched.meter.totals["GET tree"], watched.truncated_listings
        # every listing stops at 500 keys (6 pages of the stand-in's 100), not the 3,000+ the bucket holds
        assert server.page_size == 100
        assert listings >= 1 and pages <= 6 * listings, (pages, listings)
        assert [o.key for o in watched.list("latest")] == ["latest.json"]
        wait_until(lambda: server.count("api", "/events$") >= 1, timeout=30)  # the feed opened
        assert watched.truncated_listings >= 1
    finally:
        flooding.set()
        thread.join()
        watched.close()


def test_listing_never_takes_the_whole_request_share():
    clock = [0.0]
    slept = []
    meter = RequestMeter(BudgetConfig(share=1, target=1.0, window_s=300.0), clock=lambda: clock[0],
                         sleep=lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))  # fmt: skip
    listing = 0
    while not slept:  # listing pages until the meter makes listing wait
        meter.acquire(RequestClass.API, listing=True)
        listing += 1
    allowance = BudgetConfig(share=1, target=1.0, window_s=300.0).allowance(RequestClass.API)
    assert listing <= allowance * RequestMeter.BURST * RequestMeter.LISTING_SHARE + 1
    slept.clear()
    for _ in range(10):  # reads and writes still go at once
        meter.acquire(RequestClass.API)
    assert not slept


# -- item 7: the fence reads the bucket, not a stale cache ---------------------------------------------


def test_a_taken_over_trainer_is_fenced_even_while_the_feed_fails(server):
    from rlsync.errors import FencedError
    from rlsync.protocol.lock import acquire, check_fence

    watched = watch(hf())
    try:
        lock = acquire(hf(), "old-trainer", ttl_s=0.0)  # the watched trainer's lock, announced by the feed
        wait_until(lambda: watched.list("lock.json")[0].etag is not None)  # the feed announced it
        watched.get_limited("lock.json", 65536)  # cached from now on
        from testing.hub.faults import Fault

        server.inject("api", *[Fault(503, path="/events$") for _ in range(3)])
        server.feed(False)  # ends the session; every reconnect now fails: the view goes stale
        time.sleep(0.5)
        server.feed(True)
        new = hf()
        acquire(new, "new-trainer", ttl_s=0.0)  # taken over (a stale lock: ttl 0)
        with pytest.raises(FencedError):
            check_fence(watched, lock)
    finally:
        watched.close()


def test_a_role_keeps_the_hash_of_its_own_write_when_the_feed_was_first(server):
    watched = watch(hf())
    try:
        wait_until(lambda: server.count("api", "/events$") >= 1)
        inner_put = watched.inner.put

        def put_then_wait_for_the_feed(key: str, data: bytes) -> None:
            inner_put(key, data)
            wait_until(lambda: (watched._view or {}).get(key) is not None and watched._view[key].etag is not None)

        watched.inner.put = put_then_wait_for_the_feed
        watched.put("latest.json", b'{"v":1}')
        assert watched._view["latest.json"].etag is not None
    finally:
        watched.close()


# -- item 8: the watched cache forgets ------------------------------------------------------------------


def test_the_watched_cache_is_bounded_in_bytes_and_drops_deleted_keys(server):
    writer = hf()
    for i in range(8):
        writer.put(f"tasks/{i:010d}.json", bytes([i]) * (200 << 10))
    watched = WatchedBucket(hf(), WatchConfig(cache_bytes=500 << 10, max_changes=64))
    try:
        wait_until(lambda: len(watched.list("tasks/")) == 8)
        for i in range(8):
            assert watched.get_limited(f"tasks/{i:010d}.json", 1 << 20) == bytes([i]) * (200 << 10)
        assert watched.cache_bytes <= 500 << 10
        writer.delete([f"tasks/{i:010d}.json" for i in range(8)])
        wait_until(lambda: watched.list("tasks/") == [])
        assert watched.cache_bytes == 0
        for n in range(200):
            watched.put(f"status/{n}.json", b"{}")
        assert watched.changes_held <= 64
        stop = threading.Event()
        assert watched.wait(stop, 0.1, ("status/",), since=0)  # a change older than what is held still counts
    finally:
        watched.close()


# -- item 12: an absurd Retry-After is bounded by the window -------------------------------------------


@pytest.mark.parametrize("headers", [{"Retry-After": "1e9"}, {"RateLimit": '"api";r=0;t=999999999'}])
def test_an_absurd_retry_after_holds_a_role_no_longer_than_the_window(headers):
    from rlsync.retry import retry_after_seconds

    assert retry_after_seconds(headers, window_s=300.0) <= 300.0
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        assert clock[0] <= 30.0, "held past the window"

    meter = RequestMeter(BudgetConfig(window_s=30.0), clock=lambda: clock[0], sleep=sleep)
    meter.record("GET", "/api/buckets/a/b/tree", 429, headers)
    meter.acquire(RequestClass.API)
    assert 0 < clock[0] <= 30.0


def test_an_absurd_retry_after_from_the_stand_in_holds_the_role_for_one_window_at_most(server):
    from testing.hub.faults import Fault
    from rlsync.bucket import RetryingBucket
    from rlsync.errors import BucketError

    hf().put("a.json", b"{}")
    server.inject("api", Fault(429, {"Retry-After": "1000000000"}, path="/resolve/"))
    bucket = RetryingBucket(hf(RequestMeter(BudgetConfig(window_s=2.0, enabled=False))), max_total=5.0)
    with pytest.raises(BucketError, match="429"):  # the first answer
        bucket.inner.get("a.json")
    done = threading.Event()
    threading.Thread(target=lambda: (bucket.get("a.json"), done.set()), daemon=True).start()
    assert done.wait(10.0)  # the next request waits out one 2 s window, not 31 years


# -- item 13: a malformed feed event is skipped and counted ---------------------------------------------


def test_a_malformed_feed_event_is_skipped_and_counted(server):
    writer = hf()
    writer.put("latest.json", b'{"v":1}')
    watched = watch(hf())
    try:
        wait_until(lambda: server.count("api", "/events$") >= 1)
        server.announce(BUCKET, {"path": 12345, "op": "add", "size": 1}, {"path": ["x"], "op": "delete"})
        writer.delete(["latest.json"])
        wait_until(lambda: watched.list() == [])
        assert watched.malformed_events == 2
    finally:
        watched.close()


def test_a_feed_that_keeps_failing_falls_back_to_polling(server, monkeypatch):
    watched = WatchedBucket(hf(), WatchConfig(min_poll_s=0.1, max_poll_s=0.2, feed_failures=2))
    try:
        wait_until(lambda: server.count("api", "/events$") >= 1)

        def broken(changes):
            raise RuntimeError("a batch this view cannot apply")

        monkeypatch.setattr(watched._updater, "apply_changes", broken)
        hf().put("new.json", b"1")
        wait_until(lambda: watched.mode is WatchMode.POLL, timeout=10)
        wait_until(lambda: [o.key for o in watched.list()] == ["new.json"], timeout=10)
    finally:
        watched.close()


def test_a_feed_whose_sessions_keep_failing_falls_back_to_polling(server):
    from testing.hub.faults import Fault

    server.inject("api", *[Fault(503, path="/events$") for _ in range(5)])
    watched = WatchedBucket(hf(), WatchConfig(min_poll_s=0.1, max_poll_s=0.2, feed_failures=3))
    try:
        wait_until(lambda: watched.mode is WatchMode.POLL, timeout=10)
        hf().put("new.json", b"1")
        wait_until(lambda: [o.key for o in watched.list()] == ["new.json"], timeout=10)
    finally:
        watched.close()


# -- the soak trial ----------------------------------------------------------------------------------


def test_soak_trial_hub_hostile(tmp_path):
    import random

    from testing.soak.kinds.hub_hostile import trial_hub_hostile

    result = trial_hub_hostile(random.Random(33), tmp_path, final=6)
    assert result.violations == [] and result.lost == 0
    assert sum(result.faults.values()) >= 5 and result.faults["hostile: takeover while the feed failed (fenced)"] == 1
    assert result.checks > 20


# -- issue 41, finding 4: a RateLimit number that cannot be used is ignored -------------------------------

_HUGE = "9" * 400
_UNUSABLE = [
    {"RateLimit": f'"api";r=0;t={_HUGE}'},  # float(t) overflowed
    {"RateLimit": '"api";r=0;t=5', "RateLimit-Policy": f'"fixed window";"api";q={_HUGE};w=300'},  # q * target overflowed
    {"RateLimit": f'"api";r={_HUGE};t=5', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'},
    {"RateLimit": f'"api";r=0;t={"9" * 5000}'},  # past int()'s digit limit
]


@pytest.mark.parametrize("headers", _UNUSABLE, ids=["t", "q", "r", "digits"])
def test_an_unusable_ratelimit_number_is_ignored_by_the_retry_and_the_meter(headers):
    from rlsync.retry import ratelimit_info, retry_after_seconds

    assert ratelimit_info(headers) is None and retry_after_seconds(headers) is None
    clock = [0.0]
    meter = RequestMeter(BudgetConfig(window_s=30.0), clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    for status in (200, 503, 429):
        meter.record("GET", "/api/buckets/a/b/tree", status, headers)
    assert meter.acquire(RequestClass.API) == 1.0  # the 429's default hold, not the header's
    assert meter.throttled == 1


@pytest.mark.parametrize("headers", _UNUSABLE[:2], ids=["t", "q"])
def test_a_503_with_an_unusable_ratelimit_header_is_retried_as_usual(server, headers):
    from rlsync.bucket.retry import RetryingBucket
    from testing.hub.faults import Fault

    writer = hf(RequestMeter(BudgetConfig()))
    writer.put("latest.json", b"{}")
    server.inject("api", Fault(503, headers, path="/paths-info"), Fault(429, headers, path="/paths-info"))
    reader = RetryingBucket(hf(RequestMeter(BudgetConfig())), base_delay=0.01, max_delay=0.05, max_total=20.0)
    assert reader.get_limited("latest.json", 1024) == b"{}"
