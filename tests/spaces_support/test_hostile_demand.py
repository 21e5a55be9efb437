"""Hostile inputs round 4 (issue 33, item 5): a planted ``control/demand.json``."""

from __future__ import annotations

import pytest

from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.bucket import LocalBucket
from rlsync.spaces.demand import Demand, write_demand
from rlsync.layout import TASKS_PREFIX
from rlsync.spaces.exchange import list_batches


@pytest.fixture
def bucket(tmp_path):
    return LocalBucket(tmp_path / "bucket")


def test_a_demand_for_a_million_samples_issues_no_more_batches_than_the_env_keeps(bucket):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2, keep_batches=8), bucket)
    publish = env.publish_tasks

    def bounded_publish() -> int:  # fail at once instead of writing 65,000 objects
        assert len(list_batches(bucket, TASKS_PREFIX)) < 100, "the env kept issuing"
        return publish()

    env.publish_tasks = bounded_publish
    write_demand(bucket, Demand(version=0, max_staleness=1, read_batch=-1, want_samples=1 << 20))
    assert env.issue_tasks() == 8
    assert env.issue_tasks() == 0  # the 8 are in flight
    assert len(list_batches(bucket, TASKS_PREFIX)) == 8
    assert env.refusals.counts["control"] == 2 and "batches kept" in env.refusals.last


def test_a_demand_for_a_version_never_published_is_refused_and_cancels_nothing(bucket):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2, queue_depth=2), bucket)
    write_demand(bucket, Demand(version=1 << 62, max_staleness=0, read_batch=-1, want_samples=4))
    assert env.issue_tasks() == 2  # as without a demand: queue_depth batches
    assert env.demand is None
    assert env.refusals.counts["control"] == 1 and "newer than the newest published version 0" in env.refusals.last
