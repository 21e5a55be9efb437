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


def build_replicas(config: ReplicaConfig) -> list[Replica]:
    """``config.replicas`` replicas of ``config``; with several, their ids get ``-0``, ``-1``, ... suffixes."""
    if config.replicas == 1:
        return [Replica(config)]
    base = config.replica_id or default_replica_id()
    return [
        Replica(dataclasses.replace(config, replica_id=f"{base}-{i}", seed=config.seed + i, replicas=1))
        for i in range(config.replicas)
    ]


def hosted_ids(runner: role_control.RoleRunner) -> list[str]:
    """Ids of the replicas ``runner`` hosts (empty before Start)."""
    return [obj.replica_id for obj in runner.objects if isinstance(obj, Replica)]


def build_panel(runner: role_control.RoleRunner, config: ReplicaConfig, place: PanelPlace = PanelPlace()) -> dict[str, Any]:
    """Create the rollout panel's components in the current ``gr.Blocks`` context (:class:`RolePanel`, then this
    Space's replicas and the fleet).

    Args:
        runner: The replicas this panel starts and stops (from :func:`make_runner`).
        config: Defaults of the settings form (``replicas``: how many a Start runs in this process).
        place: Where the panel stands.

    Returns:
        The main components by name.
    """
    panel, prefix = RolePanel(runner, config, place), place.prefix
    live = panel.live
    with gr.Accordion("Replica settings", open=False):
        form = panel.form(overrides={
            "engine": lambda **kw: gr.Dropdown(["auto", *names(Kind.ENGINE)], **kw),
            "chain": lambda **kw: gr.Dropdown([c.value for c in Chain], **kw),
        })  # fmt: skip

    def make_config(*values: Any) -> ReplicaConfig:
        return forms.config_from_form(config, list(form), values)

    with live:
        controls = panel.controls(make_config, list(form.values()))
        gr.Markdown("### This Space's replicas")
        mine = fleet_table(
            live, replicas=lambda: hosted_ids(runner), label="Replicas hosted here", prefix=f"{prefix}own-"
        )
        apply = apply_plot(live, replicas=lambda: hosted_ids(runner), prefix=prefix)
        gr.Markdown("### Fleet")
        fleet = fleet_table(live, prefix=prefix)
        summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
    return {**controls, "form": form, "own": mine, "apply": apply, "fleet": fleet, "live": live}


#: The rollout Space's page: a Start (and a resume at boot) runs ``ReplicaConfig.replicas`` replicas.
SPACE = RoleSpace(
    Role.ROLLOUT, "rollout", "Replicas following the trainer's weights bit-exactly and answering task batches.",
    ReplicaConfig.from_env, build_replicas, build_panel,
)  # fmt: skip
make_runner, build_app, main = SPACE.make_runner, SPACE.build_app, SPACE.main


if __name__ == "__main__":
    main()
