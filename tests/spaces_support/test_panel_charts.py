"""The panels' plots (issue 31): Vega-Lite charts the browser draws without a warning, and what they show.

- every plot of the combined panel is a :class:`~rlsync.spaces.charts.Chart` in a ``gr.Plot``
  (Gradio's native plots log 24-28 Vega-Lite warnings per page load and start bar charts above zero);
- a chart's spec: the runtime's Vega-Lite major version, a bar chart's y axis from zero, a log axis
  with the anchors labelled, every series in the legend from the start;
- each replica's pause for every version it applied (its status object's ``recent_syncs``, not what a
  refresh happened to see), the time from a publish to the last replica applying it, a replica's
  catch-up, and rounded figures in the tables.

The browser side (no console warning on any tab) is ``tests/e2e/test_browser.py``.
"""

from __future__ import annotations

import json

import gradio as gr
import pandas as pd
import pytest

import app
from rlsync.spaces import frames
from rlsync.spaces.plots import CHANGED_CHART, REWARD_CHART, SIZE_CHART, STALENESS_CHART, plot_data
from rlsync.spaces.metrics import EnvMetrics, ReplicaStatus, TrainerMetrics
from rlsync.spaces.snapshots import BucketView, Snapshot


def test_every_plot_of_the_combined_panel_is_a_vega_lite_chart(tmp_path):
    demo = app.build_app(app.Stack(str(tmp_path / "bucket"), replicas=1))
    blocks = list(demo.blocks.values())
    native = [b for b in blocks if isinstance(b, (gr.LinePlot, gr.ScatterPlot, gr.BarPlot))]
    plots = [b.elem_id for b in blocks if isinstance(b, gr.Plot)]
    assert not native, f"Gradio's native plots warn in the browser console: {[b.elem_id for b in native]}"
    for elem_id in ("overview-plot-size", "overview-plot-staleness", "overview-plot-fleet-lag", "trainer-plot-apply",
                    "trainer-plot-fleet-lag", "rollout-plot-apply", "env-plot-reward"):  # fmt: skip
        assert elem_id in plots


def test_spec_is_for_the_bundled_vega_lite_5_and_a_bar_chart_starts_at_zero():
    spec = STALENESS_CHART.spec(pd.DataFrame({"staleness": [0, 1, 2], "samples": [700, 1200, 1190]}))
    assert spec["$schema"].endswith("/vega-lite/v5.json")
    # One view on a continuous x: a layered chart, or a discrete x, laid out while its tab is hidden warns "fit-x".
    assert "layer" not in spec and spec["mark"]["type"] == "bar"
    assert spec["encoding"]["x"]["type"] == "quantitative" and spec["encoding"]["x2"] == {"field": "_to"}
    assert spec["encoding"]["x"]["scale"]["domain"] == [-0.5, 2.5] and spec["encoding"]["y2"] == {"datum": 0}
    assert spec["encoding"]["y"]["scale"] == {"type": "linear", "zero": True}
    assert spec["autosize"] == {"type": "fit", "contains": "padding"}
    assert [r["samples"] for r in spec["data"]["values"]] == [700, 1200, 1190]


def test_published_size_is_on_a_log_axis_with_the_anchors_labelled():
    frame = pd.DataFrame({"version": [0, 1, 2, 3], "KB": [833.0, 41.0, 0.0, 833.0], "kind": ["anchor", "delta", "delta", "anchor"]})
    spec = SIZE_CHART.spec(frame)
    points, labels = spec["layer"]
    assert points["encoding"]["y"]["scale"]["type"] == "log"
    assert [r["version"] for r in spec["data"]["values"]] == [0, 1, 3]  # a log axis cannot draw 0 KB
    assert labels["mark"]["type"] == "text" and labels["encoding"]["text"]["field"] == "version"
    assert labels["transform"] == [{"filter": {"field": "kind", "equal": "anchor"}}]
    assert points["encoding"]["color"]["scale"] == {"domain": ["anchor", "delta"], "range": ["#d62728", "#1f77b4"]}


def test_every_series_keeps_its_colour_and_missing_values_are_null():
    frame = pd.DataFrame({"version": [1, 2], "mean_reward": [0.25, float("nan")], "source": ["trainer", "trainer"]})
    spec = REWARD_CHART.spec(frame)
    assert spec["encoding"]["color"]["scale"]["domain"] == ["env", "trainer"]  # env before it appears
    assert spec["data"]["values"] == [{"version": 1, "mean_reward": 0.25, "source": "trainer"}]
    json.loads(REWARD_CHART.to_json(frame))  # strict JSON: no NaN


def test_plot_value_is_embedded_by_the_frontend_as_given():
    value = plot_data(CHANGED_CHART, pd.DataFrame({"version": [1], "changed_pct": [9.5]}))
    assert value.type == "altair" and value.chart == "vega-lite"  # the frontend fits it to the panel's width
    assert json.loads(value.plot)["encoding"]["y"]["field"] == "changed_pct"


def status(replica: str, syncs: list[tuple[int, str, float, float]], applied: int | None = None, newest: int | None = None):
    return ReplicaStatus.from_json({
        "replica_id": replica, "applied_step": applied, "newest_step": newest,
        "recent_syncs": [{"step": s, "kind": k, "nbytes": 1, "download_s": 0.0, "idle_s": i, "time": t} for s, k, i, t in syncs],
    })  # fmt: skip


def view_of(*statuses: ReplicaStatus) -> BucketView:
    view = BucketView("unused")
    view._remember_syncs(Snapshot(statuses=list(statuses)))
    return view


def test_apply_plot_has_every_version_each_replica_applied():
    a = status("a", [(v, "anchor" if v == 0 else "delta", 0.001 * (v + 1), 100.0 + v) for v in range(50)])
    view = view_of(a, status("b", [(7, "anchor", 0.5, 200.0)]))
    frame = frames.sync_time_frame(view)
    assert sorted(frame[frame["replica"] == "a"]["version"]) == list(range(50))
    assert frame[frame["replica"] == "b"].to_dict("records") == [{"version": 7, "seconds": 0.5, "replica": "b", "kind": "anchor"}]
    view._remember_syncs(Snapshot(statuses=[status("a", [(50, "delta", 0.002, 150.0)])]))  # the history outlives the status's window
    assert len(frames.sync_time_frame(view, replicas=["a"])) == 51


@pytest.mark.parametrize("entry", [
    "x", {"step": "3", "kind": "delta", "idle_s": 0.1, "time": 1.0}, {"step": 3, "kind": "patch", "idle_s": 0.1, "time": 1.0},
    {"step": 3, "kind": "delta", "idle_s": float("inf"), "time": 1.0}, {"step": 3, "kind": "delta", "idle_s": True, "time": 1.0},
])  # fmt: skip
def test_malformed_recent_syncs_are_skipped(entry):
    view = view_of(ReplicaStatus.from_json({"replica_id": "a", "recent_syncs": [entry, {"step": 4, "kind": "delta", "idle_s": 0.1, "time": 2.0}]}))
    assert list(frames.sync_time_frame(view)["version"]) == [4]


def test_publish_to_the_last_replica_applying_it():
    rows = [
        {"kind": "anchor", "version": 0, "time": 100.0}, {"kind": "delta", "version": 1, "time": 110.0},
        {"kind": "delta", "version": 2, "time": 120.0}, {"kind": "train", "version": 2, "time": 121.0},
    ]  # fmt: skip
    snap = Snapshot(trainer=TrainerMetrics.from_json({"rows": rows}))
    view = view_of(
        status("a", [(0, "anchor", 0.1, 101.0), (1, "delta", 0.1, 111.0), (2, "delta", 0.1, 121.0)]),
        status("b", [(0, "anchor", 0.1, 103.0), (2, "delta", 0.1, 125.0)]),  # b skipped 1: it held it once it applied 2
        status("late", [(2, "anchor", 0.1, 200.0)]),  # joined after 0 and 1: not waited for
    )
    frame = frames.fleet_lag_frame(view, snap)
    assert frame.to_dict("records") == [
        {"version": 0, "seconds": 3.0, "kind": "anchor"}, {"version": 1, "seconds": 15.0, "kind": "delta"},
        {"version": 2, "seconds": 80.0, "kind": "delta"},
    ]  # fmt: skip
    ahead = Snapshot(trainer=TrainerMetrics.from_json({"rows": [*rows, {"kind": "delta", "version": 3, "time": 130.0}]}))
    assert 3 not in set(frames.fleet_lag_frame(view, ahead)["version"])  # nobody holds 3 yet


def test_catch_up_while_a_replica_bootstraps():
    assert frames.catch_up(status("a", [])) == "loading"
    assert frames.catch_up(status("a", [(10, "anchor", 0.1, 1.0), (11, "delta", 0.1, 2.0)], applied=11, newest=14)) == "25%, 3 behind"
    assert frames.catch_up(status("a", [(14, "delta", 0.1, 2.0)], applied=14, newest=14)) == "caught up"
    assert frames.catch_up(status("a", [(12, "delta", 0.1, 2.0)], applied=12, newest=14)) == "2 behind"
    table = frames.fleet_frame(Snapshot(statuses=[status("a", [(10, "anchor", 0.1, 1.0)], applied=10, newest=20)]))
    assert table["catch-up"].tolist() == ["0%, 10 behind"]


def test_tables_show_rounded_figures():
    snap = Snapshot(env=EnvMetrics.from_json({"by_type": {"reverse / word": {"mean_reward": 0.46803518282313156, "count": 7}}}))
    assert frames.task_type_frame(snap)["mean reward"].tolist() == ["0.468"]


def test_the_lora_adapter_chain_is_shown_when_the_run_has_one(bucket):
    import torch

    from rlsync.adapters import adapter_bucket
    from rlsync.protocol import Publisher
    from rlsync.spaces.snapshots import read_snapshot

    assert frames.adapter_summary(read_snapshot(bucket)) == ""
    chain = Publisher(adapter_bucket(bucket))
    lora = {"a.lora_A.weight": torch.ones(4, 8, dtype=torch.bfloat16), "a.lora_B.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    chain.publish(0, lora)
    chain.publish(1, {k: v + 1 for k, v in lora.items()})
    snap = read_snapshot(bucket)
    snap.statuses = [ReplicaStatus(replica_id="r0", adapter_step=1)]
    line = frames.adapter_summary(snap)
    assert line.startswith("LoRA adapter chain: version **1**, 1 anchors and 1 deltas retained") and "r0 serves 1" in line


def test_nothing_to_draw_is_an_empty_plot():
    empty = pd.DataFrame({"version": pd.Series([], dtype="int64"), "KB": pd.Series([], dtype="float64"), "kind": pd.Series([], dtype="str")})
    assert plot_data(SIZE_CHART, empty) is None  # an axis without extent warns in the console
    zero = pd.DataFrame({"version": [1], "KB": [0.0], "kind": ["delta"]})
    assert plot_data(SIZE_CHART, zero) is None  # nothing a log axis can draw
