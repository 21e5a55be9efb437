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
from rlsync.spaces import components, forms, frames, role_control, snapshots
from trainer_space.trainer import Trainer, TrainerConfig

logger = logging.getLogger(__name__)


def make_runner() -> role_control.RoleRunner:
    """A runner hosting one :class:`Trainer`."""
    return role_control.RoleRunner("trainer", lambda config: [Trainer(config)])


def build_panel(
    runner: role_control.RoleRunner,
    config: TrainerConfig,
    bucket_url: snapshots.BucketSource | None = None,
    timer: Any | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Create the trainer panel's components in the current ``gr.Blocks`` context.

    Args:
        runner: The trainer this panel starts and stops.
        config: Defaults of the settings form.
        bucket_url: The bucket the panel reads (fixed, e.g. in the combined app); ``None``:
            the form has a bucket field and the panel follows the bucket of the last Start.
        timer: The ``gr.Timer`` refreshing the panel (default: a new one, ticking every ``components.REFRESH_S``).
        prefix: Prepended to the components' ``elem_id`` (several panels on one page).

    Returns:
        The main components by name (``"start"``, ``"stop"``, ``"status"``, ``"anchor"``, ...).
    """
    live, follow = components.panel_live(config.bucket, bucket_url, timer)
    skip = ("bucket",) if bucket_url is not None else ()
    with gr.Accordion("Trainer settings", open=False):
        form = forms.config_form(
            config,
            overrides={"anchor_policy": lambda **kw: gr.Radio(policy_names(), **kw)},
            skip=skip,
            prefix=prefix,
        )

    def make_config(*values: Any) -> TrainerConfig:
        return forms.config_from_form(config, list(form), values)

    with live:
        controls = components.role_controls(
            runner,
            make_config,
            list(form.values()),
            live,
            on_started=lambda c: follow(c.bucket),
            prefix=prefix,
        )
        summary = components.summary_line(live, frames.trainer_summary, elem_id=f"{prefix}trainer-summary")
        components.summary_line(live, frames.adapter_summary, elem_id=f"{prefix}adapter-summary")
        components.summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
        gr.Markdown("### Anchor policy")
        anchor = components.anchor_policy_controls(live, default=config.policy(), prefix=prefix)
        gr.Markdown("### Weight sync")
        plots = components.sync_plots(live, prefix=prefix)
        experts = components.expert_plot(live, prefix=prefix)
        gr.Markdown("### Training")
        training = components.training_plots(live, prefix=prefix)
        with gr.Row():
            with gr.Column(scale=3):
                reward = components.reward_plot(live, prefix=prefix)
            with gr.Column(scale=2):
                publishes = components.publishes_table(live, prefix=prefix)
        fleet = components.fleet_table(live, prefix=prefix)
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


def build_app(config: TrainerConfig | None = None, runner: role_control.RoleRunner | None = None) -> gr.Blocks:
    """The trainer Space's panel as a ``gr.Blocks`` (not launched).

    Args:
        config: Form defaults (default: ``TrainerConfig.from_env()``).
        runner: The trainer runner (default: a new one).
    """
    config = config or TrainerConfig.from_env()
    runner = runner or make_runner()
    description = "Async GRPO trainer publishing bf16 anchors and sparse deltas to the bucket."
    return components.space_page("trainer", description, lambda: build_panel(runner, config))


def main() -> None:
    """Launch the trainer panel (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``)."""
    components.serve(build_app)


if __name__ == "__main__":
    main()
