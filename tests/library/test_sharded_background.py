"""Sharded publishing in the background (issue 29): 2 gloo ranks on CPU, each publishing on a worker thread.

Each test spawns the trainer of tests/sharded_trainer.py with ``background``: every step is staged
into a :class:`rlsync.protocol.sharded_background.ShardedBackgroundPublisher` (the cast of the rank's
shards and one agreement all-reduce) and published by the ranks' workers over a process group of
their own; rank 0 reports, per stage, the version and the hash of the gathered bf16 state it staged.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.protocol import Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket

from tests.sharded_trainer import spawn_ranks


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(bucket_dir, results, stages, **options):
    spawn_ranks(2, _port(), str(bucket_dir), str(results), list(range(stages)), {"background": True, **options})
    return json.loads(results.read_text())


def _check_chain(report, bucket) -> list[list]:
    """Every rank published the same versions; each is bit-exact (its state hash is the hash of the
    gathered bf16 state staged under its number); the bucket replays and a replica ends on the final
    weights. Returns the records."""
    records = report["ranks"][0]["records"]
    assert all(rank["records"] == records and rank["coalesced"] == report["ranks"][0]["coalesced"] for rank in report["ranks"])
    staged = {s["version"]: s["hash"] for s in report["stages"] if "version" in s}
    assert records and all(staged[step] == digest for step, _, digest in records)
    assert records[-1][0] == max(staged)  # the flush published the last staged version
    manifest = read_manifest(bucket)
    assert manifest.step == records[-1][0] and manifest.state_hash == report["final_hash"]
    assert verify_bucket(bucket).ok, verify_bucket(bucket).errors  # every delta's base and result hash
    replica = Subscriber(bucket)
    replica.sync()
    assert replica.step == manifest.step and state_hash(replica.state) == report["final_hash"]
    return records


def test_background_publishes_are_bit_exact_at_every_version_and_after_the_final_flush(tmp_path):
    report = _spawn(tmp_path / "bucket", tmp_path / "r.json", 6)
    records = _check_chain(report, LocalBucket(tmp_path / "bucket"))
    coalesced = report["ranks"][0]["coalesced"]
    assert len(records) + coalesced == 6 and records[0][:2] == [0, "anchor"]  # every staged version published or coalesced
    assert all(rank["errors"] == 0 and not rank["failures"] for rank in report["ranks"])


def test_a_slow_rank_makes_every_rank_coalesce_the_same_versions_and_the_chain_stays_bit_exact(tmp_path):
    # rank 1's uploads crawl (2 s each); the step before stage 4 lasts long enough for the workers to catch up
    report = _spawn(tmp_path / "bucket", tmp_path / "r.json", 7, fault_rank=1, delay_s=2.0, pause_at=[4, 12])
    records = _check_chain(report, LocalBucket(tmp_path / "bucket"))
    coalesced = report["ranks"][0]["coalesced"]
    assert coalesced > 0 and len(records) + coalesced == 7  # counted the same on both ranks (_check_chain)
    steps = [r[0] for r in records]
    assert steps != list(range(7)) and steps == sorted(steps)  # a skipped number: a delta against the last published
    assert 4 in steps  # once every worker is idle, the sync goes to the workers at once (not held until the flush)


def test_a_failed_background_publish_surfaces_on_every_rank_and_the_bucket_keeps_its_last_good_version(tmp_path):
    # rank 1's first delta upload (stage 1) fails inside its worker; stage 2's long step lets the workers finish
    # it, so the failure surfaces at that sync however loaded the machine (not at the flush, past every stage)
    report = _spawn(tmp_path / "bucket", tmp_path / "r.json", 6, fault_rank=1, fail_once_on=["deltas/"], pause_at=[2, 3.0])
    failures = [rank["failures"] for rank in report["ranks"]]
    assert len(failures[0]) == 1 and [f[0] for f in failures[0]] == [f[0] for f in failures[1]]  # the same stage, both ranks
    assert failures[0][0][1] == "ShardedPublishError" and failures[1][0][1] == "BucketError"  # rank 1's own error
    assert [rank["errors"] for rank in report["ranks"]] == [1, 1]
    index = failures[0][0][0]
    failed = report["stages"][index]
    records = _check_chain(report, LocalBucket(tmp_path / "bucket"))
    published_before = [step for step, _, _ in records if step < report["stages"][index - 1].get("version", 0)]
    assert failed["bucket_step"] == max(published_before)  # the bucket stayed at the last good version
    assert report["stages"][index + 1]["version"] == failed["bucket_step"] + 1  # the failed one taken back, as single-process


def test_a_worker_failing_alone_surfaces_on_every_rank_once_the_peer_times_out_without_a_hang(tmp_path):
    # rank 1's worker raises at its second publish before any round: rank 0's worker waits in the round until
    # the workers' group times out (5 s), then every rank raises at the next sync
    report = _spawn(tmp_path / "bucket", tmp_path / "r.json", 8, fault_rank=1, worker_raises_at=2, group_timeout_s=5,
                    stop_on_failure=True)  # fmt: skip
    failures = [rank["failures"] for rank in report["ranks"]]
    assert failures[1] and failures[1][0][1] == "SyncError" and failures[0] and failures[0][0][0] == failures[1][0][0]
    assert failures[0][0][1] == "ShardedPublishError"  # rank 0's: the collective's timeout, as a sync error
    assert [rank["errors"] for rank in report["ranks"]] == [1, 1]
    assert report["stages"][failures[0][0][0]]["bucket_step"] == 0  # the anchor, the last good version
    assert read_manifest(LocalBucket(tmp_path / "bucket")).step == 0


def test_rank_killed_mid_background_publish_leaves_the_previous_version_and_a_restarted_group_continues(tmp_path):
    bucket_dir = tmp_path / "bucket"
    # rank 1's worker dies as it uploads its part of the first delta, whichever version that is: on a loaded
    # machine the background workers fall behind and coalesce versions, so a named step may never be uploaded
    with pytest.raises(mp.ProcessExitedException):
        _spawn(bucket_dir, tmp_path / "r1.json", 4, fault_rank=1, die_on="deltas/")
    bucket = LocalBucket(bucket_dir)
    before = read_manifest(bucket)
    assert before.step == 0 and before.newest_anchor.step == 0 and verify_bucket(bucket).ok  # the anchor alone
    follower = Subscriber(bucket)
    follower.sync()
    assert follower.step == before.step and follower.fetch() is None  # nothing half-written shows
    report = _spawn(bucket_dir, tmp_path / "r2.json", 3, resume=True)
    records = _check_chain(report, bucket)
    assert records[0][1] == "anchor" and records[0][0] > before.step  # resumed: an anchor, after the bucket's newest
    assert all("-e0002" in f.key for f in read_manifest(bucket).newest_anchor.files)  # the restarted group's epoch
    follower.sync()
    assert follower.step == records[-1][0] and state_hash(follower.state) == report["final_hash"]
