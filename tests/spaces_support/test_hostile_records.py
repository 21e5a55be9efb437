"""Hostile metrics and status objects (issue 41, findings 1 and 3): a value of any JSON type in any typed
field is that object's refusal, never an exception out of a reader; the status objects a panel's
snapshot reads are bounded in size (refused from the listing) and in number."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlsync.bucket.budget import Tier
from rlsync.layout import metrics_key, status_key
from rlsync.limits import MAX_STATUS_BYTES, MAX_STATUS_OBJECTS
from rlsync.scores import Refusals
from rlsync.spaces import metrics
from rlsync.spaces.exchange import put_json
from rlsync.spaces.metrics import (
    STATUS_SYNCS,
    EnvMetrics,
    HubCounts,
    MetricsLog,
    ReplicaStatus,
    Sync,
    TrainerMetrics,
    read_metrics,
    read_status,
)
from rlsync.spaces.records import Record
from rlsync.spaces.snapshots import read_snapshot
from testing.faulty import ReadCountingBucket


def _records(cls: type = Record) -> list[type[Record]]:
    subs = cls.__subclasses__()
    return [c for sub in subs for c in (sub, *_records(sub))]


RECORDS = sorted({c for c in _records() if c.__module__ == metrics.__name__}, key=lambda c: c.__name__)
#: JSON values of every type: the ones a parser yields, with numbers past every bound (10**400, 1e308).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, -(10**400), 2**63, 1e308])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    | st.sampled_from(["anchor", "delta", "train", "free", "queue", "r0", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def test_the_property_test_covers_every_record_of_the_metrics():
    assert {"TrainerMetrics", "EnvMetrics", "ReplicaStatus", "PublishRow", "TrainRow", "Sync", "HubCounts"} <= {
        c.__name__ for c in RECORDS
    }


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@given(data=st.data())
def test_any_json_value_in_any_field_reads_or_is_refused_with_a_value_error(cls, data):
    """Finding 1: ``{"kind": ["delta"]}`` raised TypeError (an unhashable value looked up in a set). Each
    field is absent or holds any JSON value; what reads is well typed (it writes and reads back the same)."""
    fields = {name: JSON for name in cls.__dataclass_fields__}
    doc = data.draw(st.fixed_dictionaries({}, optional={**fields, "format_version": st.just(1) | JSON}))
    try:
        obj = cls.from_json(doc)
    except ValueError:
        return
    assert type(obj) is cls and cls.from_json(json.loads(json.dumps(obj.to_json(), allow_nan=False))) == obj


@pytest.mark.parametrize("value", [["delta"], {}, [], {"a": 1}, True], ids=repr)
def test_the_issues_objects_are_refused_by_every_reader_and_counted(bucket, value):
    put_json(bucket, metrics_key("trainer"), {"format_version": 1, "rows": [{"kind": value, "version": 1}], "version": value})
    put_json(bucket, status_key("r0"), {"format_version": 1, "replica_id": "r0", "recent_syncs": [{"step": 1, "kind": value}]})
    put_json(bucket, status_key("r1"), {"format_version": 1, "replica_id": value})
    trainer = read_metrics(bucket, TrainerMetrics)
    assert trainer is not None and trainer.rows == [] and trainer.version is None  # bad rows and figures skipped
    assert MetricsLog(bucket, TrainerMetrics).rows == []
    assert read_status(bucket, status_key("r0")).recent_syncs == []
    refusals = Refusals()
    assert read_status(bucket, status_key("r1"), refusals) is None and refusals.counts == {"status": 1}
    snap = read_snapshot(bucket)
    assert [s.replica_id for s in snap.statuses] == ["r0"] and snap.refused == 1


def _largest_honest_status(replica: str) -> ReplicaStatus:
    """A status with every field at the largest a replica writes."""
    big, hash_ = 10**15, "a" * 128
    hub = HubCounts(tier=Tier.ENTERPRISE, share=0.123456789, api=big, resolver=big, api_limit=big, resolver_limit=big,
                    by_kind={f"{'k' * 60}{i:04d}": big for i in range(64)}, throttled=big, waited_s=1.23456789e9,
                    short=True, pacing="p" * 200)  # fmt: skip
    syncs = [Sync(step=big + i, kind="delta", nbytes=big, download_s=1.23456789012, idle_s=0.123456789012, time=1.7e9 + 0.1234567)
             for i in range(STATUS_SYNCS)]  # fmt: skip
    counts = dict.fromkeys(["bytes_downloaded", "reads", "refused", "refused_objects", "thread_crashes", "completions",
                            "skipped_stale", "claims_lost", "rehashes", "rehash_mismatches", "adapter_refused",
                            "adapter_bytes_downloaded", "applied_step", "newest_step", "lag", "engine_verified_step",
                            "adapter_step"], big)  # fmt: skip
    return ReplicaStatus(
        replica_id=replica, engine="e" * 128, apply_s=1.2345678901, idle_per_sync_s=0.1234567890, tokens_per_s=12345.678901,
        state_hash=hash_, engine_state_hash=hash_, last_rehash_s=1.2345678, recent_syncs=syncs, hub=hub, adapter_hash=hash_,
        engine_adapter_hash=hash_, adapters_served=[big] * 64, updated_at=1.7e9, **counts,
    )  # fmt: skip


def test_the_largest_status_a_replica_writes_fits_the_bound_readers_apply_with_little_to_spare():
    size = len(json.dumps(_largest_honest_status("r" * 64).to_json(), separators=(",", ":")))
    assert MAX_STATUS_BYTES // 2 < size < MAX_STATUS_BYTES  # a bound near a real status's size


def _snapshot_cost(bucket) -> tuple[int, int, list[str]]:
    counting = ReadCountingBucket(bucket)
    snap = read_snapshot(counting)
    return counting.reads, counting.bytes, [s.replica_id for s in snap.statuses]


@pytest.mark.parametrize("attack", ["large", "many", "junk"])
def test_hostile_status_objects_cost_a_snapshot_at_most_twice_a_clean_one(bucket, attack):
    """Finding 3: one 15 MiB status listed under 15 keys took every panel refresh 26-34 s (every object
    read, up to 16 MiB each). Now each is refused from its listed size, and at most
    ``MAX_STATUS_OBJECTS`` are read, none over ``MAX_STATUS_BYTES``."""
    fleet = [f"r{i:02d}" for i in range(MAX_STATUS_OBJECTS)]
    for replica in fleet:
        put_json(bucket, status_key(replica), _largest_honest_status(replica).to_json())
    clean_reads, clean_bytes, shown = _snapshot_cost(bucket)
    assert shown == fleet
    if attack == "large":  # the issue's: 15 keys of 15 MiB
        big = b'{"replica_id": "big", "engine": "' + b"x" * (15 << 20) + b'"}'
        for i in range(15):
            bucket.put(status_key(f"big{i}"), big)
    elif attack == "many":  # a flood of objects just under the bound, sorted before the fleet
        junk = json.dumps({"replica_id": "a", "engine": "x" * (MAX_STATUS_BYTES - 100)}).encode()
        for i in range(10 * MAX_STATUS_OBJECTS):
            bucket.put(status_key(f"a{i:04d}"), junk)
    else:  # garbage and wrong kinds, under the bound
        for i in range(MAX_STATUS_OBJECTS):
            wrong = {"replica_id": "z", "recent_syncs": [{"step": 1, "kind": {}}]}
            bucket.put(status_key(f"a{i}"), b"\x00garbage" if i % 2 else json.dumps(wrong).encode())
    reads, nbytes, shown = _snapshot_cost(bucket)
    assert reads <= clean_reads and nbytes <= 2 * clean_bytes, (reads, clean_reads, nbytes, clean_bytes)
    refused = {"large": 15, "many": 10 * MAX_STATUS_OBJECTS, "junk": MAX_STATUS_OBJECTS * 3 // 2}  # junk: 32 garbage, the fleet's 64 past the count
    assert read_snapshot(bucket).refused == refused[attack]
    if attack == "large":
        assert shown == fleet and (reads, nbytes) == (clean_reads, clean_bytes)  # refused from the listing, never read


def test_a_flood_of_status_objects_is_refused_past_the_count_and_counted(bucket):
    for i in range(MAX_STATUS_OBJECTS + 10):
        put_json(bucket, status_key(f"r{i:03d}"), ReplicaStatus(replica_id=f"r{i:03d}").to_json())
    reads, _, shown = _snapshot_cost(bucket)
    assert len(shown) == MAX_STATUS_OBJECTS and reads == MAX_STATUS_OBJECTS + 5  # and the 2 metrics, 2 pointers, control
    assert read_snapshot(bucket).refused == 10


def test_an_env_metrics_object_of_wrong_kinds_is_read_without_its_bad_figures(bucket):
    put_json(bucket, metrics_key("env"), {"format_version": 1, "rows": [{"version": [], "mean_reward": {}}],
                                          "pacing": ["queue"], "by_type": {"a": {"count": {}}}, "env": []})  # fmt: skip
    assert read_metrics(bucket, EnvMetrics) == EnvMetrics()


def test_a_snapshot_logs_its_refusals_in_one_line(bucket, caplog):
    for i in range(MAX_STATUS_OBJECTS + 5):
        bucket.put(status_key(f"a{i:03d}"), b"\x00garbage")
    caplog.set_level("WARNING")
    assert read_snapshot(bucket).refused == MAX_STATUS_OBJECTS + 5
    assert [r.getMessage()[:40] for r in caplog.records] == ["the snapshot refused 69 objects {'status"]
