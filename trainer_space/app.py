"""Gradio panel of the trainer Space: ``python -m trainer_space.app`` (on the Space: ``python app.py`` at its root).

The settings form is prefilled from ``TrainerConfig.from_env()`` (``TRAINER_<FIELD>``
variables); Start builds a :class:`~trainer_space.trainer.Trainer` with the form's
values and runs it in background threads, Stop stops it. Everything else on the
page is read from the bucket, so the plots and the fleet table show the whole
run wherever its parts execute: published size per version (anchors marked),
% of parameters changed, encode / hash / upload times, mean reward per policy
version, the recent publishes, the rollout fleet, and the anchor policy
controls, which write the bucket's control object (the trainer follows it from
its next publish).

Access and server: as every panel's (:mod:`rlsync.spaces.access`); ``PORT`` (default 7860).
"""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from rlsync.protocol.policy import policy_names
from rlsync.spaces import forms, frames, role_control
from rlsync.spaces.controls import anchor_policy_controls
from rlsync.spaces.plots import expert_plot, reward_plot, sync_plots, training_plots
from rlsync.spaces.tables import fleet_table, publishes_table, summary_line
from rlsync.roles import Role
from rlsync.spaces.role_panel import PanelPlace, RolePanel, RoleSpace
from rlsync.spaces.trackio_link import trackio_url
from trainer_space.config import ReportTo
from trainer_space.trainer import Trainer, TrainerConfig

logger = logging.getLogger(__name__)


def build_panel(
    runner: role_control.RoleRunner, config: TrainerConfig, place: PanelPlace = PanelPlace()
) -> dict[str, Any]:
    """Create the trainer panel's components in the current ``gr.Blocks`` context (:class:`RolePanel`, then the
    anchor policy controls and the trainer's figures).

    Args:
        runner: The trainer this panel starts and stops.
        config: Defaults of the settings form.
        place: Where the panel stands.

    Returns:
        The main components by name (``"start"``, ``"stop"``, ``"status"``, ``"anchor"``, ...).
    """
    panel, prefix = RolePanel(runner, config, place), place.prefix
    live = panel.live
    with gr.Accordion("Trainer settings", open=False):
        form = panel.form(overrides={"anchor_policy": lambda **kw: gr.Radio(policy_names(), **kw)})

    def make_config(*values: Any) -> TrainerConfig:
        return forms.config_from_form(config, list(form), values)

    with live:
        controls = panel.controls(make_config, list(form.values()))
        summary = summary_line(live, frames.trainer_summary, elem_id=f"{prefix}trainer-summary")
        summary_line(live, frames.adapter_summary, elem_id=f"{prefix}adapter-summary")
        summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
        if link := trackio_link(config):
            gr.Markdown(link, elem_id=f"{prefix}trackio-link")
        gr.Markdown("### Anchor policy")
        anchor = anchor_policy_controls(live, default=config.policy(), prefix=prefix)
        gr.Markdown("### Weight sync")
        plots = sync_plots(live, prefix=prefix)
        experts = expert_plot(live, prefix=prefix)
        gr.Markdown("### Training")
        training = training_plots(live, prefix=prefix)
        with gr.Row():
            with gr.Column(scale=3):
                reward = reward_plot(live, prefix=prefix)
            with gr.Column(scale=2):
                publishes = publishes_table(live, prefix=prefix)
        fleet = fleet_table(live, prefix=prefix)
    return {
        **controls,
        "form": form,
        "summary": summary,
        "anchor": anchor,
        "plots": plots,
        "experts": experts,
        "training": training,
        "reward": reward,
        "publishes": publishes,
        "fleet": fleet,
        "live": live,
    }


def trackio_link(config: TrainerConfig) -> str:
    """The panel's line linking to the run's Trackio dashboard ('' when the run does not log to a Trackio Space)."""
    space = config.trackio_space() if ReportTo.TRACKIO.value in config.report_targets() else None
    if not space:
        return ""
    return f"Training curves in Trackio: [{space}, project {config.trackio_project}]({trackio_url(space, config.trackio_project)})"


#: The trainer Space's page: a Start runs one :class:`Trainer`.
SPACE = RoleSpace(
    Role.TRAINER, "trainer", "Async GRPO trainer publishing bf16 anchors and sparse deltas to the bucket.",
    TrainerConfig.from_env, lambda config: [Trainer(config)], build_panel,
)  # fmt: skip
make_runner, build_app, main = SPACE.make_runner, SPACE.build_app, SPACE.main


if __name__ == "__main__":
    main()
