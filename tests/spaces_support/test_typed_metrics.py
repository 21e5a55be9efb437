"""Typed metrics (issue 30, item 4): each role's metrics or status object is one dataclass
(:mod:`rlsync.spaces.metrics`), written by the role and read by the panels through the same type, with a
``format_version``; an object of another version, not an object, too large, or with a bad required field
is refused, and a bad optional figure falls back to its default."""

from __future__ import annotations

import dataclasses
import json

import pytest

from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.bucket.budget import Tier
from rlsync.layout import metrics_key, score_key, status_key
from rlsync.limits import MAX_OBJECT_BYTES
from rlsync.protocol import FixedInterval, Publisher
from rlsync.scores import Refusals
from rlsync.spaces import frames
from rlsync.spaces.demand import Pacing
from rlsync.spaces.exchange import put_json
from rlsync.spaces.metrics import (
    EnvMetrics,
    Episode,
    FlowFigures,
    HubCounts,
    MetricsLog,
    PublishRow,
    RefusalCounts,
    ReplicaStatus,
    RewardRow,
    Sync,
    TrainerMetrics,
    TrainRow,
    TypeReward,
    read_metrics,
)
from rlsync.spaces.records import MAX_CHARS
from rlsync.spaces.snapshots import read_snapshot
from tests.helpers import master_state

HUB = HubCounts(tier=Tier.PRO, api=3, api_limit=100, by_kind={"GET tree": 3}, pacing="slow")
TRAINER = TrainerMetrics(
    rows=[
        PublishRow(kind="anchor", version=0, nbytes=1000, changed_pct=100.0, time=1.0),
        PublishRow(kind="delta", version=1, nbytes=50, trl_nbytes=200, experts_changed_pct={"0.1": 2.5}, time=2.0),
        TrainRow(kind="train", opt_step=1, version=1, loss=0.5, kl=0.01, time=3.0),
    ],
    version=1, opt_steps=1, notice="resumed", refused=RefusalCounts(total=1, by_kind={"scores": 1}, last="x"),
    flow=FlowFigures(pacing=Pacing.DEMAND, trained=8, staleness={"0": 8}), hub=HUB,
)  # fmt: skip
ENV = EnvMetrics(
    rows=[RewardRow(version=1, mean_reward=0.5, count=4, time=3.0)], env="reverse", scored=4,
    episodes=[Episode(version=1, type="word", prompt="p", completion="c", reward=1.0)], pacing=Pacing.QUEUE,
    failures={"score: timeout": 1}, by_type={"reverse / word": TypeReward(count=4, mean_reward=0.5)},
)  # fmt: skip
STATUS = ReplicaStatus(
    replica_id="r0", engine="transformers", applied_step=1, newest_step=1, lag=0, hub=HUB, updated_at=4.0,
    recent_syncs=[Sync(step=0, kind="anchor", nbytes=1000, idle_s=0.1, time=1.5)],
)  # fmt: skip


@pytest.mark.parametrize("obj", [TRAINER, ENV, STATUS], ids=["trainer", "env", "replica"])
def test_each_object_reads_back_as_the_type_it_was_written_as(obj):
    doc = json.loads(json.dumps(obj.to_json(), allow_nan=False))
    assert doc["format_version"] == 1
    assert type(obj).from_json(doc) == obj


def test_the_panels_read_what_the_roles_write_through_the_same_types(bucket):
    for kind, obj in ((TrainerMetrics, TRAINER), (EnvMetrics, ENV)):
        log = MetricsLog(bucket, kind)
        for row in obj.rows:
            log.add(row)
        log.state = dataclasses.replace(obj, rows=[])
        log.flush()
    put_json(bucket, status_key("r0"), STATUS.to_json())
    snap = read_snapshot(bucket)
    assert (snap.trainer, snap.env, snap.statuses) == (TRAINER, ENV, [STATUS])
    assert MetricsLog(bucket, TrainerMetrics).rows == TRAINER.rows  # a restarted role keeps its history


@pytest.mark.parametrize(
    "doc",
    [
        {"format_version": 2, "version": 1},  # another format
        {"format_version": "1"},
        {"rows": [], "version": 1, "format_version": None},
        ["not", "an", "object"],
    ],
)
def test_an_object_of_another_format_or_shape_is_refused_and_the_panel_shows_nothing(bucket, doc):
    put_json(bucket, metrics_key("trainer"), doc)
    put_json(bucket, metrics_key("env"), doc)
    put_json(bucket, status_key("r0"), {**doc, "replica_id": "r0"} if isinstance(doc, dict) else doc)
    assert read_metrics(bucket, TrainerMetrics) is None and read_metrics(bucket, EnvMetrics) is None
    snap = read_snapshot(bucket)
    assert snap.trainer == TrainerMetrics() and snap.env == EnvMetrics() and snap.statuses == []
    assert frames.trainer_summary(snap) == "Trainer: nothing published yet."


def test_an_object_written_before_the_format_version_existed_reads_as_version_1():
    assert TrainerMetrics.from_json({"version": 3, "rows": [{"kind": "anchor", "version": 3}]}).version == 3


def test_an_object_too_large_is_refused_without_parsing(bucket):
    bucket.put(metrics_key("env"), b'{"env": "' + b"x" * MAX_OBJECT_BYTES + b'"}')
    assert read_metrics(bucket, EnvMetrics) is None and read_snapshot(bucket).env == EnvMetrics()


def test_bad_figures_fall_back_to_their_defaults_and_bad_rows_are_skipped():
    metrics = TrainerMetrics.from_json({
        "version": "7", "opt_steps": True, "notice": "n" * (MAX_CHARS + 1), "flow": {"pacing": "<img>", "trained": -0.5},
        "bucket_refused": {"ok": 1, "neg": -1, "f": 1.5}, "hub": {"tier": "gold"},
        "rows": [{"kind": "delta"}, {"kind": "patch", "version": 1}, 5, {"kind": "delta", "version": 2, "nbytes": "x"},
                 {"kind": "train", "loss": float("inf")}],
    })  # fmt: skip
    assert (metrics.version, metrics.opt_steps, metrics.notice, metrics.hub) == (None, None, "", None)
    assert metrics.flow == FlowFigures() and metrics.bucket_refused == {"ok": 1}
    assert metrics.rows == [PublishRow(kind="delta", version=2), TrainRow(kind="train")]


def test_lists_keep_their_newest_items_and_oversized_maps_are_dropped():
    status = ReplicaStatus.from_json({
        "replica_id": "r0", "recent_syncs": [{"step": s, "kind": "delta"} for s in range(500)],
        "hub": {"tier": "free", "by_kind": {f"k{i}": 1 for i in range(65)}},
    })  # fmt: skip
    assert [s.step for s in status.recent_syncs] == list(range(300, 500))  # the newest 200
    assert status.hub is not None and status.hub.by_kind == {}


def test_a_refusal_total_is_shown_only_when_it_adds_up():
    refusals = Refusals()
    refusals.add("rollouts/1/r.json", "bad")
    counts = RefusalCounts.of(refusals)
    assert counts == RefusalCounts(total=1, by_kind={"rollouts": 1}, last=refusals.last) and counts.consistent
    assert not dataclasses.replace(counts, total=5).consistent


def test_a_train_row_copies_every_figure_from_the_trl_log_it_names():
    logged = {f.name: f.metadata["log"] for f in dataclasses.fields(TrainRow) if "log" in f.metadata}
    logs = {name: float(i) for i, name in enumerate(logged.values())}
    row = TrainRow.from_logs({**logs, "kl": "not a number"}, opt_step=4, version=2)
    assert row.opt_step == 4 and row.version == 2 and row.kl is None
    assert all(getattr(row, field) == logs[name] for field, name in logged.items() if field != "kl")


def test_every_training_chart_draws_a_figure_of_the_train_rows():
    rows = [dataclasses.replace(TrainRow.from_logs({}, opt_step=s), **dict.fromkeys(frames.TRAIN_FIGURES, 0.5)) for s in (1, 2)]
    frame = frames.train_frame(read_snapshot_of(TrainerMetrics(rows=rows)))
    for chart in frames.TRAINING_CHARTS:
        assert chart.x == "opt_step" and chart.y in frames.TRAIN_FIGURES
        spec = chart.spec(frame)
        assert [r[chart.y] for r in spec["data"]["values"]] == [0.5, 0.5], chart.title


def test_a_new_plot_of_a_trl_figure_is_one_train_row_field():
    from rlsync.spaces.metrics import _log

    @dataclasses.dataclass(frozen=True)
    class WithGradNorm(TrainRow):
        grad_norm: float | None = _log("grad_norm", chart="Gradient norm per optimizer step", format=".3g")

    assert WithGradNorm.from_logs({"grad_norm": 1.5}, opt_step=1).grad_norm == 1.5  # the trainer copies it
    charts = frames.training_charts(WithGradNorm)
    assert charts[: len(frames.TRAINING_CHARTS)] == frames.TRAINING_CHARTS
    assert (charts[-1].title, charts[-1].y, dict(charts[-1].formats)) == ("Gradient norm per optimizer step", "grad_norm", {"grad_norm": ".3g"})


def read_snapshot_of(trainer: TrainerMetrics):
    from rlsync.spaces.snapshots import Snapshot

    return Snapshot(trainer=TrainerMetrics.from_json(json.loads(json.dumps(trainer.to_json()))))


def test_the_env_writes_its_metrics_as_the_typed_object(bucket):
    Publisher(bucket, policy=FixedInterval(2)).publish(0, master_state())
    env = EnvSimulator(EnvConfig(vocab_size=100), bucket)
    env.step()
    doc = json.loads(bucket.get(metrics_key("env")))
    assert doc["format_version"] == EnvMetrics.FORMAT_VERSION
    metrics = read_snapshot(bucket).env
    assert metrics.env == env.environment.name and metrics.pacing is Pacing.QUEUE and metrics.tasks_per_s is not None


def test_the_scores_format_is_versioned_too(bucket):
    from rlsync.scores import SAMPLES_FORMAT_VERSION, Sample, parse_samples, read_samples, write_samples

    sample = Sample("t", "p", "c", [1], [2], [-1.0], 0, reward=1.0)
    write_samples(bucket, score_key(0, "r"), [sample], batch=0)
    doc = json.loads(bucket.get(score_key(0, "r")))
    assert doc["format_version"] == SAMPLES_FORMAT_VERSION and read_samples(bucket, score_key(0, "r"))[1] == [sample]
    refusals = Refusals()
    bucket.put(score_key(1, "r"), json.dumps({**doc, "format_version": 2}).encode())
    assert read_samples(bucket, score_key(1, "r"), refusals=refusals) is None and refusals.total == 1
    assert parse_samples({k: v for k, v in doc.items() if k != "format_version"})[1] == [sample]  # written before it existed
