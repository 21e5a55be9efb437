"""The refresh of a panel: a :class:`Live` updates a panel's outputs together, one ``gr.Timer`` tick
(:data:`REFRESH_S`) reading one :class:`~.snapshots.Snapshot` and updating every output.

The builders (:mod:`.plots`, :mod:`.tables`, :mod:`.controls`) create components inside the current
``gr.Blocks`` context and register them here. A builder's ``prefix`` is prepended to its components'
``elem_id`` so that several panels can share a page (the combined app uses ``"trainer-"``, ``"overview-"``, ...).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Self

from .snapshots import BucketSource, BucketView, Snapshot, bucket_view, redact

logger = logging.getLogger(__name__)

#: Seconds between panel refreshes.
REFRESH_S = 1.5


class Live:
    """The refreshed outputs of one panel, updated together by one timer tick.

    Each builder (:mod:`.plots`, :mod:`.tables`, :mod:`.controls`) registers its outputs and a render function here; one
    tick (and one page-load event) then reads one bucket snapshot and updates
    them all, which keeps the number of Gradio events per tick at one per panel.
    Use it as a context manager; the events are registered on exit::

        with live.Live("./runs/bucket") as panel:
            plots.sync_plots(panel)
            tables.fleet_table(panel)

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


def live_for(source: BucketSource | Live) -> tuple[Live, bool]:
    """``(live, own)``: the given :class:`Live`, or a new one the builder attaches itself."""
    return (source, False) if isinstance(source, Live) else (Live(source), True)


def show(source: BucketSource | Live, outputs: Any, render: Callable[[BucketView, Snapshot], Any]) -> None:
    """Refresh ``outputs`` with ``render`` on ``source`` (a :class:`Live`, or a bucket whose new
    :class:`Live` is attached here)."""
    live, own = live_for(source)
    live.add(outputs, render)
    if own:
        live.attach()
