"""Issue 33 item 6: each role's watched bucket lists and follows only the prefixes the role reads
(``rlsync.layout.ROLE_READS``), so a key flood under a prefix it does not read costs it no listing page.

Against the Hub stand-in (the ``hub`` fixture) with the real huggingface_hub client.
"""

from __future__ import annotations

import threading
import time

import pytest

from rlsync.roles import Role
from rlsync.bucket.budget import BudgetConfig, RequestMeter
from rlsync.bucket.watch import WatchedBucket, wait_for_change
from rlsync.layout import (
    POINTER_KEY,
    ROLE_READS,
    SCORES_PREFIX,
    STATUS_PREFIX,
    TASKS_PREFIX,
    score_key,
    status_key,
    task_key,
)
from rlsync.spaces.exchange import open_role_bucket
from tests.helpers import hub_buckets

BUCKET = "me/roles"
TOKEN = "hf_role_prefixes_token"
FLOOD = 2000  # keys per flooded prefix: 20 pages of the stand-in's 100 for one listing of it


@pytest.fixture
def hf(hub):
    """Opens an unpaced HfBucket on the test's bucket of the Hub stand-in."""
    return hub_buckets(hub, BUCKET, TOKEN)


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def flooded(role: Role) -> list[str]:
    """The prefixes flooded for `role`: the replicas' reports (no role reads them), for the trainer the tasks too."""
    return [STATUS_PREFIX, *([TASKS_PREFIX] if role is Role.TRAINER else [])]


def test_the_layout_says_what_each_role_reads():
    assert set(ROLE_READS) == set(Role)
    assert all(POINTER_KEY in reads and STATUS_PREFIX not in reads and "" not in reads for reads in ROLE_READS.values())
    assert TASKS_PREFIX not in ROLE_READS[Role.TRAINER]
    assert TASKS_PREFIX in ROLE_READS[Role.ENV] and TASKS_PREFIX in ROLE_READS[Role.ROLLOUT]


@pytest.mark.parametrize("role", list(Role))
def test_a_key_flood_under_a_prefix_a_role_does_not_read_costs_it_no_listing_page(hub, hf, role):
    writer = hf()
    writer.put(POINTER_KEY, b'{"v":1}')
    writer.put(task_key(1), b"{}")
    writer.put(status_key("r0"), b"{}")
    for prefix in flooded(role):
        like = task_key(1) if prefix == TASKS_PREFIX else status_key("r0")
        hub.plant(BUCKET, [f"{prefix}f{i:06d}.json" for i in range(FLOOD)], like=like)
    meter = RequestMeter(BudgetConfig(enabled=False), role=role)
    watched = open_role_bucket(role, "", hf(meter))
    try:
        assert isinstance(watched, WatchedBucket)
        wait_until(lambda: watched.ready)
        wait_until(lambda: hub.count("api", "/events") >= 1)  # the feed opened
        for prefix in flooded(role):
            assert hub.count("api", f"/tree/{prefix.rstrip('/')}") == 0, prefix  # not one page of the flood
        # one page per prefix the role reads (each holds fewer keys than a page), never the whole bucket's
        assert meter.totals["GET tree"] <= len(ROLE_READS[role]), meter.totals
        assert watched.truncated_listings == 0 and watched.config.prefixes == ROLE_READS[role]
        assert [o.key for o in watched.list(POINTER_KEY)] == [POINTER_KEY]
        if TASKS_PREFIX in ROLE_READS[role]:
            assert [o.key for o in watched.list(TASKS_PREFIX)] == [task_key(1)]
        # the feed: a change under a prefix the role reads wakes it, the flood's prefix does not
        stop = threading.Event()
        since = watched.generation
        hub.plant(BUCKET, [f"{STATUS_PREFIX}late{i}.json" for i in range(50)], like=status_key("r0"))
        assert not wait_for_change(watched, stop, 1.0, ("",), since)
        writer.put(score_key(1, "r0") if SCORES_PREFIX in ROLE_READS[role] else POINTER_KEY, b'{"v":2}')
        assert wait_for_change(watched, stop, 30.0, ("",), since)
        assert hub.count("api", f"/tree/{STATUS_PREFIX.rstrip('/')}") == 0
    finally:
        watched.close()
