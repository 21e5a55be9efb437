"""Trial ``hub_hostile``: the hostile inputs of issue 33 at volume, against the Hub stand-in with the
real Hub client, beneath a publisher and two subscribers that follow the bucket through watched
views (:class:`~rlsync.bucket.watch.WatchedBucket`, events feed first).

While they run, a hostile writer holding the bucket's write token does, over and over, at random:

- **oversized objects**: plants an object far over its reader's limit (a pointer-sized control
  object, a demand, a status); a watched reader must refuse it from its listed size, with no
  download (no Xet read token requested);
- **demand objects**: plants a demand asking for up to 2^20 samples or for a version never
  published; the env side must refuse the version lie and never put more batches in flight than
  it keeps;
- **key floods**: plants hundreds of keys under ``tasks/`` at once (a fresh view started during
  the flood must become ready with a bounded number of listing pages);
- **a failing feed**: makes the next feed sessions fail (503);
- **a hostile feed**: announces changes with a path that is not a string, an unknown operation, a
  negative size or a hash that is not a string.

At the end of each trial the publisher is taken over by another trainer while the feed fails, and
the old one must be fenced although its view is stale. Invariants: every subscriber reaches the
final version bit-exactly, no version is lost, every watch thread is alive (no role death), every
view still answers, and every hostile object was refused and counted.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from pathlib import Path

from rlsync.errors import FencedError, ObjectTooLargeError
from rlsync.protocol import Subscriber

from ...hub.faults import Fault
from ...hub.server import HubServer
from ..invariants import Ledger, TrialResult, check_verified
from ..processes import CHILD_TIMEOUT_S
from ..toy import PublisherThread, follow_until_converged
from .hub_storage import BUCKET, _bucket, _online, _start

DEFAULT_TRIALS = 2
#: What a reader of a small object allows (the limit of the pointers and control objects).
SMALL_LIMIT = 64 << 10
#: Keys a watched view lists per prefix in this trial (small, so that the floods pass it).
LISTING_KEYS = 200


def _watched(server: HubServer):
    from rlsync.bucket.watch import WatchConfig, WatchedBucket

    return WatchedBucket(_bucket(server, 8), WatchConfig(min_poll_s=0.2, max_poll_s=1.0, max_listing_keys=LISTING_KEYS))


class _Hostile(threading.Thread):
    """The hostile writer: one of the five attacks per round until stopped, each checked and counted."""

    def __init__(self, server: HubServer, rng: random.Random, result: TrialResult) -> None:
        super().__init__(daemon=True)
        self.server, self.rng, self.result = server, rng, result
        self.stop = threading.Event()
        self.writer = _bucket(server, 30)
        self.reader = _watched(server)
        self.error: BaseException | None = None
        self.flooded = 0

    def run(self) -> None:
        try:
            self.writer.put("status/seed.json", b"{}")
            attacks = (self.oversized, self.demand, self.flood, self.failing_feed, self.hostile_feed)
            while not self.stop.is_set():
                attack = self.rng.choice(attacks)
                attack()
                self.result.faults[f"hostile: {attack.__name__.replace('_', ' ')}"] += 1
                self.stop.wait(self.rng.uniform(0.05, 0.3))
        except BaseException as exc:  # reported by the trial
            self.error = exc

    def oversized(self) -> None:
        key = self.rng.choice(["control/demand.json", f"status/big{self.rng.randrange(4)}.json", "control/policy.json"])
        self.writer.put(key, b"\0" * self.rng.randint(SMALL_LIMIT + 1, 4 << 20))
        deadline = time.monotonic() + 10
        while not [o for o in self.reader.list(key) if o.key == key and o.size > SMALL_LIMIT]:
            if time.monotonic() > deadline:
                return self.result.fail(f"the watched view never listed the oversized {key}")
            time.sleep(0.02)
        before = self.server.count("api", "/resolve/")  # every download asks for the file's Xet hash first
        refused = self.reader.refused_too_large
        try:
            self.reader.get_limited(key, SMALL_LIMIT)
            self.result.fail(f"an oversized {key} was read")
        except ObjectTooLargeError:
            pass
        self.result.check(self.reader.refused_too_large == refused + 1, f"the refusal of {key} was not counted")
        self.result.check(self.server.count("api", "/resolve/") == before, f"the oversized {key} was downloaded")

    def demand(self) -> None:
        from rlsync.spaces.demand import Demand, batches_to_issue, newest_version, read_demand, write_demand
        from rlsync.spaces.exchange import Refusals

        lie = self.rng.random() < 0.5
        version = self.rng.choice([1 << 62, 10**9]) if lie else 0
        want = self.rng.choice([1 << 20, 65_536, 4096])
        write_demand(self.writer, Demand(version=version, max_staleness=self.rng.randint(0, 4), read_batch=-1, want_samples=want))
        refusals = Refusals()
        newest = newest_version(self.writer)
        found = read_demand(self.writer, refusals, newest_version=newest)
        if version > newest:
            self.result.check(found is None and refusals.total == 1, f"a demand for version {version} was taken")
        elif found is not None:
            keep = 8
            self.result.check(batches_to_issue(found, [], set(), set(), 4.0, keep) <= keep, "a demand put more batches in flight than kept")

    def flood(self) -> None:
        n = self.rng.randint(100, 600)
        self.server.plant(BUCKET, [f"tasks/9{self.flooded:05d}{i:04d}.flood.json" for i in range(n)], like="status/seed.json")
        self.flooded += 1
        fresh = _watched(self.server)  # a role starting during the flood
        try:
            deadline = time.monotonic() + 20
            while not fresh.ready:
                if time.monotonic() > deadline:
                    return self.result.fail("a view started during a key flood never became ready")
                time.sleep(0.02)
            pages = fresh.meter.totals["GET tree"]
            self.result.check(pages <= LISTING_KEYS // self.server.page_size + 1, f"{pages} listing pages for one view")
        finally:
            fresh.close()

    def failing_feed(self) -> None:
        self.server.inject("api", *[Fault(503, path="/events$") for _ in range(self.rng.randint(1, 4))])

    def hostile_feed(self) -> None:
        bad = [{"path": 12345, "op": "add", "size": 1}, {"path": ["x"], "op": "delete"}, {"path": "latest.json", "op": "explode"},
               {"path": "status/x.json", "op": "add", "size": -5}, {"path": "status/y.json", "op": "add", "xetHash": {"a": 1}},
               {"path": "../escape", "op": "add", "size": 1}]  # fmt: skip
        self.server.announce(BUCKET, *self.rng.sample(bad, self.rng.randint(1, len(bad))))


def _takeover_while_the_feed_fails(server: HubServer, result: TrialResult) -> None:
    """The publisher's watched bucket keeps a stale cached lock while the feed fails; another trainer
    takes the run over; the old one must be fenced at its next check."""
    from rlsync.protocol.lock import acquire, check_fence

    watched = _watched(server)
    try:
        lock = acquire(_bucket(server, 8), "soak-old", ttl_s=0.0)
        deadline = time.monotonic() + 20
        while not (watched.list("lock.json") and watched.list("lock.json")[0].etag):
            if time.monotonic() > deadline:
                return result.fail("the watched view never saw the lock")
            time.sleep(0.02)
        watched.get_limited("lock.json", SMALL_LIMIT)  # cached
        server.inject("api", *[Fault(503, path="/events$") for _ in range(3)])
        server.feed(False)
        time.sleep(0.3)
        server.feed(True)
        acquire(_bucket(server, 8), "soak-new", ttl_s=0.0)
        try:
            check_fence(watched, lock)
            result.fail("a trainer taken over while the feed failed was not fenced")
        except FencedError:
            result.faults["hostile: takeover while the feed failed (fenced)"] += 1
    finally:
        watched.close()


def trial_hub_hostile(rng: random.Random, workdir: Path, final: int | None = None) -> TrialResult:
    """Publisher and two watched subscribers on the Hub stand-in beside a hostile writer.

    Args:
        rng: Draws the attacks, their sizes and seeds.
        workdir: Scratch folder (the stand-in's Xet storage).
        final: Last version published (default: drawn from 6..10).
    """
    result = TrialResult("hub_hostile")
    server = _start(workdir)
    server.feed(True, session_s=5.0, ping_s=0.5)
    ledger = Ledger(result)
    final = final if final is not None else rng.randint(6, 10)
    watches = []
    try:
        with _online():
            observer = _bucket(server, 30)
            hostile = _Hostile(server, rng, result)
            watches.append(hostile.reader)

            class Checked(PublisherThread):
                def after_publish(self, step: int) -> None:
                    ledger.observe(observer)

            publisher = Checked(_watched(server), ledger, final, interval=4, keep=2, pause_s=0.05, seed=rng.randrange(1000))
            subs = [Subscriber(_watched(server)) for _ in range(2)]
            watches += [publisher.pub.bucket] + [s.bucket for s in subs]
            hostile.start()
            follow_until_converged(publisher, subs, ledger, CHILD_TIMEOUT_S, collections.Counter())
            hostile.stop.set()
            hostile.join(60)
            result.check(hostile.error is None, f"the hostile writer's checks failed: {hostile.error!r}")
            server.clear_faults()
            ledger.observe(observer)
            check_verified(observer, result, "after the hostile run")
            for i, w in enumerate(watches):
                result.check(w._thread.is_alive(), f"watch {i} died")
                result.check(bool(w.list("latest.json")), f"watch {i} no longer lists the pointer")
                for name in ("malformed_events", "truncated_listings", "feed_errors", "refused_too_large"):
                    if getattr(w, name):
                        result.notes[f"watch: {name.replace('_', ' ')}"] += getattr(w, name)
            _takeover_while_the_feed_fails(server, result)
    finally:
        for w in watches:
            w.close()
        server.close()
    result.notes["hub: keys planted by floods"] = sum(1 for p in server.buckets.get(BUCKET, {}) if ".flood." in p)
    return result
