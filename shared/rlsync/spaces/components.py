"""Live Gradio components of the panels: plots, tables, summary lines and controls.

Builders create components inside the current ``gr.Blocks`` context. A :class:`Live`
refreshes a panel's outputs together: one ``gr.Timer`` tick (:data:`REFRESH_S`) reads
one :class:`~.snapshots.Snapshot` and updates every output. A builder's ``prefix`` is
prepended to its components' ``elem_id`` so that several panels can share a page (the
combined app uses ``"trainer-"``, ``"overview-"``, ...).
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import pandas as pd

from ..errors import BucketError
from ..protocol import AnchorPolicy
from .access import CONTROL_EVENT, Login, LoginGate, PanelAccess, control_notice, guarded
from ..protocol.policy import policy_names
from .anchor_policy import current_policy, describe_policy, make_policy, setting_fields, write_policy
from .charts import Chart, Labels, Mark, Scale
from .frames import (
    RATIO_SERIES,
    TRAINING_CHARTS,
    changed_frame,
    delta_ratio_frame,
    delta_size_frame,
    episodes_frame,
    expert_change_frame,
    fleet_lag_frame,
    fleet_frame,
    recent_publishes_frame,
    reward_frame,
    staleness_frame,
    sync_time_frame,
    timing_frame,
    train_frame,
)
from .role_control import RoleRunner
from .settings import server_port
from .snapshots import BucketSource, BucketView, Snapshot, bucket_view, redact

logger = logging.getLogger(__name__)

#: Seconds between panel refreshes.
REFRESH_S = 1.5


class Live:
    """The refreshed outputs of one panel, updated together by one timer tick.

    Each builder below registers its outputs and a render function here; one
    tick (and one page-load event) then reads one bucket snapshot and updates
    them all, which keeps the number of Gradio events per tick at one per panel.
    Use it as a context manager; the events are registered on exit::

        with components.Live("./runs/bucket") as live:
            components.sync_plots(live)
            components.fleet_table(live)

    Args:
        bucket_url: The bucket (or a function returning its current URL).
        timer: The ``gr.Timer`` to refresh on (default: a new one ticking every :data:`REFRESH_S`).
    """

    def __init__(self, bucket_url: BucketSource, timer: Any | None = None) -> None:
        import gradio as gr

        self.source = bucket_url
        self.timer = timer if timer is not None else gr.Timer(REFRESH_S)
        self._outputs: list[Any] = []
        self._renders: list[tuple[int, Callable[[BucketView, Snapshot], Any]]] = []
        self._attached = False

    def add(self, outputs: Any | Sequence[Any], render: Callable[[BucketView, Snapshot], Any]) -> None:
        """Refresh ``outputs`` with ``render(view, snapshot)`` (a tuple for several outputs).

        Raises:
            RuntimeError: the events are already registered.
        """
        if self._attached:
            raise RuntimeError("Live.add after attach()")
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        self._outputs += outputs
        self._renders.append((len(outputs), render))

    def values(self) -> list[Any]:
        """The current values of every output (a failing render leaves its outputs unchanged)."""
        import gradio as gr

        view = bucket_view(self.source)
        snap = view.snapshot()
        out: list[Any] = []
        for n, render in self._renders:
            try:
                got = render(view, snap)
                out += list(got) if n > 1 else [got]
            except Exception:  # one broken figure must not blank the panel
                logger.error("panel refresh failed: %s", redact(traceback.format_exc()))
                out += [gr.skip()] * n
        return out

    def attach(self) -> None:
        """Register the tick and page-load events (once)."""
        import gradio as gr

        if self._attached or not self._outputs:
            return
        self._attached = True
        self.timer.tick(self.values, outputs=self._outputs, show_progress="hidden", queue=True)
        root = gr.context.Context.root_block
        if root is not None:
            root.load(self.values, outputs=self._outputs, show_progress="hidden")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.attach()


def panel_live(default_url: str, fixed: BucketSource | None, timer: Any | None = None) -> tuple[Live, Callable[[str], None]]:
    """A Space panel's :class:`Live`, and the function that tells it the bucket a Start used.

    Args:
        default_url: The bucket read until a Start names one (the settings form's default).
        fixed: The bucket the panel always reads (the combined app's), or ``None`` to follow Start.
        timer: The ``gr.Timer`` to refresh on (default: a new one).

    Returns:
        ``(live, follow)``: ``follow(url)`` makes the panel read ``url`` (when it is not fixed).
    """
    current = {"url": default_url}
    live = Live(fixed if fixed is not None else (lambda: current["url"]), timer)
    return live, lambda url: current.update(url=url)


def _live(source: BucketSource | Live) -> tuple[Live, bool]:
    """``(live, own)``: the given :class:`Live`, or a new one the builder attaches itself."""
    return (source, False) if isinstance(source, Live) else (Live(source), True)


def _show(source: BucketSource | Live, outputs: Any, render: Callable[[BucketView, Snapshot], Any]) -> None:
    """Refresh ``outputs`` with ``render`` on ``source`` (a :class:`Live`, or a bucket whose new
    :class:`Live` is attached here)."""
    live, own = _live(source)
    live.add(outputs, render)
    if own:
        live.attach()


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

    _show(source, plot, render)
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

    live, own = _live(source)
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


def frame_table(source: BucketSource | Live, frame: Callable[[Snapshot], Any], label: str, elem_id: str, **options: Any) -> Any:
    """A read-only table of ``frame(snapshot)``, refreshed from ``source``.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        frame: The table from the bucket's snapshot (e.g. :func:`~rlsync.spaces.frames.episodes_frame`).
        label: Table label.
        elem_id: The table's ``elem_id``.
        **options: More ``gr.Dataframe`` options (``wrap``, ``max_height``).
    """
    import gradio as gr

    table = gr.Dataframe(frame(Snapshot()), label=label, interactive=False, elem_id=elem_id, **options)
    _show(source, table, lambda view, snap: frame(snap))
    return table


def publishes_table(source: BucketSource | Live, prefix: str = "") -> Any:
    """The recent publishes (version, kind, bytes, % changed), newest first.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        prefix: Prepended to the table's ``elem_id`` (``<prefix>recent-publishes``).
    """
    return frame_table(source, recent_publishes_frame, "Recent publishes", f"{prefix}recent-publishes", max_height=420)


def fleet_table(
    source: BucketSource | Live,
    replicas: Callable[[], Iterable[str] | None] | None = None,
    label: str = "Rollout fleet",
    prefix: str = "",
) -> Any:
    """One row per replica status object in the bucket.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids to show (``None``: all).
        label: Table label.
        prefix: Prepended to the table's ``elem_id`` (``<prefix>fleet-table``).
    """
    import gradio as gr

    table = gr.Dataframe(fleet_frame(Snapshot()), label=label, interactive=False, elem_id=f"{prefix}fleet-table")
    _show(source, table, lambda view, snap: fleet_frame(snap, replicas() if replicas else None))
    return table


def summary_line(source: BucketSource | Live, render: Callable[[Snapshot], str], elem_id: str | None = None) -> Any:
    """A Markdown line computed from the bucket's snapshot (e.g. :func:`trainer_summary`);
    bucket read errors are appended to it."""
    import gradio as gr

    line = gr.Markdown(render(Snapshot()), elem_id=elem_id)
    _show(source, line, lambda view, snap: render(snap) + (f"  \n:warning: {snap.error}" if snap.error else ""))
    return line


def episodes_table(source: BucketSource | Live, prefix: str = "") -> Any:
    """The environment's recent scored episodes (version, prompt, completion, reward)."""
    return frame_table(source, episodes_frame, "Recent episodes", f"{prefix}episodes", wrap=True, max_height=420)


def anchor_policy_controls(
    source: BucketSource | Live, default: AnchorPolicy | None = None, prefix: str = ""
) -> dict[str, Any]:
    """Controls of the anchor policy, built from the policy registry: the policy's name, one number
    per setting of any registered policy (:func:`~rlsync.spaces.anchor_policy.setting_fields`), Apply.

    Apply writes the bucket's control object (:func:`~rlsync.protocol.policy_to_json`);
    the trainer, wherever it runs, uses it from its next publish. The inputs are
    filled from the control object when the page loads (not on every refresh,
    which would overwrite what the user is typing); the line above them shows
    the policy in force and refreshes.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        default: The policy to show while the bucket has no control object.
        prefix: Prepended to the components' ``elem_id`` (``<prefix>anchor-policy``,
            ``<prefix>anchor-<setting>``, ...).

    Returns:
        ``{"current", "policy", "apply", "result", "settings"}`` components; ``settings`` maps each
        setting's name to its input.
    """
    import gradio as gr

    live, own = _live(source)
    info = current_policy(Snapshot(), default)
    fields = setting_fields()
    current = gr.Markdown(describe_policy(info), elem_id=f"{prefix}anchor-policy-current")
    with gr.Row():
        policy = gr.Radio(policy_names(), value=info["policy"], label="Anchor policy", elem_id=f"{prefix}anchor-policy")
        inputs = {
            f.name: gr.Number(
                info[f.name], precision=0 if f.type in (int, "int") else None, minimum=f.metadata.get("minimum"),
                step=f.metadata.get("step", 1), label=f.metadata.get("label", f.name),
                elem_id=f"{prefix}anchor-{f.name.replace('_', '-')}",
            )  # fmt: skip
            for f in fields
        }
        apply = gr.Button("Apply", variant="primary", elem_id=f"{prefix}anchor-apply")
    result = gr.Markdown("", elem_id=f"{prefix}anchor-result")

    def on_apply(kind: str, *values: float | None) -> str:
        try:
            new = make_policy(kind, dict(zip(inputs, values)))
            write_policy(bucket_view(live.source).open(create=True), new)
        except (ValueError, BucketError) as exc:
            logger.warning("anchor policy not applied: %s", redact(str(exc)))
            return redact(f":x: not applied: {exc}")
        return f"Applied `{json.dumps(new.settings())}`: takes effect at the next publish."

    def on_load() -> tuple[Any, ...]:
        got = current_policy(bucket_view(live.source).snapshot(), default)
        return (got["policy"], *(got[name] for name in inputs))

    apply.click(
        guarded(on_apply, lambda why: f":no_entry: not applied: {why}"), inputs=[policy, *inputs.values()],
        outputs=result, api_name=f"{prefix}apply_anchor_policy".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    live.add(current, lambda view, snap: describe_policy(current_policy(snap, default)))
    root = gr.context.Context.root_block
    if root is not None:
        root.load(on_load, outputs=[policy, *inputs.values()], show_progress="hidden")
    if own:
        live.attach()
    return {
        "current": current,
        "policy": policy,
        "settings": inputs,
        "apply": apply,
        "result": result,
    }


def role_controls(
    runner: RoleRunner,
    make_config: Callable[..., Any],
    inputs: Sequence[Any],
    live: Live,
    on_started: Callable[[Any], None] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Start / Stop buttons, the role's status line (refreshed) and the last action's result (a refusal or an
    invalid setting stays shown until the next Start or Stop, which the refresh does not overwrite).

    Args:
        runner: The role this panel hosts.
        make_config: ``make_config(*form values) -> config`` (may raise ``ValueError``).
        inputs: The form components passed to ``make_config``.
        live: Refreshes the status line.
        on_started: Called with the config when Start is pressed (e.g. to follow its bucket).
        prefix: Prepended to the components' ``elem_id`` (``<prefix>start-<name>``, ...).

    Returns:
        ``{"start", "stop", "status", "result"}`` components.
    """
    import gradio as gr

    name = runner.name
    with gr.Row():
        start = gr.Button(f"Start {name}", variant="primary", elem_id=f"{prefix}start-{name}")
        stop = gr.Button(f"Stop {name}", variant="stop", elem_id=f"{prefix}stop-{name}")
    status = gr.Markdown(runner.status(), elem_id=f"{prefix}status-{name}")
    result = gr.Markdown("", elem_id=f"{prefix}result-{name}")

    def on_start(*values: Any) -> str:
        try:
            config = make_config(*values)
        except (ValueError, TypeError) as exc:
            return f"**{name}**: invalid settings: {redact(str(exc))}"
        if on_started is not None:
            on_started(config)
        return runner.start(config)

    start.click(
        guarded(on_start, lambda why: f":no_entry: **{name}**: not started: {why}"), inputs=list(inputs),
        outputs=result, api_name=f"{prefix}start_{name}".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    stop.click(
        guarded(lambda: runner.stop(wait=False), lambda why: f":no_entry: **{name}**: not stopped: {why}"),
        outputs=result, api_name=f"{prefix}stop_{name}".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    live.add(status, lambda view, snap: runner.status())
    return {"start": start, "stop": stop, "status": status, "result": result}


def login_button() -> Any | None:
    """A Hugging Face login button when the Space has OAuth enabled (see :mod:`.access`), else nothing."""
    import gradio as gr

    return gr.LoginButton() if PanelAccess.from_env().oauth else None


def space_page(title: str, description: str, build: Callable[[], Any]) -> Any:
    """A Space's page as a ``gr.Blocks`` (not launched): its heading, the login button, whether the controls are on
    for this visitor (:func:`~.access.control_notice`, in the page as served and again at each page load), then what
    ``build`` adds.

    Args:
        title: The role, e.g. ``"trainer"`` (the page is titled ``RL Sync: <title>``).
        description: One line under the heading.
        build: Adds the panel's components (called inside the ``gr.Blocks``).
    """
    import gradio as gr

    with gr.Blocks(title=f"RL Sync: {title}") as demo:
        gr.Markdown(f"# RL Sync: {title}\n{description}")
        login_button()
        notice = gr.Markdown(PanelAccess.from_env().notice(), elem_id="controls-notice")

        def on_load(request):  # annotated below with the real class: Gradio injects the request by type
            return control_notice(request)

        on_load.__annotations__ = {"request": gr.Request}
        demo.load(on_load, outputs=notice, show_progress="hidden", api_visibility="private")
        build()
    return demo


def serve(build_app: Callable[[], Any]) -> None:
    """Launch a Space's page (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``: :func:`launch_options`), logging at INFO."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    build_app().launch(**launch_options())


def launch_options(host: str | None = None) -> dict[str, Any]:
    """``launch()`` keyword arguments from the environment (see :mod:`.access`).

    The host is ``host``, else ``GRADIO_SERVER_NAME``, else ``127.0.0.1`` (``0.0.0.0`` on a Space);
    the port ``PORT`` / ``GRADIO_SERVER_PORT`` (default 7860). ``PANEL_AUTH="user:password"``, wherever
    it is set, makes the panel ask for that login. A panel reachable by others without a login keeps
    its read-only views and refuses its controls; the launch log says so. With a login, every route
    but the login page and its static files refuses an anonymous call with 401 (:class:`LoginGate`),
    before Gradio validates the request. Gradio's run history is
    off (its routes would answer anonymous callers with the operator's token).

    Raises:
        ValueError: ``PANEL_AUTH`` is not ``user:password``.
    """
    access = PanelAccess.from_env(host)
    options: dict[str, Any] = {
        "server_name": access.host,
        "server_port": server_port(),
        # Gradio's run history mounts /gradio_api/run-history/* outside the login, acting with the
        # operator's HF_TOKEN (creating and listing Hub buckets): a panel has no use for it.
        "run_history": False,
    }
    if access.auth is not None:
        from starlette.middleware import Middleware

        options["auth"] = access.auth
        # Gradio checks the login inside each route, after validating the request: the gate refuses first.
        options["app_kwargs"] = {"middleware": [Middleware(LoginGate)]}
    logger.log(logging.WARNING if access.exposed and access.login is Login.NONE else logging.INFO, "%s", access.describe())
    return options
