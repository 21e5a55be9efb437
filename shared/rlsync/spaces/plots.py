"""The panels' plots: each figure's :class:`~.charts.Chart` and the builder of its ``gr.Plot``, refreshed by a
:class:`~.live.Live` from the frames of :mod:`.frames`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from .charts import Chart, Labels, Mark, Scale
from .frames import (
    RATIO_SERIES,
    TRAINING_CHARTS,
    changed_frame,
    delta_ratio_frame,
    delta_size_frame,
    expert_change_frame,
    fleet_lag_frame,
    reward_frame,
    staleness_frame,
    sync_time_frame,
    timing_frame,
    train_frame,
)
from .live import Live, live_for, show
from .snapshots import BucketSource, BucketView, Snapshot

#: Colours of the series of each plot (fixed, so that a series keeps its colour whichever appears first).
KIND_COLORS = {"anchor": "#d62728", "delta": "#1f77b4"}
SOURCE_COLORS = {"env": "#1f77b4", "trainer": "#ff7f0e"}
RATIO_COLORS = dict(zip(RATIO_SERIES, ("#1f77b4", "#ff7f0e")))
STAGE_COLORS = {"encode": "#1f77b4", "hash": "#2ca02c", "upload": "#9467bd"}

REWARD_CHART = Chart(
    "Mean reward per policy version", x="version", y="mean_reward", color="source", series=SOURCE_COLORS,
    y_title="mean reward", y_domain=(0, 1), formats={"mean_reward": ".3f"}, height=280,
)
SIZE_CHART = Chart(
    "Published size per version (log scale)", x="version", y="KB", mark=Mark.POINT, color="kind", series=KIND_COLORS,
    y_scale=Scale.LOG, labels=Labels(text="version", where="kind", equals="anchor"), formats={"KB": ",.1f"},
    subtitle="anchors (red, labelled with their version) and deltas (blue)",
)
RATIO_CHART = Chart(
    "Delta size: % of the anchor and % of TRL's layout", x="version", y="percent", color="against",
    series=RATIO_COLORS, y_title="% of", formats={"percent": ".2f"},
)
CHANGED_CHART = Chart(
    "Parameters changed per delta", x="version", y="changed_pct", y_title="% changed", formats={"changed_pct": ".2f"},
)
TIMING_CHART = Chart(
    "Publish: encode / hash / upload", x="version", y="seconds", color="stage", series=STAGE_COLORS,
    formats={"seconds": ".3f"},
)
APPLY_CHART = Chart(
    "Replica pause to apply each version", x="version", y="seconds", mark=Mark.POINT, color="replica",
    tooltip=("kind",), formats={"seconds": ".4f"}, y_title="inference idle (s)",
    subtitle="every version each replica applied (its last 50 syncs, from status objects)",
)
FLEET_LAG_CHART = Chart(
    "Publish to the last replica applying it", x="version", y="seconds", mark=Mark.POINT, color="kind",
    series=KIND_COLORS, formats={"seconds": ".2f"}, y_title="seconds",
    subtitle="from the trainer's publish until every replica holds this version or a newer one",
)
EXPERT_CHART = Chart(
    "MoE: % of each expert changed per delta (layer.expert)", x="version", y="changed_pct", color="expert",
    y_title="% changed", formats={"changed_pct": ".2f"}, height=260,
)
STALENESS_CHART = Chart(
    "Staleness of trained samples (versions behind)", x="staleness", y="samples", mark=Mark.BAR,
    series={"samples": "#ff7f0e"},
)


def chart_plot(
    source: BucketSource | Live,
    chart: Chart,
    frame: Callable[[BucketView, Snapshot], pd.DataFrame],
    elem_id: str,
    hide_empty: bool = False,
) -> Any:
    """A ``gr.Plot`` of ``chart`` drawing ``frame(view, snapshot)`` at every refresh.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        chart: What to draw (:mod:`.charts`).
        frame: The plot's data from the bucket's view and snapshot (:mod:`.frames`).
        elem_id: The plot's ``elem_id``.
        hide_empty: Leave the plot out of the page while it has nothing to draw (a chart that stays empty for
            some runs, as the MoE chart of a dense model), instead of an empty box.
    """
    import gradio as gr

    plot = gr.Plot(None, show_label=False, elem_id=elem_id, visible=not hide_empty)

    def render(view: BucketView, snap: Snapshot) -> Any:
        data = plot_data(chart, frame(view, snap))
        return gr.update(value=data, visible=data is not None) if hide_empty else data

    show(source, plot, render)
    return plot


def plot_data(chart: Chart, frame: pd.DataFrame) -> Any:
    """What a ``gr.Plot`` shows for ``chart`` and ``frame``: the spec, embedded by Gradio's Vega-Lite frontend
    (``chart`` set, so the frontend fits it to the panel's width and theme); ``None`` (an empty plot) while
    there is nothing to draw, as an empty chart's axes have no extent (a console warning)."""
    from gradio.components.plot import AltairPlotData

    if not len(chart.rows(frame)):
        return None
    return AltairPlotData.model_construct(type="altair", chart="vega-lite", plot=chart.to_json(frame))


def reward_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Mean reward per policy version (env scores and trainer batches)."""
    return chart_plot(source, REWARD_CHART, lambda view, snap: reward_frame(snap), f"{prefix}plot-reward")


def size_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Published size per version on a log axis, anchors labelled."""
    return chart_plot(source, SIZE_CHART, lambda view, snap: delta_size_frame(snap), f"{prefix}plot-size")


def ratio_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Each delta's size against the anchor and against TRL's plain layout of the same changes (%)."""
    return chart_plot(source, RATIO_CHART, lambda view, snap: delta_ratio_frame(snap), f"{prefix}plot-ratio")


def staleness_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Histogram of the trained samples' staleness (versions behind the trainer when it took them)."""
    return chart_plot(source, STALENESS_CHART, lambda view, snap: staleness_frame(snap), f"{prefix}plot-staleness")


def apply_plot(
    source: BucketSource | Live, replicas: Callable[[], Iterable[str] | None] | None = None, prefix: str = ""
) -> Any:
    """Each replica's inference pause for every version it applied (its status object's recent syncs).

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids to plot (``None``: all).
        prefix: Prepended to the plot's ``elem_id``.
    """
    return chart_plot(
        source, APPLY_CHART, lambda view, snap: sync_time_frame(view, replicas() if replicas else None),
        f"{prefix}plot-apply",
    )  # fmt: skip


def fleet_lag_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Seconds from each publish until every replica held that version (or a newer one)."""
    return chart_plot(source, FLEET_LAG_CHART, lambda view, snap: fleet_lag_frame(view, snap), f"{prefix}plot-fleet-lag")


def sync_plots(
    source: BucketSource | Live, replicas: Callable[[], Iterable[str] | None] | None = None, prefix: str = ""
) -> dict[str, Any]:
    """Plots of the weight sync: size per version (anchors labelled), % changed, publish
    stage times, each replica's pause per applied version and the fleet's publish-to-applied time.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids whose apply times are plotted (``None``: all).
        prefix: Prepended to the plots' ``elem_id``.

    Returns:
        ``{"size", "changed", "timing", "apply", "fleet_lag"}`` components.
    """
    import gradio as gr

    live, own = live_for(source)
    with gr.Row():
        size = size_plot(live, prefix=prefix)
        changed = chart_plot(live, CHANGED_CHART, lambda view, snap: changed_frame(snap), f"{prefix}plot-changed")
    with gr.Row():
        timing = chart_plot(live, TIMING_CHART, lambda view, snap: timing_frame(snap), f"{prefix}plot-timing")
        apply = apply_plot(live, replicas, prefix=prefix)
    fleet_lag = fleet_lag_plot(live, prefix=prefix)
    if own:
        live.attach()
    return {"size": size, "changed": changed, "timing": timing, "apply": apply, "fleet_lag": fleet_lag}


def training_plots(source: BucketSource | Live, prefix: str = "") -> list[Any]:
    """The plots of :data:`TRAINING_CHARTS`, two to a row (``elem_id``: ``<prefix>plot-train-<figure>``)."""
    import gradio as gr

    plots = []
    for start in range(0, len(TRAINING_CHARTS), 2):
        with gr.Row():
            for chart in TRAINING_CHARTS[start : start + 2]:
                elem_id = f"{prefix}plot-train-{chart.y}"
                plots.append(chart_plot(source, chart, lambda view, snap: train_frame(snap), elem_id))
    return plots


def expert_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """A MoE run's changed percentage of each expert per delta (docs/moe.md); not drawn for a dense model."""
    return chart_plot(
        source, EXPERT_CHART, lambda view, snap: expert_change_frame(snap), f"{prefix}plot-experts", hide_empty=True
    )
