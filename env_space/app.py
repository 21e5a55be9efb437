"""Gradio panel of the environment Space: ``python -m env_space.app`` (on the Space: ``python app.py`` at its root).

The settings form is prefilled from ``EnvConfig.from_env()`` (``ENV_<FIELD>``
variables), with a selector of the registered environments and the external
sources (``reasoning_gym:...``, ``dataset:...``, ``openenv:...``; any value can be
typed); the selected source's own settings form (prefilled from its ``ENV_RG_*``,
``ENV_DATASET_*`` or ``ENV_OPENENV_*`` variables) appears below it. Start builds an
:class:`~env_space.simulator.EnvSimulator` with the forms' values and runs it in
a background thread, Stop stops it. The page then shows, read from the bucket's
``metrics/env.json`` (and ``metrics/trainer.json``): mean reward per policy
version, mean reward per source and task type, scoring failures by reason, the
recent scored episodes (task type, prompt, completion, reward), and the tasks and
scores per second.

The source settings choose a reward function among the built-ins, the dotted paths
the operator allowed (``ENV_REWARD_ALLOW``, ``ENV_DATASET_REWARDS``) and the code in
this Space's own repo; any other dotted path typed into the form is refused.

Access and server: as every panel's (:mod:`rlsync.spaces.access`); ``PORT`` (default 7860).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import gradio as gr

from env_space.environments import list_environments
from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources.settings import SOURCES
from rlsync.spaces import components, forms, frames, role_control, snapshots

logger = logging.getLogger(__name__)


def make_runner() -> role_control.RoleRunner:
    """A runner hosting one :class:`EnvSimulator`."""
    return role_control.RoleRunner("env", lambda config: [EnvSimulator(config)])


def build_panel(
    runner: role_control.RoleRunner,
    config: EnvConfig,
    bucket_url: snapshots.BucketSource | None = None,
    timer: Any | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Create the environment panel's components in the current ``gr.Blocks`` context.

    Args:
        runner: The simulator this panel starts and stops.
        config: Defaults of the settings form.
        bucket_url: The bucket the panel reads (fixed, e.g. in the combined app); ``None``:
            the form has a bucket field and the panel follows the bucket of the last Start.
        timer: The ``gr.Timer`` refreshing the panel (default: a new one).
        prefix: Prepended to the components' ``elem_id`` (several panels on one page).

    Returns:
        The main components by name.
    """
    live, follow = components.panel_live(config.bucket, bucket_url, timer)
    skip = ("bucket", "source_settings") if bucket_url is not None else ("source_settings",)
    choices = [*list_environments(), *(source.example for source in SOURCES.values())]
    choices += [config.environment] if config.environment not in choices else []

    def selector(**kw: Any) -> Any:
        return gr.Dropdown(choices, allow_custom_value=True, **kw)

    with gr.Accordion("Environment settings", open=bucket_url is None):
        form = forms.config_form(config, overrides={"environment": selector}, skip=skip, prefix=prefix)
        source_forms: dict[str, tuple[Any, dict[str, Any], Any]] = {}  # source -> (defaults, form, accordion)
        for source, entry in SOURCES.items():  # one form per registered source, from its settings
            defaults = entry.read()
            with gr.Accordion(f"{source} settings", visible=config.environment.startswith(f"{source}:")) as box:
                fields = forms.config_form(defaults, prefix=f"{prefix}{source}-")
            source_forms[source] = (defaults, fields, box)

    form["environment"].change(
        lambda spec: [gr.update(visible=str(spec).startswith(f"{s}:")) for s in source_forms],
        inputs=form["environment"],
        outputs=[box for *_, box in source_forms.values()],
    )
    source_inputs = [c for _, fields, _ in source_forms.values() for c in fields.values()]

    def make_config(*values: Any) -> EnvConfig:
        made = forms.config_from_form(config, list(form), values[: len(form)])
        rest = list(values[len(form) :])
        for source, (defaults, fields, _) in source_forms.items():
            mine, rest = rest[: len(fields)], rest[len(fields) :]
            if made.environment.startswith(f"{source}:"):
                chosen = forms.config_from_form(defaults, list(fields), mine)
                made = dataclasses.replace(made, source_settings=json.dumps(dataclasses.asdict(chosen)))
        return made

    with live:
        controls = components.role_controls(
            runner,
            make_config,
            [*form.values(), *source_inputs],
            live,
            on_started=lambda c: follow(c.bucket),
            prefix=prefix,
        )
        summary = components.summary_line(live, frames.env_summary, elem_id=f"{prefix}env-summary")
        components.summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
        reward = components.reward_plot(live, prefix=prefix)
        with gr.Row():
            by_type = components.frame_table(
                live, frames.task_type_frame, "Reward per source and task type", f"{prefix}env-by-type", wrap=True
            )
            failures = components.frame_table(
                live, frames.failures_frame, "Scoring failures by reason", f"{prefix}env-failures", wrap=True
            )
        episodes = components.episodes_table(live, prefix=prefix)
    return {
        **controls, "form": form, "source_forms": {s: f for s, (_, f, _) in source_forms.items()}, "summary": summary,
        "reward": reward, "by_type": by_type, "failures": failures, "episodes": episodes, "live": live,
    }  # fmt: skip


def build_app(config: EnvConfig | None = None, runner: role_control.RoleRunner | None = None) -> gr.Blocks:
    """The environment Space's panel as a ``gr.Blocks`` (not launched).

    Args:
        config: Form defaults (default: ``EnvConfig.from_env()``).
        runner: The simulator runner (default: a new one).
    """
    config = config or EnvConfig.from_env()
    runner = runner or make_runner()
    description = "Publishes task batches and scores the replicas' completions."
    return components.space_page("environment", description, lambda: build_panel(runner, config))


def main() -> None:
    """Launch the environment panel (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``)."""
    components.serve(build_app)


if __name__ == "__main__":
    main()
