"""Background publishing is the default of BucketSync and the trainer Space: what the roles read while
a version is sent but not yet in the bucket (the demand's version, the trackio step axis)."""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch

from rlsync.bucket import LocalBucket
from rlsync.protocol import FixedInterval, Publisher, read_manifest
from rlsync.scores import read_samples
from rlsync.spaces.demand import read_demand
from rlsync.spaces.exchange import Refusals
from rlsync.trl import BucketRolloutWorker, BucketSync, BucketWeightTransfer
from rlsync.trl.trackio_sync import TrackioSyncFigures
from tests.helpers import GatedBucket, master_state, rl_step


@pytest.fixture
def gated(tmp_path) -> GatedBucket:
    return GatedBucket(LocalBucket(tmp_path / "bucket"))


def test_bucket_sync_publishes_in_the_background_and_background_false_within_the_send(tmp_path):
    sync = BucketSync(LocalBucket(tmp_path / "a"))
    assert sync.transfer.background is not None
    sync.close()
    assert sync.transfer.background is None  # closed: its worker stopped
    assert BucketWeightTransfer(LocalBucket(tmp_path / "b"), background=False).background is None


def test_the_demand_names_the_published_version_while_the_next_one_is_in_flight(gated):
    """The env and replicas refuse a demand newer than the pointer: the trainer's demand must name
    the newest version in the bucket, not the one still being published."""
    from trainer_space.flow import FlowControl

    master = master_state()
    transfer = BucketWeightTransfer(publisher=Publisher(gated, policy=FixedInterval(100)))
    transfer.send_weights(iter(master.items()))
    transfer.flush()
    worker = BucketRolloutWorker(gated, read_samples, vocab_size=32, max_staleness=2)
    flow = FlowControl(gated, worker, transfer, batch_size=2, max_staleness=2)
    gated.gate.clear()
    rl_step(master, 1)
    transfer.send_weights(iter(master.items()))  # version 1: its upload is held
    assert gated.waiting.wait(30)
    try:
        assert transfer.version == 1 and transfer.published_version == 0 == read_manifest(gated).step
        flow.publish_demand()
        refusals = Refusals()
        demand = read_demand(gated, refusals, newest_version=read_manifest(gated).step)
        assert demand is not None and demand.version == 0 and refusals.total == 0
    finally:
        gated.gate.set()
    transfer.close()
    flow.publish_demand()
    assert read_demand(gated, newest_version=read_manifest(gated).step).version == 1


def test_trackio_logs_a_background_publish_at_the_step_its_version_was_sent(gated):
    """A background publish's record arrives at the next send, a step later: its figures still go to
    the optimizer step the version was sent at."""
    figures = TrackioSyncFigures()
    state = types.SimpleNamespace(global_step=0)
    figures.on_train_begin(None, state, None)
    logged: list[tuple[int, dict]] = []
    figures._run = types.SimpleNamespace(log=lambda row, step: logged.append((step, row)))  # the trackio run
    master = master_state()
    transfer = BucketWeightTransfer(
        publisher=Publisher(gated, policy=FixedInterval(100)), on_publish=figures.record, on_send=figures.sent
    )
    for step in range(3):
        state.global_step = step
        if step:
            rl_step(master, step)
        transfer.send_weights(iter(master.items()))  # the record of the version before arrives here
        if step == 0:  # version 0 in the bucket before version 1 is staged: not coalesced on a loaded machine
            deadline = time.monotonic() + 60
            while read_manifest(gated) is None and time.monotonic() < deadline:
                time.sleep(0.05)
    transfer.close()
    by_version = {row["sync/version"]: step for step, row in logged}  # a coalesced version 1 is never logged
    assert {0, 2} <= by_version.keys() and all(step == version for version, step in by_version.items())


def test_versions_coalesced_behind_a_slow_upload_show_in_trackio_and_on_the_trainer_panel(gated):
    """The publisher falls behind (a delta's upload held): the versions sent meanwhile are coalesced into the
    newest, and Trackio's ``sync/coalesced`` and the trainer panel's line say how many."""
    from rlsync.spaces import frames
    from rlsync.spaces.metrics import TrainerMetrics
    from rlsync.spaces.snapshots import Snapshot
    from trainer_space.trainer import Trainer

    figures = TrackioSyncFigures()
    logged: list[dict] = []
    figures._run = types.SimpleNamespace(log=lambda row, step: logged.append(row))  # the trackio run
    master = master_state()
    transfer = BucketWeightTransfer(
        publisher=Publisher(gated, policy=FixedInterval(100)), on_publish=figures.record, on_send=figures.sent
    )
    try:
        transfer.send_weights(iter(master.items()))
        transfer.flush()  # version 0, the anchor
        gated.gate.clear()
        try:
            rl_step(master, 1)
            transfer.send_weights(iter(master.items()))  # version 1: its upload is held
            assert gated.waiting.wait(30)
            for step in (2, 3, 4):  # each waits behind version 1; 2 and 3 are replaced by the next
                rl_step(master, step)
                transfer.send_weights(iter(master.items()))
        finally:
            gated.gate.set()
        transfer.flush()
        assert transfer.background.coalesced == 2 == figures.coalesced
        shown = Trainer._publish_figures(types.SimpleNamespace(transfer=transfer))  # what the trainer writes
    finally:
        transfer.close()
    assert [(row["sync/version"], row["sync/coalesced"]) for row in logged] == [(0, 0), (1, 0), (4, 2)]
    metrics = TrainerMetrics.from_json(TrainerMetrics(version=4, publish=shown).to_json())  # as the panel reads it
    line = frames.trainer_summary(Snapshot(trainer=metrics, manifest=read_manifest(gated)))
    assert "**2 version(s) coalesced**" in line


def _wait_for_failures(transfer: BucketWeightTransfer, count: int) -> None:
    deadline = time.monotonic() + 60
    while transfer.background.errors < count:
        assert time.monotonic() < deadline, "the background publish never failed"
        time.sleep(0.01)


def test_a_failed_background_publish_is_counted_and_the_next_version_follows_the_last_good_one(gated):
    from rlsync.errors import BucketError
    from rlsync.hashing import state_hash
    from rlsync.protocol import Subscriber

    master = master_state()
    transfer = BucketWeightTransfer(publisher=Publisher(gated, policy=FixedInterval(100)))
    try:
        transfer.send_weights(iter(master.items()))
        transfer.flush()  # version 0, the anchor
        gated.fail = BucketError("injected: the upload failed after the bucket's retries")
        rl_step(master, 1)
        transfer.send_weights(iter(master.items()))  # version 1: its delta upload fails in the worker
        _wait_for_failures(transfer, 1)
        gated.fail = None
        rl_step(master, 2)
        transfer.send_weights(iter(master.items()))  # survives the failure: counted, this version staged after it
        transfer.flush()
        assert transfer.failures.total == 1 and read_manifest(gated).step == transfer.published_version
        follower = Subscriber(gated)
        follower.sync()
        expected = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in master.items()}
        assert follower.step == transfer.published_version and follower.state_hash == state_hash(expected)
    finally:
        transfer.close()


def test_more_failed_background_publishes_in_a_row_than_allowed_stop_the_send(gated):
    from rlsync.errors import BucketError

    master = master_state()
    transfer = BucketWeightTransfer(publisher=Publisher(gated, policy=FixedInterval(100)), max_failed_publishes=1)
    try:
        transfer.send_weights(iter(master.items()))
        transfer.flush()
        gated.fail = BucketError("injected: the bucket refuses every upload")
        for seed in (1, 2):
            rl_step(master, seed)
            transfer.send_weights(iter(master.items()))  # the second send survives the first failure
            _wait_for_failures(transfer, seed)
        rl_step(master, 3)
        with pytest.raises(BucketError, match="refuses every upload"):
            transfer.send_weights(iter(master.items()))  # two in a row: more than allowed
        assert transfer.failures.total == 2 and read_manifest(gated).step == 0  # the last good version stays
    finally:
        gated.fail = None
        with contextlib.suppress(BucketError):
            transfer.close()


def test_a_tracker_that_fails_is_turned_off_and_the_training_goes_on():
    """transformers' TrackioCallback raises at train begin when its Space cannot be created (a Hub that refuses it):
    wrapped by install(), it is logged and off, and every later event skips it."""
    from transformers import TrainerCallback
    from transformers.integrations import TrackioCallback

    from rlsync.trl.trackio_sync import OptionalCallback, TrackioSyncFigures

    calls = []

    class Refused(TrackioCallback):
        def __init__(self) -> None:  # no trackio import: only the events matter here
            pass

        def on_train_begin(self, args, state, control, **kwargs):
            calls.append("train_begin")
            raise RuntimeError("404 Not Found for url '/api/spaces/alice/rl-sync-trackio'")

        def on_log(self, args, state, control, **kwargs):
            calls.append("log")

    class Trainer:  # what install() uses of a transformers Trainer
        def __init__(self) -> None:
            self.callbacks: list[TrainerCallback] = [Refused()]

        def add_callback(self, callback) -> None:
            self.callbacks.append(callback)

        def pop_callback(self, cls):
            found = next((c for c in self.callbacks if isinstance(c, cls)), None)
            if found is not None:
                self.callbacks.remove(found)
            return found

    trainer = Trainer()
    figures = TrackioSyncFigures().install(trainer)
    assert trainer.callbacks[0] is figures and isinstance(trainer.callbacks[1], OptionalCallback)
    tracker = trainer.callbacks[1]
    assert tracker.on_train_begin(None, None, None) is None and "404" in str(tracker.error)
    assert tracker.on_log(None, None, None, logs={}) is None and calls == ["train_begin"]  # off from then on
