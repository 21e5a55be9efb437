"""Demand-driven work (issue 20) and the samples the trainer refuses (issue 26, critical 2 and low 6).

- the env issues task batches at the rate in the trainer's ``control/demand.json`` and
  cancels rollouts already too stale instead of scoring them;
- a replica does not start a batch that would be stale, a slower replica's late answer is
  cancelled, and a replica that stops mid-round leaves its batch to the others;
- cumulative counts (read, trained, dropped stale, expired unread) and the staleness histogram;
- in-range logprob lies (-200) are refused, degenerate groups dropped and counted, a step with
  non-finite gradients skipped before the optimizer, TRL's version pinned to the bucket's.
"""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch
from transformers import TrainerCallback

from env_space.environments import get_environment
from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.errors import NonFiniteError
from rlsync.layout import DEMAND_KEY, claim_key, rollout_key, score_key
from rlsync.protocol import FixedInterval, Publisher
from rlsync.sampling import MAX_GROUP_SIZE, MIN_SAMPLED_LOGPROB
from rlsync.spaces.demand import (
    Demand,
    batches_to_issue,
    parse_demand,
    read_demand,
    target_in_flight,
    would_be_stale,
    write_demand,
)
from rlsync.spaces.exchange import Refusals, Sample, SampleLimits, parse_samples, put_json, read_samples, write_samples
from rlsync.spaces.tiny_model import tiny_model_path
from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer, NonFiniteStepGuard, VersionGuard
from rollout_space.replica import Replica, ReplicaConfig
from tests.helpers import bf16, master_state, rl_step
from tests.library.test_secrets import StubEngine

PER_BATCH = 2 * 4  # tasks_per_batch=2, G=4


def replica(bucket, name: str) -> Replica:
    model = str(tiny_model_path(environments=get_environment))
    return Replica(ReplicaConfig(bucket=str(bucket.root), replica_id=name, model=model, device="cpu"), bucket=bucket, engine=StubEngine())


def sync(r: Replica) -> None:
    r.slot.put(r.subscriber.fetch())
    assert r.slot.update is not None and r.apply_pending()


def tasks_in(bucket) -> list[int]:
    return sorted(int(o.key.split("/")[1][:10]) for o in bucket.list("tasks/"))


def sample(task: str, reward: float, version: int = 0, logprobs=(-0.5, -1.25)) -> Sample:
    return Sample(task, "p", "c", [1, 5], [7, 8], list(logprobs), version, reward=reward)


# -- the demand object --------------------------------------------------------


@pytest.mark.parametrize("doc", [
    [], {"version": 1}, {"version": -1, "max_staleness": 2, "read_batch": 0, "want_samples": 1},
    {"version": 1, "max_staleness": 2, "read_batch": 0, "want_samples": 10**9},
    {"version": 1, "max_staleness": 2, "read_batch": 0, "want_samples": 1.5},
    {"version": 1, "max_staleness": 2, "read_batch": 0, "want_samples": 1, "step_s": float("nan")},
    {"version": 1, "max_staleness": 2, "read_batch": 0, "want_samples": 1, "latency_s": 1e9},
    {"version": True, "max_staleness": 2, "read_batch": 0, "want_samples": 1},
])  # fmt: skip
def test_hostile_demand_objects_are_refused_and_counted(bucket, doc):
    with pytest.raises(ValueError):
        parse_demand(doc)
    bucket.put(DEMAND_KEY, json.dumps(doc).encode())
    refusals = Refusals()
    assert read_demand(bucket, refusals) is None and refusals.counts == {"control": 1}


def test_in_flight_is_sized_from_step_and_latency_within_the_staleness_window():
    assert target_in_flight(16, 2, None, None) == 32  # nothing measured: the whole window
    assert target_in_flight(16, 4, 2.0, 0.5) == 32  # read within a step: the step in progress plus one
    assert target_in_flight(16, 4, 1.0, 2.5) == 64  # three steps to read, plus one
    assert target_in_flight(16, 2, 1.0, 30.0) == 32  # never more than can be trained before going stale
    assert target_in_flight(16, 0, 1.0, 30.0) == 16


# -- env, replicas, worker ----------------------------------------------------


def test_env_issues_what_the_trainer_demands_and_cancels_stale_rollouts(bucket):
    master, pub = master_state(), Publisher(bucket, policy=FixedInterval(10))
    for v in range(6):
        rl_step(master, v)
        pub.publish(v, master)
    env = EnvSimulator(EnvConfig(tasks_per_batch=2), bucket)
    env.step()
    assert tasks_in(bucket) == [0, 1]  # no demand yet: queue_depth batches waiting
    write_demand(bucket, Demand(version=5, max_staleness=2, read_batch=1, want_samples=3 * PER_BATCH))
    env.step()
    assert tasks_in(bucket) == [0, 1, 2]  # three batches in flight: 0 and 1 are not answered yet
    env.step()
    assert tasks_in(bucket) == [0, 1, 2]  # and no more while they are
    prompts = {b: json.loads(bucket.get(f"tasks/{b:010d}.json"))["tasks"] for b in (1, 2)}
    for b, version in ((2, 3), (1, 2)):  # min_version is 5 - 2 = 3: batch 1's rollouts are already stale
        write_samples(bucket, rollout_key(b, "r"), [Sample(t["task_id"], t["prompt"], "x", [1], [5], [-1.0], version) for t in prompts[b] for _ in range(4)])
    env.step()
    assert read_samples(bucket, score_key(2, "r")) is not None
    assert read_samples(bucket, score_key(1, "r")) is None and bucket.list("rollouts/") == []  # cancelled, not scored
    metrics = json.loads(bucket.get("metrics/env.json"))
    assert (metrics["scored"], metrics["cancelled_stale"], metrics["pacing"]) == (PER_BATCH, PER_BATCH, "demand")
    env.step()  # batch 1 yields nothing more: one batch is issued in its place (2 is scored but not read yet)
    assert tasks_in(bucket) == [0, 1, 2, 3]
    write_demand(bucket, Demand(version=5, max_staleness=2, read_batch=10**10 - 1, want_samples=3 * PER_BATCH))
    for _ in range(3):  # a read_batch past everything: scored batches count as read, unscored ones stay in flight
        env.step()
    assert tasks_in(bucket) == [0, 1, 2, 3, 4]  # 0, 3, 4 in flight: never more than the demand


def test_slower_replica_and_replica_stopping_mid_round_keep_counts_exact(bucket):
    master, pub = master_state(), Publisher(bucket, policy=FixedInterval(10))
    pub.publish(0, master)
    fast, slow = replica(bucket, "fast"), replica(bucket, "slow")
    sync(fast), sync(slow)
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=1 << 20, max_staleness=1)
    worker.align_versions()
    env = EnvSimulator(EnvConfig(tasks_per_batch=2), bucket)
    write_demand(bucket, Demand(version=0, max_staleness=1, read_batch=-1, want_samples=2 * PER_BATCH, step_s=1.0))
    env.step()
    assert tasks_in(bucket) == [0, 1]
    assert slow.batches.next_batch() == 0  # the slow replica takes batch 0 and stops mid-round: it never answers
    assert fast.step() and fast.step()  # the fast one answers both, the abandoned batch first
    assert {o.key for o in bucket.list("rollouts/")} == {rollout_key(0, "fast"), rollout_key(1, "fast")}
    env.step()
    assert worker.poll() == 2 * PER_BATCH and worker.newest_batch == 1

    for v in (1, 2):  # the trainer moves on; the slow replica lags at version 0
        rl_step(master, v)
        pub.publish(v, master)
    sync(fast), sync(fast)
    worker.update_model_version(2)
    write_demand(bucket, Demand(version=2, max_staleness=1, read_batch=1, want_samples=2 * PER_BATCH, step_s=1.0))
    env.step()
    assert tasks_in(bucket) == [0, 1, 2, 3]
    assert not slow.step() and slow.tasks.skipped_stale == 1  # version 0 would be two behind: not started
    slow.tasks.batch_gen_s = 50.0  # a very slow replica, and a starving trainer: it can start at the newest version
    assert would_be_stale(Demand(2, 1, 1, 8, step_s=1.0, buffered_steps=3.0), 2, 50.0)  # 3 steps buffered: stale by then
    assert not would_be_stale(Demand(2, 1, 1, 8, step_s=1.0, buffered_steps=0.0), 2, 50.0)
    assert bucket.list("rollouts/") == []
    slow.answer(2)  # a slow replica that had started before the trainer moved on answers late, at version 0
    env.step()
    assert read_samples(bucket, score_key(2, "slow")) is None and env.figures.cancelled == PER_BATCH  # cancelled, unscored
    assert fast.step() and fast.step()  # batch 2 is unanswered again: the fast replica does it, then 3
    env.step()
    assert worker.poll() == 2 * PER_BATCH
    flow = worker.flow()
    assert flow["read"] == env.figures.scored == 4 * PER_BATCH and flow["dropped_stale"] == 0 and flow["queued"] == 4 * PER_BATCH
    slow.publish_status()
    assert json.loads(bucket.get("status/slow.json"))["skipped_stale"] == 1


def test_cumulative_counts_expired_unread_and_staleness_histogram(bucket):
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    from trainer_space.flow import FlowControl

    PartialState(cpu=True)
    Publisher(bucket).publish(10, bf16(master_state()))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_staleness=2)
    worker.update_model_version(1)
    worker.align_versions()  # bucket 10 is trainer version 1
    groups = [sample("b", 1.0, 9), sample("b", 0.0, 9), sample("c", 1.0, 9), sample("c", 0.0, 9), sample("a", 1.0, 10), sample("a", 0.0, 10)]
    write_samples(bucket, score_key(0, "r0"), groups, batch=0, issued_at=0.0)
    assert worker.poll() == 6 and worker.newest_batch == 0 and worker.latency_s == 3600.0  # latency capped
    worker.update_model_version(3)  # two versions on: bucket 10 lags 2, bucket 9 lags 3 (expired in the queue)
    metrics = defaultdict(list)
    dataset = RolloutQueueDataset(worker.rollout_buffer, lambda: worker.model_version, worker.check_health, 60.0, metrics, max_staleness=2, poll_interval_s=0.01)
    it = iter(dataset)
    assert [next(it)["metrics"]["reward"] for _ in range(2)] == [1.0, 0.0]
    assert worker.rollout_buffer.qsize() == 0  # the other four were taken and dropped
    flow = worker.flow()
    assert (flow["read"], flow["expired_unread"], flow["staleness"]) == (6, 4, {"2": 2})
    transfer = types.SimpleNamespace(published_version=10)
    control = FlowControl(bucket, worker, transfer, batch_size=2, max_staleness=2)
    control.add_step(2.0, 0.25, 1.25)
    control.publish_demand()
    figures = control.figures()
    assert (figures.trained, figures.wait_s_total, figures.step_compute_s) == (2, 0.25, 1.0)
    demand = read_demand(bucket)
    assert demand == Demand(10, 2, 0, 4, 1.0, worker.latency_s, 0.0, demand.written_at)  # the window: 2 steps x 2
    write_samples(bucket, score_key(1, "r0"), [sample("d", 1.0, 10), sample("d", 0.0, 10)], batch=1)
    worker.poll()  # two samples buffered: the demand written now asks for 4 - 2
    control.publish_demand()
    assert read_demand(bucket).want_samples == 2
    control.refresh_if_starving()
    assert read_demand(bucket).want_samples == 2  # not drained: not rewritten
    [next(it) for _ in range(2)]  # TRL takes them without a step ending (here: no step at all)
    control.refresh_if_starving()
    assert read_demand(bucket).want_samples == 4  # drained since written: the whole window asked again


def test_a_restarted_trainer_that_reads_only_stale_scores_rewrites_its_demand(bucket):
    """A trainer restarted on a bucket that holds old scores writes its demand before it has read
    anything (``read_batch`` -1: every batch in the bucket counts as in flight, so the env issues
    nothing). It then reads the old batches and drops them all as stale: no step ends to write a
    new demand, so the poll that read them must, or the run waits for good."""
    from trainer_space.flow import FlowControl

    Publisher(bucket).publish(20, bf16(master_state()))
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_staleness=2)
    worker.update_model_version(1)
    worker.align_versions()  # bucket 20 is trainer version 1
    for batch in range(3):  # scores of a run long past
        write_samples(bucket, score_key(batch, "r0"), [sample(f"t{batch}", 1.0, 5), sample(f"t{batch}", 0.0, 5)], batch=batch)
    control = FlowControl(bucket, worker, types.SimpleNamespace(published_version=20), batch_size=2, max_staleness=2)
    control.publish_demand()  # on_train_begin
    assert read_demand(bucket).read_batch == -1
    env_issues = lambda: batches_to_issue(read_demand(bucket), [0, 1, 2], {0, 1, 2}, set(), 2.0, 64)  # noqa: E731
    assert env_issues() == 0  # all three count as in flight
    assert worker.poll() == 0 and worker.flow()["dropped_stale"] == 6 and worker.newest_batch == 2
    control.refresh_if_starving()
    assert read_demand(bucket).read_batch == 2 and env_issues() == 2  # the env issues again
    written_at = read_demand(bucket).written_at
    control.refresh_if_starving()  # nothing new read: not rewritten
    assert read_demand(bucket).written_at == written_at


# -- issue 26: lies and degenerate groups ---------------------------------------


def test_in_range_logprob_lies_are_refused_by_env_and_trainer(bucket):
    doc = {"samples": [{"task_id": "t", "prompt": "p", "completion": "c", "prompt_ids": [1], "token_ids": [5, 6],
                        "logprobs": [-1.0, -200.0], "version": 0, "reward": 1.0}]}  # fmt: skip
    with pytest.raises(ValueError, match="logprob"):
        parse_samples(doc, SampleLimits())
    doc["samples"][0]["logprobs"] = [-1.0, MIN_SAMPLED_LOGPROB]
    assert parse_samples(doc, SampleLimits())[1][0].logprobs[1] == MIN_SAMPLED_LOGPROB
    Publisher(bucket).publish(0, bf16(master_state()))
    worker = BucketRolloutWorker(bucket, lambda b, k: ({}, [sample("t", 1.0), sample("t", 0.0, logprobs=(-1.0, -200.0)),
                                                            sample("t", 0.5, logprobs=(-1.0, MIN_SAMPLED_LOGPROB - 0.01))]), vocab_size=32)  # fmt: skip
    write_samples(bucket, score_key(0, "r"), [])
    assert worker.poll() == 0 and worker.counts["invalid"] == 2 and worker.counts["degenerate_groups"] == 1


def test_degenerate_groups_are_dropped_and_counted(bucket):
    Publisher(bucket).publish(0, bf16(master_state()))
    huge = [sample("huge", 1.0 if i == 0 else 0.0) for i in range(MAX_GROUP_SIZE + 1)]
    kept = [sample("pair", 1.0), sample("pair", 0.0)]
    write_samples(bucket, score_key(0, "r"), [sample("single", 1.0), *huge, *kept])
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)
    worker.align_versions()
    assert worker.poll() == 2
    assert (worker.counts["degenerate_groups"], worker.counts["dropped_degenerate"]) == (2, 1 + MAX_GROUP_SIZE + 1)
    taken = [worker.rollout_buffer.get_nowait() for _ in range(2)]
    assert max(abs(s.advantage) for s in taken) == pytest.approx(1.0)


def test_non_finite_step_never_reaches_the_optimizer():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    guard = NonFiniteStepGuard()
    (model(torch.ones(1, 4)).sum() * float("nan")).backward()
    guard.on_pre_optimizer_step(None, types.SimpleNamespace(global_step=0), None, model=model)
    optimizer.step()
    assert guard.skipped == 1 and not optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    model(torch.ones(1, 4)).sum().backward()
    guard.on_pre_optimizer_step(None, types.SimpleNamespace(global_step=1), None, model=model)
    optimizer.step()
    assert guard.skipped == 1 and optimizer.state and not torch.equal(model.weight, before["weight"])


def test_refused_publish_does_not_let_trl_version_run_ahead(bucket):
    refused: list[NonFiniteError] = []
    transfer = BucketWeightTransfer(bucket, on_non_finite=refused.append)
    state = bf16(master_state())
    transfer.send_weights(iter(state.items()))  # bucket version 0
    transfer.flush()  # published (a send before would coalesce with it)
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_staleness=2)
    trl = types.SimpleNamespace(model_version=1)  # TRL counts the initial sync as version 1
    worker.update_model_version(1)
    worker.align_versions()
    guard = VersionGuard(trl, transfer, worker)
    for _ in range(3):  # three poisoned syncs: TRL bumps its version after each, the bucket refuses each
        poisoned = {n: t.clone() for n, t in state.items()}
        next(iter(poisoned.values())).view(-1)[0] = float("nan")
        transfer.send_weights(iter(poisoned.items()))
        transfer.flush()  # the background publish refuses it: raised here, handed to on_non_finite
        trl.model_version += 1
        worker.update_model_version(trl.model_version)
        guard.pin()
    transfer.close()
    assert len(refused) == 3 and transfer.version == 0
    assert trl.model_version == worker.model_version == worker.trainer_version(0) == 1 and guard.corrected == 3
    write_samples(bucket, score_key(0, "r"), [Sample("t", "p", "c", [1], [2], [-1.0], 0, reward=r) for r in (0.0, 1.0)])
    assert worker.poll() == 2 and worker.counts["dropped_stale"] == 0  # honest samples are not stale


def test_overview_shows_share_trained_waiting_and_staleness_histogram():
    from rlsync.spaces.frames import flow_summary, staleness_frame
    from rlsync.spaces.metrics import EnvMetrics, TrainerMetrics
    from rlsync.spaces.snapshots import Snapshot

    flow = {"pacing": "demand", "trained": 900, "wait_s_total": 12.4, "wait_share": 0.041, "wait_s_last": 0.25,
            "dropped_stale": 3, "expired_unread": 0, "staleness": {"0": 100, "1": 700, "2": 100, "x": 5, "99": 1, "3": "bad"}}  # fmt: skip
    snap = Snapshot(trainer=TrainerMetrics.from_json({"flow": flow}), env=EnvMetrics.from_json({"scored": 1000, "cancelled_stale": 7}))
    line = flow_summary(snap)
    assert "**90%** of 1000 scored samples trained on (900)" in line and "waited **12 s** (4% of its wall time)" in line
    assert "3 dropped stale" in line and "7 cancelled stale" in line and "expired" not in line
    assert staleness_frame(snap).to_dict("list") == {"staleness": [0, 1, 2], "samples": [100, 700, 100]}
    hostile = Snapshot(trainer=TrainerMetrics.from_json({"flow": {"pacing": "<img src=x>", "trained": "many", "staleness": [1, 2]}}))
    assert flow_summary(hostile) == "Flow: " and staleness_frame(hostile).empty
    assert flow_summary(Snapshot()) == "Flow: no figures yet."


class PoisonWeights(TrainerCallback):
    """NaN into one weight as step ``at`` begins: its loss and gradients are NaN, and so would be its publish."""

    def __init__(self, trainer, at: int) -> None:
        self.trainer, self.at = trainer, at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            with torch.no_grad():
                norm = [p for n, p in self.trainer.trl.model.named_parameters() if n.endswith("norm.weight")][-1]
                norm.fill_(float("nan"))  # the final norm: every logit, the loss and every gradient are NaN


def test_trainer_keeps_training_through_logprob_lies_and_a_nan_step(tmp_path):
    """The issue's trigger (two scores objects of -200 logprobs) is refused; a NaN step is skipped before the
    optimizer, its publish refused, and TRL's version stays the bucket's, so honest samples keep training.
    The publish runs in the background, so its refusal reaches the trainer at the next send: the step
    between trains on the NaN weights (skipped too), then the published weights are restored."""
    from rlsync.bucket import LocalBucket
    from tests.trl_feed import ScoreFeeder
    from trainer_space.trainer import Trainer, TrainerConfig

    bucket = LocalBucket(tmp_path / "bucket")
    trainer = Trainer(TrainerConfig(bucket=str(bucket.root), batch_size=4, max_steps=4, device="cpu", max_staleness=1, poll_s=0.05), bucket)
    trainer.trl.add_callback(PoisonWeights(trainer, at=2))
    callbacks = [type(c).__name__ for c in trainer.trl.callback_handler.callbacks]  # issue 31: quiet, no class twice
    assert callbacks.count("StepIntervalCallback") == 1 and "EveryStep" in callbacks, callbacks
    assert "PrinterCallback" not in callbacks and "DebugLogs" in callbacks, callbacks
    lie = {"task_id": "t", "prompt": "p", "completion": "c", "prompt_ids": [1, 2], "token_ids": [5, 6], "logprobs": [-200.0, -200.0], "version": 0}
    for i in range(2):
        write_samples(bucket, score_key(0, f"lie{i}"), [Sample(**lie, reward=float(r)) for r in (0, 1, 0, 1)])
    with ScoreFeeder(bucket, trainer.trl.processing_class, tasks=2, group=2, every_s=0.2):
        trainer.run()
    assert trainer.refusals.total == 2 and "logprob" in trainer.refusals.last
    assert trainer.step_guard.skipped == 2 and trainer.transfer.non_finite_refused == 1 and trainer.version_guard.corrected >= 1
    assert trainer.opt_steps == 4 and trainer.version == 2  # train begin, steps 1 and 4 (2 refused, its refusal raised at 3's send)
    assert trainer.trl.model_version == trainer.worker.model_version == trainer.worker.trainer_version(trainer.version)
    flow = json.loads(bucket.get("metrics/trainer.json"))["flow"]
    assert flow["trained"] == 16 and flow["steps"] == 4 and flow["pacing"] == "demand"
    assert read_demand(bucket).version == trainer.version
    trainer.close()


def test_drops_are_logged_as_one_summary_line_per_interval(bucket, caplog):
    import logging
    import time

    Publisher(bucket).publish(10, bf16(master_state()))
    write_samples(bucket, score_key(0, "r"), [sample(f"t{i}", float(i % 2), 8) for i in range(40)])  # 2 versions behind
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32, max_staleness=1, poll_s=0.05, summary_s=0.3)
    caplog.set_level(logging.INFO)
    worker.start()
    try:
        deadline = time.time() + 30
        while worker.counts["dropped_stale"] < 40 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    finally:
        worker.stop()
    logging.getLogger("trl.experimental.async_grpo.async_grpo_trainer").info("dropping stale sample (staleness=3, max=2)")
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if "dropped stale" in m] == [
        "rollouts in the last 0.3s: read 40, dropped stale 40, expired unread 0, dropped degenerate 0, invalid 0, unreadable 0"
    ]
    assert not any(m.startswith("dropping stale sample") for m in lines)


# -- claims: one replica per batch ---------------------------------------------------------


def test_replicas_claim_batches_so_that_each_batch_is_answered_once(bucket):
    """Two replicas that both saw a batch unanswered used to both answer it: twice the samples at one version,
    more than the trainer can take before they go stale (issue 31: a third of the scored samples expired)."""
    Publisher(bucket, policy=FixedInterval(10)).publish(0, master_state())
    a, b = replica(bucket, "a"), replica(bucket, "b")
    sync(a), sync(b)
    env = EnvSimulator(EnvConfig(tasks_per_batch=2), bucket)
    write_demand(bucket, Demand(version=0, max_staleness=2, read_batch=-1, want_samples=2 * PER_BATCH, step_s=1.0))
    env.step()
    assert tasks_in(bucket) == [0, 1]
    assert a.batches.next_batch() == 0 and a.batches.claim(0)
    assert b.batches.next_batch() == 1  # 0 is claimed: b takes the next one
    assert a.step() is True and b.step() is True  # a answers its claim... then b answers 1
    assert {o.key for o in bucket.list("rollouts/")} == {rollout_key(0, "a"), rollout_key(1, "b")}
    assert a.batches.claimed is None and b.batches.claimed is None

    env.step()  # scores both; the demand is met, no batch is issued
    put_json(bucket, claim_key(2, "b"), {"replica": "b", "batch": 2})  # b wrote its claim on 2 at the same moment
    assert not a.batches.claim(2) and a.batches.lost == 1  # a sees another claim: it withdraws its own
    assert [o.key for o in bucket.list("claims/") if o.key.startswith("claims/0000000002/")] == [claim_key(2, "b")]

    b.batches.claimed = 2
    b.batches.release()  # b stops before answering: the batch is free again
    assert bucket.list("claims/0000000002/") == []


def replica_with_a_batch(bucket) -> Replica:
    """Replica ``a`` at version 0, and task batch 0 issued."""
    Publisher(bucket, policy=FixedInterval(10)).publish(0, master_state())
    a = replica(bucket, "a")
    sync(a)
    write_demand(bucket, Demand(version=0, max_staleness=2, read_batch=-1, want_samples=PER_BATCH, step_s=1.0))
    EnvSimulator(EnvConfig(tasks_per_batch=2), bucket).step()
    return a


def test_a_claim_never_answered_is_ignored_after_the_timeout(bucket, monkeypatch):
    import rollout_space.claims as claims_module

    a = replica_with_a_batch(bucket)
    put_json(bucket, claim_key(0, "dead"), {"replica": "dead", "batch": 0})  # a replica that died holding batch 0
    assert a.batches.next_batch() is None
    monkeypatch.setattr(claims_module, "CLAIM_TIMEOUT_S", 0.0)
    assert a.batches.next_batch() == 0 and a.batches.claim(0)  # its claim has outlived the timeout: a takes the batch
    assert a.step() and {o.key for o in bucket.list("rollouts/")} == {rollout_key(0, "a")}


def test_the_env_prunes_claims_with_their_batches(bucket):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2, keep_batches=2), bucket)
    for _ in range(4):
        env.publish_tasks()
    for b in range(4):
        put_json(bucket, claim_key(b, "r"), {"replica": "r", "batch": b})
    env.prune()
    assert sorted(o.key for o in bucket.list("claims/")) == [claim_key(2, "r"), claim_key(3, "r")]


def test_a_replica_whose_answer_fails_withdraws_its_claim(bucket, monkeypatch):
    from rlsync.errors import BucketError

    a = replica_with_a_batch(bucket)

    def fail(batch: int) -> int:
        raise BucketError("the rollouts write failed")

    monkeypatch.setattr(a, "answer", fail)
    with pytest.raises(BucketError):
        a.step()
    assert bucket.list("claims/") == [] and a.batches.claimed is None  # the others need not wait for a timeout
