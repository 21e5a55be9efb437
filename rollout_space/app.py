"""Gradio panel of a rollout Space: ``python -m rollout_space.app`` (on the Space: ``python app.py`` at its root).

The settings form is prefilled from ``ReplicaConfig.from_env()`` (``ROLLOUT_<FIELD>``
variables); Start builds the replica(s) with the form's values and runs them in
background threads, Stop stops them. The page then shows, read from the
bucket's ``status/`` objects: this Space's replicas (version, newest version,
lag, apply time, inference idle per sync, tokens/s), their apply time per
version, and the whole fleet.

Access and server: as every panel's (:mod:`rlsync.spaces.access`); ``PORT`` (default 7860).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import gradio as gr
from rlsync.fp8 import Chain
from rlsync.spaces import forms, frames, role_control
from rlsync.spaces.plots import apply_plot
from rlsync.spaces.tables import fleet_table, summary_line
from rlsync.registry import Kind, names
from rlsync.roles import Role
from rlsync.spaces.role_panel import PanelPlace, RolePanel, RoleSpace

from rollout_space.replica import Replica, ReplicaConfig, default_replica_id

logger = logging.getLogger(__name__)


def build_replicas(config: ReplicaConfig, count: int = 1) -> list[Replica]:
    """``count`` replicas of ``config``; with several, their ids get ``-0``, ``-1``, ... suffixes.

    Raises:
        ValueError: ``count`` is below 1.
    """
    if count < 1:
        raise ValueError(f"need at least one replica, got {count}")
    if count == 1:
        return [Replica(config)]
    base = config.replica_id or default_replica_id()
    return [Replica(dataclasses.replace(config, replica_id=f"{base}-{i}", seed=config.seed + i)) for i in range(count)]


def hosted_ids(runner: role_control.RoleRunner) -> list[str]:
    """Ids of the replicas ``runner`` hosts (empty before Start)."""
    return [obj.replica_id for obj in runner.objects if isinstance(obj, Replica)]


def build_panel(
    runner: role_control.RoleRunner, config: ReplicaConfig, count: int = 1, place: PanelPlace = PanelPlace()
) -> dict[str, Any]:
    """Create the rollout panel's components in the current ``gr.Blocks`` context (:class:`RolePanel` with a
    replica count, then this Space's replicas and the fleet).

    Args:
        runner: The replicas this panel starts and stops (from :func:`make_runner`).
        config: Defaults of the settings form.
        count: Default number of replicas started in this process.
        place: Where the panel stands.

    Returns:
        The main components by name.
    """
    panel, prefix = RolePanel(runner, config, place), place.prefix
    live = panel.live
    with gr.Accordion("Replica settings", open=False):
        replicas = gr.Number(
            count, precision=0, minimum=1, label="replicas in this process", elem_id=f"{prefix}cfg-replicas"
        )
        form = panel.form(overrides={
            "engine": lambda **kw: gr.Dropdown(["auto", *names(Kind.ENGINE)], **kw),
            "chain": lambda **kw: gr.Dropdown([c.value for c in Chain], **kw),
        })  # fmt: skip

    def make_config(n: float | None, *values: Any) -> tuple[ReplicaConfig, int]:
        if n is None or n < 1 or float(n) != int(n):
            raise ValueError(f"replicas must be a whole number >= 1, got {n!r}")
        return forms.config_from_form(config, list(form), values), int(n)

    with live:
        controls = panel.controls(make_config, [replicas, *form.values()], bucket_of=lambda c: c[0].bucket)
        gr.Markdown("### This Space's replicas")
        mine = fleet_table(
            live, replicas=lambda: hosted_ids(runner), label="Replicas hosted here", prefix=f"{prefix}own-"
        )
        apply = apply_plot(live, replicas=lambda: hosted_ids(runner), prefix=prefix)
        gr.Markdown("### Fleet")
        fleet = fleet_table(live, prefix=prefix)
        summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
    return {**controls, "form": form, "replicas": replicas, "own": mine, "apply": apply, "fleet": fleet, "live": live}


#: The rollout Space's page: a Start runs ``count`` replicas (the runner starts with ``(ReplicaConfig, count)``;
#: ``build_app(count=...)`` sets the form's default count); a resume at boot, one.
SPACE = RoleSpace(
    Role.ROLLOUT, "rollout", "Replicas following the trainer's weights bit-exactly and answering task batches.",
    ReplicaConfig.from_env, lambda spec: build_replicas(*spec), build_panel,
    config_of=lambda spec: spec[0], start_with=lambda config: (config, 1),
)  # fmt: skip
make_runner, build_app, main = SPACE.make_runner, SPACE.build_app, SPACE.main


if __name__ == "__main__":
    main()
