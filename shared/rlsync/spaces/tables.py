"""The panels' tables and summary lines, refreshed by a :class:`~.live.Live`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .frames import episodes_frame, fleet_frame, recent_publishes_frame
from .live import Live, show
from .snapshots import BucketSource, Snapshot

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
    show(source, table, lambda view, snap: frame(snap))
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
    show(source, table, lambda view, snap: fleet_frame(snap, replicas() if replicas else None))
    return table


def summary_line(source: BucketSource | Live, render: Callable[[Snapshot], str], elem_id: str | None = None) -> Any:
    """A Markdown line computed from the bucket's snapshot (e.g. :func:`trainer_summary`);
    bucket read errors are appended to it."""
    import gradio as gr

    line = gr.Markdown(render(Snapshot()), elem_id=elem_id)
    show(source, line, lambda view, snap: render(snap) + (f"  \n:warning: {snap.error}" if snap.error else ""))
    return line


def episodes_table(source: BucketSource | Live, prefix: str = "") -> Any:
    """The environment's recent scored episodes (version, prompt, completion, reward)."""
    return frame_table(source, episodes_frame, "Recent episodes", f"{prefix}episodes", wrap=True, max_height=420)
