"""A restart never publishes a regression silently (issue 18 item 4).

A trainer that finds a run in the bucket but no checkpoint of it refuses to publish and names the
two ways on; a new run, asked for explicitly, gets a new run id and replicas re-bootstrap from its
first anchor, logging the change once. Checked for the Publisher, for a user's TRL script
(BucketWeightTransfer) and for the trainer Space.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from rlsync.roles import Role
from rlsync.errors import RunExistsError, SyncError
from rlsync.hashing import state_hash
from rlsync.layout import POINTER_KEY, score_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest
from rlsync.spaces.exchange import Sample, write_samples
from rlsync.trl import BucketWeightTransfer
from tests.helpers import bf16, master_state, rl_step


def published_run(bucket, versions: int = 3) -> dict[str, torch.Tensor]:
    """Publish ``versions`` versions of a trained state; returns the master weights."""
    master = master_state()
    pub = Publisher(bucket, owner="t", policy=FixedInterval(10), run_id="first-run")
    for step in range(versions):
        pub.publish(step, master)
        rl_step(master, step)
    return master


def test_publisher_refuses_to_publish_over_a_run_it_did_not_resume(bucket):
    published_run(bucket)
    before = bucket.get(POINTER_KEY)
    with pytest.raises(RunExistsError, match=r"'first-run' at version 2.*resume\(\).*new_run=True"):
        Publisher(bucket, owner="t").publish(3, master_state())  # the untrained weights
    assert bucket.get(POINTER_KEY) == before


def test_new_run_gets_a_new_id_and_replicas_rebootstrap_logging_it_once(bucket, caplog):
    published_run(bucket)
    sub = Subscriber(bucket)
    sub.sync()
    assert (sub.step, sub.run_id) == (2, "first-run")
    fresh = master_state(seed=7)
    pub = Publisher(bucket, owner="t", policy=FixedInterval(10), new_run=True)
    with pytest.raises(SyncError, match="versions never go back"):
        pub.publish(0, fresh)
    assert pub.next_step == 3
    rec = pub.publish(pub.next_step, fresh)
    manifest = read_manifest(bucket)
    assert rec.kind == "anchor" and manifest.step == 3 and [a.step for a in manifest.anchors] == [3]
    assert manifest.deltas == () and manifest.run_id not in ("", "first-run")
    assert not [o.key for o in bucket.list("deltas/")]  # the old run's chain is deleted
    caplog.set_level(logging.INFO, "rlsync.protocol.chooser")
    for _ in range(2):
        sub.sync()
    changes = [r.getMessage() for r in caplog.records if "run changed" in r.getMessage()]
    assert changes == [
        f"the bucket's run changed from 'first-run' (version 2) to {manifest.run_id!r} (version 3): "
        "re-bootstrapping from its newest anchor"
    ]
    assert (sub.step, sub.run_id, sub.state_hash) == (3, manifest.run_id, state_hash(bf16(fresh)))
    rl_step(fresh, 9)
    pub.publish(4, fresh)  # the new run goes on with deltas
    sub.sync()
    assert sub.stats.deltas_applied >= 1 and sub.state_hash == state_hash(bf16(fresh)) == read_manifest(bucket).state_hash


def test_trl_restart_without_a_checkpoint_refuses_and_publishes_nothing(bucket):
    published_run(bucket)
    before = bucket.get(POINTER_KEY)
    transfer = BucketWeightTransfer(publisher=Publisher(bucket, owner="t"))
    with pytest.raises(RunExistsError) as info:
        transfer.init_weight_transfer()  # TRL calls this at train begin
    message = str(info.value)
    assert "checkpoints/" in message and "resume_from_checkpoint=folder" in message
    assert "new_run=True" in message and "TRAINER_NEW_RUN=1" in message and "BucketSync(bucket, resume=True)" in message
    with pytest.raises(RunExistsError):
        transfer.send_weights(iter(master_state().items()))
    transfer.close()
    assert bucket.get(POINTER_KEY) == before


def test_trl_restart_without_a_checkpoint_continues_only_when_it_holds_the_published_weights(bucket):
    master = published_run(bucket)
    before = read_manifest(bucket)
    lock = bucket.get("lock.json")
    refused = BucketWeightTransfer(publisher=Publisher(bucket, owner="other"))
    refused.holds_published = lambda pointer: False
    with pytest.raises(RunExistsError):
        refused.init_weight_transfer()
    refused.close()
    assert bucket.get("lock.json") == lock  # refused before taking the run lock
    seen = []
    transfer = BucketWeightTransfer(publisher=Publisher(bucket, owner="t"))
    transfer.holds_published = lambda pointer: seen.append(pointer) or True
    transfer.send_weights(iter(master.items()))
    transfer.close()
    manifest = read_manifest(bucket)
    assert seen == [before]  # asked about the run's newest version
    assert manifest.step == 3 and manifest.run_id == "first-run" and manifest.deltas[-1].base_step == 2


def test_trl_restart_resuming_a_checkpoint_continues_and_a_new_run_starts_over(bucket):
    master = published_run(bucket)
    resumed = BucketWeightTransfer(publisher=Publisher(bucket, owner="t"), resume_from_checkpoint="out/checkpoint-2")
    resumed.send_weights(iter(master.items()))
    resumed.close()
    manifest = read_manifest(bucket)
    assert manifest.step == 3 and manifest.run_id == "first-run" and manifest.deltas[-1].base_step == 2
    fresh = master_state(seed=3)
    new = BucketWeightTransfer(bucket, new_run=True)
    new.publisher.ownership.owner = "t"  # the same trainer restarted: takes its lock over at once
    new.send_weights(iter(fresh.items()))
    new.close()
    manifest = read_manifest(bucket)
    assert manifest.step == 4 and manifest.run_id != "first-run" and [a.step for a in manifest.anchors] == [4]
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.state_hash == state_hash(bf16(fresh)) == manifest.state_hash


def test_trainer_space_restart_without_checkpoint_refuses_in_the_panel_then_new_run(tmp_path, caplog):
    """The Space: the refusal reaches the panel's status line (RoleRunner); TRAINER_NEW_RUN starts a new run."""
    from rlsync.bucket import LocalBucket
    from rlsync.spaces.role_control import RoleRunner
    from rlsync.spaces.settings import from_env
    from trainer_space.trainer import Trainer, TrainerConfig

    bucket = LocalBucket(tmp_path / "bucket")
    config = TrainerConfig(bucket=str(tmp_path / "bucket"), device="cpu", trainer_id="t", checkpoint_every=1000)
    first = Trainer(config, bucket)
    first.prepare()
    with torch.no_grad():  # trained since: the published weights are no longer those a fresh trainer holds
        next(first.trl.model.parameters()).add_(0.5)
    first.trl._sync_weight()  # TRL's first weight sync: version 0 of a new run
    first.close()
    old = read_manifest(bucket)
    assert old.step == 0 and old.run_id
    built: list[Trainer] = []
    runner = RoleRunner(Role.TRAINER, lambda cfg: built.append(Trainer(cfg, bucket)) or built)
    runner.start(config, wait=True)
    assert runner.state == "failed" and "RunExistsError" in runner.error and "TRAINER_NEW_RUN=1" in runner.error
    assert built[0].transfer.background is None and not os.path.exists(built[0].scratch)  # the refused trainer was closed
    import app  # the combined app names its own way on: --fresh

    stack = SimpleNamespace(trainer=runner, bucket=config.bucket)
    assert "python app.py --fresh" in app.fresh_hint(stack)
    assert app.fresh_hint(SimpleNamespace(trainer=RoleRunner(Role.TRAINER, lambda cfg: []), bucket="b")) is None
    assert read_manifest(bucket) == old
    assert from_env(TrainerConfig, "TRAINER", {"TRAINER_NEW_RUN": "1"}).new_run is True
    again = Trainer(TrainerConfig(**{**config.__dict__, "new_run": True}), bucket)
    assert again.prepare() is None
    again.trl._sync_weight()
    again.close()
    new = read_manifest(bucket)
    assert new.step == 1 and new.run_id != old.run_id and new.deltas == ()
    # samples scored for the old run's version 0 are another policy's: dropped and counted, the new run's kept
    old_sample = Sample("t0", "p", "c", [1, 5, 6], [7, 8], [-0.5, -1.25], 0, reward=1.0)
    write_samples(bucket, score_key(0, "r0"), [old_sample])
    write_samples(bucket, score_key(1, "r0"), [old_sample, dataclasses.replace(old_sample, task_id="t1", version=1)])
    assert again.sync.read_scores(bucket, score_key(0, "r0")) is None
    _, kept = again.sync.read_scores(bucket, score_key(1, "r0"))
    assert [s.version for s in kept] == [1] and again.refusals.total == 2
