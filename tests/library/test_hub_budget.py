"""The Hub's request budget: the stand-in's rate limits and events feed, the library's request meter
(counting and pacing), and the watched bucket that follows the feed instead of listing.

Everything runs against ``testing/hub/server.py`` with the real huggingface_hub + hf_xet client.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

import httpx2
import pytest

from rlsync.roles import Role
from rlsync.bucket.budget import BudgetConfig, RequestClass, RequestMeter, Tier, classify
from rlsync.bucket.hf import HfBucket
from rlsync.bucket.watch import WatchConfig, WatchedBucket, WatchMode, watch
from rlsync.errors import ObjectNotFoundError, TransientBucketError

TOKEN = "hf_budget_token"
BUCKET = "me/budget"


@pytest.fixture
def server(hub):
    hub.add_token(TOKEN)
    hub.create_bucket(BUCKET)
    return hub


def hf(meter: RequestMeter | None = None) -> HfBucket:
    return HfBucket(BUCKET, token=TOKEN, meter=meter or RequestMeter(BudgetConfig(enabled=False)))


def api_kinds(server, since: float) -> list[str]:
    return [classify(r.method, r.path)[1] for r in server.usage(RequestClass.API, TOKEN, since)]


# -- the stand-in ------------------------------------------------------------------------------------


def test_stand_in_enforces_the_tier_per_token_in_fixed_windows_with_headers(server):
    server.limit(Tier.FREE, window_s=6)  # free: 1,000 API per 300 s -> 20 per 6 s
    headers = {"Authorization": f"Bearer {TOKEN}"}
    answers = [httpx2.get(f"{server.url}/api/buckets/{BUCKET}/tree?recursive=true", headers=headers) for _ in range(21)]
    assert [a.status_code for a in answers[:20]] == [200] * 20
    assert answers[0].headers["RateLimit-Policy"] == '"fixed window";"api";q=20;w=6'
    assert answers[19].headers["RateLimit"].startswith('"api";r=0;')
    over = answers[20]
    assert over.status_code == 429 and 1 <= int(over.headers["Retry-After"]) <= 6
    assert over.headers["RateLimit"].startswith('"api";r=0;t=')
    # resolver requests have their own limit (100 per 6 s), another token its own window
    resolve = httpx2.head(f"{server.url}/buckets/{BUCKET}/resolve/missing", headers=headers)
    assert resolve.status_code == 404 and resolve.headers["RateLimit-Policy"].endswith("q=100;w=6")
    server.add_token("other")
    other = httpx2.get(f"{server.url}/api/buckets/{BUCKET}", headers={"Authorization": "Bearer other"})
    assert other.status_code == 200
    assert len(server.usage("api", TOKEN)) == 21 and len(server.usage("resolver", TOKEN)) == 1
    assert server.throttled(TOKEN) == 1 and server.throttled("other") == 0
    time.sleep(float(over.headers["Retry-After"]) + 0.2)  # the next fixed window starts afresh
    assert httpx2.get(f"{server.url}/api/buckets/{BUCKET}", headers=headers).status_code == 200


def test_stand_in_reports_each_tokens_requests_and_429s_on_its_control_route(server):
    """``GET /_standin/usage``: what a benchmark reads of a stand-in in another process (``HubProcess.usage``)."""
    server.limit(Tier.FREE, window_s=3)  # 10 API requests per 3 s
    headers = {"Authorization": f"Bearer {TOKEN}"}
    codes = [httpx2.get(f"{server.url}/api/buckets/{BUCKET}", headers=headers).status_code for _ in range(11)]
    httpx2.head(f"{server.url}/buckets/{BUCKET}/resolve/missing", headers=headers)
    assert codes.count(429) == 1
    usage = httpx2.get(f"{server.url}/_standin/usage").json()
    assert usage[TOKEN] == {"api": {"requests": 11, "throttled": 1}, "resolver": {"requests": 1, "throttled": 0}}


def test_feed_replays_changes_then_follows_live_and_resets(server):
    from huggingface_hub._bucket_live_follow import BucketFollower

    writer = hf()
    writer.put("before.json", b"1")
    got, reconciled = [], []
    server.feed(session_s=1.0, ping_s=0.2)
    follower = BucketFollower(
        endpoint=server.url, bucket_id=BUCKET, token=TOKEN, on_changes=got.extend,
        on_reconcile=lambda: reconciled.append(1), is_alive=lambda: True,
    )  # fmt: skip
    follower.start()
    try:
        deadline = time.monotonic() + 10
        while not follower.subscribed and time.monotonic() < deadline:
            time.sleep(0.05)
        writer.put("live.json", b"22")
        writer.delete(["before.json"])
        server.feed(session_s=1.0, ping_s=0.2, reset=1)  # the next session answers reset: reconcile again
        deadline = time.monotonic() + 15
        while (len(reconciled) < 2 or not any(c.op == "delete" for c in got)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        follower.stop()
    ops = [(c.path, c.op) for c in got]
    assert ("live.json", "add") in ops and ("before.json", "delete") in ops
    live = next(c for c in got if c.path == "live.json")
    assert live.size == 2 and live.xet_hash
    assert len(reconciled) >= 2  # first subscription, then after the reset
    assert server.count("api", "/events$") >= 2  # reconnect after each session


# -- the request meter --------------------------------------------------------------------------------


def test_meter_counts_every_request_of_a_bucket_by_class_and_kind(server):
    meter = RequestMeter(BudgetConfig(enabled=False), role="test")
    bucket = hf(meter)
    for key in ("a.json", "b.json"):
        bucket.put(key, b"x")
        bucket.get(key)
    bucket.list()
    snap = meter.snapshot()
    registry = snap["by_kind"].pop("GET agent-registry", 0)  # huggingface_hub's once-a-day fetch, telemetry on
    assert snap["by_kind"] == {
        "GET xet-write-token": 1, "POST batch": 2, "HEAD resolve": 2, "GET xet-read-token": 1, "GET tree": 1,
    }  # fmt: skip  (one Xet token per kind, reused: rlsync.bucket.hf_xet_grants; a read is one resolve)
    assert snap["api"] == 5 + registry and snap["resolver"] == 2  # the Xet token requests counted too
    assert snap["api"] - registry == len(server.usage("api", TOKEN))  # as the stand-in saw them
    assert snap["api_limit"] == 1000 and snap["resolver_limit"] == 5000 and snap["tier"] == "free"


def test_meter_paces_to_its_share_evenly():
    now = [0.0]
    waits: list[float] = []

    def sleep(s):
        waits.append(s)
        now[0] += s

    meter = RequestMeter(BudgetConfig(tier=Tier.FREE, share=4, target=0.8), clock=lambda: now[0], sleep=sleep)
    for _ in range(400):
        meter.acquire(RequestClass.API)
        meter.record("GET", "/api/buckets/a/b/tree", 200, {})
    # 1,000 * 0.8 / 4 = 200 per 300 s: a burst of 20, then paced; never more than 200 in any 300 s
    assert sum(1 for w in waits if w > 0) >= 379
    assert 300 <= now[0] <= 700
    assert meter.count(RequestClass.API) <= 200 and meter.short and "api share" in meter.pacing


def test_meter_holds_after_a_429_and_when_the_token_budget_is_low():
    now = [0.0]
    meter = RequestMeter(BudgetConfig(enabled=True), clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    meter.record("GET", "/api/buckets/a/b/tree", 429, {"Retry-After": "7"})
    assert meter.acquire(RequestClass.API) == pytest.approx(7.0) and meter.throttled == 1
    # another process spent the token's budget: the RateLimit header says 3 left, reset in 40 s
    meter.record("GET", "/api/buckets/a/b/tree", 200, {"RateLimit": '"api";r=3;t=40', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'})
    start = now[0]
    meter.acquire(RequestClass.API)
    assert now[0] - start == pytest.approx(40.0) and "RateLimit" in meter.pacing


def test_a_busy_role_borrows_what_the_token_has_to_spare_and_no_more():
    now = [0.0]
    meter = RequestMeter(BudgetConfig(tier=Tier.FREE, share=5, target=0.8, window_s=30), clock=lambda: now[0],
                         sleep=lambda s: now.__setitem__(0, now[0] + s))  # fmt: skip
    remaining = 100  # the token's whole window, others idle: the header tells the role so
    for _ in range(60):
        meter.acquire(RequestClass.API)
        remaining -= 1
        reset = max(1, int(30 - now[0]))
        meter.record("GET", "/api/buckets/a/b/tree", 200, {"RateLimit": f'"api";r={remaining};t={reset}',
                                                         "RateLimit-Policy": '"fixed window";"api";q=100;w=30'})  # fmt: skip
        if now[0] >= 29:
            break
    # its own share is 16 per 30 s; with the others idle it took more, never past the limit
    assert 20 < 100 - remaining <= 100


def test_budget_settings_come_from_the_environment(monkeypatch):
    from rlsync.bucket import BucketSettings

    monkeypatch.setenv("HUB_TIER", "pro")
    monkeypatch.setenv("ROLLOUT_HUB_SHARE", "17")
    config = BucketSettings.from_env(Role.ROLLOUT).budget
    assert config.tier is Tier.PRO and config.share == 17 and config.limit(RequestClass.API) == 2500
    assert BucketSettings.from_env(Role.ENV).budget.share == BudgetConfig().share  # the rollout role's override only
    monkeypatch.setenv("HUB_PACING", "0")  # the documented name (the field is `enabled`)
    monkeypatch.setenv("ROLLOUT_HUB_PACING", "1")
    assert not BucketSettings.from_env(Role.ENV).budget.enabled and BucketSettings.from_env(Role.ROLLOUT).budget.enabled
    monkeypatch.setenv("HUB_TIER", "platinum")
    with pytest.raises(ValueError, match="HUB_TIER"):
        BucketSettings.from_env()


def test_library_defaults_ignore_the_environment(server, monkeypatch):
    """Only entry points read the environment: a bucket opened without settings has the defaults."""
    monkeypatch.setenv("HUB_PACING", "0")
    monkeypatch.setenv("HUB_FEED", "0")
    assert RequestMeter().config == BudgetConfig() and RequestMeter().config.enabled
    watched = WatchedBucket(hf())
    try:
        assert watched.config.feed
    finally:
        watched.close()


def test_a_paced_bucket_stays_under_the_stand_in_limit(server):
    server.limit(Tier.FREE, window_s=6)  # 20 API per 6 s for the token
    meter = RequestMeter(BudgetConfig(tier=Tier.FREE, share=1, target=0.8, window_s=6))
    bucket = hf(meter)
    started = time.monotonic()
    for i in range(30):
        bucket.list()
    assert server.throttled(TOKEN) == 0
    assert time.monotonic() - started >= 6  # 30 listings need more than one window at 16 per window


# -- the watched bucket ----------------------------------------------------------------------------------


def wait_until(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_watched_bucket_lists_from_the_feed_and_reads_pointers_only_when_changed(server):
    writer = hf()
    writer.put("latest.json", b'{"v":1}')
    watched = watch(hf())
    assert isinstance(watched, WatchedBucket) and watched.mode is WatchMode.FEED
    try:
        assert [o.key for o in watched.list()] == ["latest.json"]
        wait_until(lambda: server.count("api", "/events$") >= 1)
        since = time.time()
        assert watched.get_limited("latest.json", 100) == b'{"v":1}'
        for _ in range(5):
            assert watched.get_limited("latest.json", 100) == b'{"v":1}'
            assert [o.key for o in watched.list("")] == ["latest.json"]
        with pytest.raises(ObjectNotFoundError):
            watched.get_limited("missing.json", 100)
        assert api_kinds(server, since) == ["GET xet-read-token"]  # one read (a resolve), the rest from view and cache
        stop = threading.Event()
        gen = watched.generation
        threading.Timer(0.3, lambda: writer.put("tasks/0000000001.json", b"{}")).start()
        assert watched.wait(stop, 10, ("tasks/",), gen)  # woken by the feed, not by a listing
        writer.put("latest.json", b'{"v":2}')
        wait_until(lambda: watched.get_limited("latest.json", 100) == b'{"v":2}')
        assert server.count("api", "/tree") == 1  # the one reconciling listing
    finally:
        watched.close()


def test_without_the_feed_a_watched_bucket_polls_with_backoff(server):
    server.feed(False)
    watched = watch(hf(), WatchConfig(feed=True, min_poll_s=0.1, max_poll_s=0.8))
    try:
        wait_until(lambda: watched.mode is WatchMode.POLL and watched.polls >= 1)
        time.sleep(3.0)
        # 0.1, 0.2, 0.4, then 0.8 s: about 6 polls in 3 s, not 30
        assert 4 <= watched.polls <= 9
        before = watched.polls
        hf().put("new.json", b"1")
        wait_until(lambda: [o.key for o in watched.list()] == ["new.json"])
        assert watched.polls > before
    finally:
        watched.close()


def test_reports_do_not_reset_the_polling_backoff(server):
    """Status or metrics (quiet prefixes), written by the role or seen from another, keep the
    backed-off interval; any other write brings it back to the shortest, since roles answer it."""
    server.feed(False)
    watched = watch(hf(), WatchConfig(feed=False, min_poll_s=0.1, max_poll_s=1.6, quiet_prefixes=("status/",)))
    try:
        time.sleep(2.0)  # 0.1 + 0.2 + 0.4 + 0.8: the interval is now 1.6 s
        before = watched.polls
        for i in range(5):
            watched.put("status/r0.json", str(i).encode())
            time.sleep(0.2)
        assert watched.polls - before <= 1  # not one short poll after each report
        other = hf()
        for i in range(4):  # another role's reports, one per poll
            other.put("status/r1.json", str(i).encode())
            time.sleep(1.7)
        wait_until(lambda: "status/r1.json" in [o.key for o in watched.list("status/")])
        before = watched.polls
        time.sleep(1.5)
        assert watched.polls - before <= 1  # still 1.6 s apart, not 0.1, 0.2, 0.4...
        before = watched.polls
        watched.put("rollouts/0000000001/r0.json", b"[1]")
        wait_until(lambda: watched.polls - before >= 2, timeout=1.5)  # 0.1 s, then 0.2 s on
    finally:
        watched.close()


def test_a_closed_role_stops_watching_and_its_bucket_answers_directly(server, monkeypatch):
    """Start builds new role objects: each closed one must end its watch (a thread, a feed session),
    and a closed watch answers like the bucket under it, never from a frozen view."""
    from env_space.simulator import EnvConfig, EnvSimulator

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HUB_FEED", "0")
    env = EnvSimulator(EnvConfig(bucket=f"hf://buckets/{BUCKET}", queue_depth=0))
    watched = env.bucket
    assert isinstance(watched, WatchedBucket)
    env.start()
    wait_until(lambda: watched.polls >= 1)
    env.close()
    wait_until(lambda: not watched._thread.is_alive(), timeout=10)
    polls = watched.polls
    hf().put("tasks/0000000007.json", b"{}")
    assert [o.key for o in watched.list("tasks/")] == ["tasks/0000000007.json"] and watched.polls == polls


def test_a_failed_background_listing_is_shown_until_one_succeeds(server):
    """A watch whose listing fails keeps its last view; the panel says so instead of showing it as fresh."""
    from rlsync.spaces.snapshots import read_snapshot
    from testing.hub.faults import Fault

    server.feed(False)
    watched = watch(hf(), WatchConfig(feed=False, min_poll_s=0.2, max_poll_s=0.2))
    try:
        wait_until(lambda: watched.polls >= 1)
        assert not read_snapshot(watched).error
        server.inject("api", *[Fault(401, message="no", path="/tree")] * 3)
        wait_until(lambda: watched.listing_error is not None)
        assert "bucket listing failed" in read_snapshot(watched).error
        wait_until(lambda: watched.listing_error is None, timeout=10)
        assert not read_snapshot(watched).error
    finally:
        watched.close()


def test_local_buckets_are_not_wrapped(tmp_path):
    from rlsync.bucket import LocalBucket

    local = LocalBucket(tmp_path)
    assert watch(local) is local


def test_429_through_a_watched_bucket_is_retried_without_losing_the_write(server):
    from rlsync.bucket import RetryingBucket
    from testing.hub.faults import Fault

    watched = watch(RetryingBucket(hf(), base_delay=0.05))
    try:
        watched.list()
        server.inject("api", Fault(429, {"Retry-After": "1"}, path="/batch$"))
        watched.put("rollouts/0000000001/r0.json", b"[1]")
        assert hf().get("rollouts/0000000001/r0.json") == b"[1]"
        assert server.count("api", "/batch$") == 2  # refused once, then written once
    finally:
        watched.close()
    with pytest.raises(TransientBucketError):
        server.inject("api", Fault(429, {"Retry-After": "1"}, path="/tree"))
        hf().list()



# -- an idle fleet ------------------------------------------------------------------------------------------


#: The idle fleet's clock runs this many times faster than a deployment's: every interval that paces its
#: requests (polling back-off, status and metrics writes, idle wake-ups, feed sessions) is its default
#: divided by it. Requests per window are a rate, so the same bounds hold per window divided by it.
FLEET_SPEED = 4
#: The Hub's window (300 s), divided as the fleet's intervals are.
FLEET_WINDOW_S = 300 / FLEET_SPEED


@pytest.mark.parametrize("feed", [True, False], ids=["feed", "polling"])
def test_idle_fleet_of_four_replicas_and_the_env_makes_almost_no_requests(server, tmp_path, monkeypatch, feed):
    """The trainer stopped after publishing an anchor; 4 replicas and the env stay up with nothing to
    do (no tasks: ``queue_depth=0`` stands in for a trainer that asks for none). Over a fifth of the
    Hub's window they stay within a fifth of its bounds: 20 API requests per window with the feed on,
    200 with it off (adaptive polling). Every interval runs `FLEET_SPEED` times faster than its default
    (through the settings a deployment has: ``HUB_MIN_POLL_S``, ``HUB_MAX_POLL_S``, ``status_every_s``,
    ``metrics_every_s``; the idle wake-up and the stand-in's feed session too), and the window with them:
    15 s observed instead of 60 (without the back-off or the feed, 5 roles polling every 0.25 s make
    hundreds of listings in it). About 35 s each."""
    from safetensors.torch import load_file

    from env_space.simulator import EnvConfig, EnvSimulator
    from rlsync.bucket.watch import IDLE_WAIT_S
    from rlsync.protocol import Publisher
    from rlsync.spaces.tiny_model import build_tiny_model
    from rollout_space.replica import Replica, ReplicaConfig

    defaults = WatchConfig()
    every_s = ReplicaConfig.__dataclass_fields__["status_every_s"].default / FLEET_SPEED
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HUB_FEED", "1" if feed else "0")
    monkeypatch.setenv("HUB_MIN_POLL_S", str(defaults.min_poll_s / FLEET_SPEED))
    max_poll_s = defaults.max_poll_s / FLEET_SPEED
    monkeypatch.setenv("HUB_MAX_POLL_S", str(max_poll_s))
    # the roles' idle wake-up, in whichever of their modules waits (all imported with the roles above)
    roles_modules = [m for n, m in sys.modules.items() if n.startswith(("env_space", "rollout_space"))]
    waiting = [m for m in roles_modules if hasattr(m, "IDLE_WAIT_S")]
    assert len(waiting) >= 2, waiting  # the env's and the replica's
    for module in waiting:
        monkeypatch.setattr(module, "IDLE_WAIT_S", IDLE_WAIT_S / FLEET_SPEED)
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    state = {n: t.float() for n, t in load_file(model / "model.safetensors").items()}
    Publisher(hf()).publish(0, state)
    server.feed(True, session_s=FLEET_WINDOW_S)  # a session of 300 s, scaled
    url = f"hf://buckets/{BUCKET}"
    env = EnvSimulator(EnvConfig(bucket=url, queue_depth=0, metrics_every_s=every_s))
    replicas = [
        Replica(ReplicaConfig(bucket=url, replica_id=f"r{i}", engine="transformers", model=str(model), device="cpu",
                              status_every_s=every_s))
        for i in range(4)
    ]  # fmt: skip
    roles = [env, *replicas]
    try:
        for role in roles:
            role.start()
        wait_until(lambda: all(r.subscriber.step == 0 for r in replicas), timeout=60)
        # settle: the status writes after the first apply (at most every `every_s`), feed sessions open,
        # and the polling back-off (doubling from HUB_MIN_POLL_S) at its longest interval
        time.sleep(max(every_s, max_poll_s))
        since = time.time()
        time.sleep(FLEET_WINDOW_S / 5)
        idle = server.usage(RequestClass.API, TOKEN, since)
    finally:
        for role in roles:
            role.close()  # stops it and its watch
    kinds = sorted(classify(r.method, r.path)[1] for r in idle)
    print(f"feed {feed}: {len(idle)} API requests in {FLEET_WINDOW_S / 5:g} idle seconds: {collections.Counter(kinds)}")
    assert len(idle) <= (20 if feed else 200) // 5, kinds
    assert all(r.subscriber.step == 0 for r in replicas)
