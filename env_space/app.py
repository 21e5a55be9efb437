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
from env_space.sources.settings import sources
from rlsync.spaces import forms, frames, role_control
from rlsync.spaces.plots import reward_plot
from rlsync.spaces.tables import episodes_table, frame_table, summary_line
from rlsync.roles import Role
from rlsync.spaces.role_panel import PanelPlace, RolePanel, RoleSpace

logger = logging.getLogger(__name__)


def build_panel(runner: role_control.RoleRunner, config: EnvConfig, place: PanelPlace = PanelPlace()) -> dict[str, Any]:
    """Create the environment panel's components in the current ``gr.Blocks`` context (:class:`RolePanel` with the
    selected source's own form, then the rewards, failures and episodes).

    Args:
        runner: The simulator this panel starts and stops.
        config: Defaults of the settings form.
        place: Where the panel stands.

    Returns:
        The main components by name.
    """
    panel, prefix = RolePanel(runner, config, place), place.prefix
    live = panel.live
    choices = [*list_environments(), *(source.details["example"] for source in sources())]
    choices += [config.environment] if config.environment not in choices else []

    def selector(**kw: Any) -> Any:
        return gr.Dropdown(choices, allow_custom_value=True, **kw)

    with gr.Accordion("Environment settings", open=place.bucket_url is None):
        form = panel.form(overrides={"environment": selector}, skip=("source_settings",))
        source_forms: dict[str, tuple[Any, dict[str, Any], Any]] = {}  # source -> (defaults, form, accordion)
        for entry in sources():  # one form per registered source, from its settings
            source, defaults = entry.name, entry.read_settings()
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
        controls = panel.controls(make_config, [*form.values(), *source_inputs])
        summary = summary_line(live, frames.env_summary, elem_id=f"{prefix}env-summary")
        summary_line(live, frames.hub_requests_summary, elem_id=f"{prefix}hub-requests")
        reward = reward_plot(live, prefix=prefix)
        with gr.Row():
            by_type = frame_table(
                live, frames.task_type_frame, "Reward per source and task type", f"{prefix}env-by-type", wrap=True
            )
            failures = frame_table(
                live, frames.failures_frame, "Scoring failures by reason", f"{prefix}env-failures", wrap=True
            )
        episodes = episodes_table(live, prefix=prefix)
    return {
        **controls, "form": form, "source_forms": {s: f for s, (_, f, _) in source_forms.items()}, "summary": summary,
        "reward": reward, "by_type": by_type, "failures": failures, "episodes": episodes, "live": live,
    }  # fmt: skip


#: The environment Space's page: a Start runs one :class:`EnvSimulator`.
SPACE = RoleSpace(
    Role.ENV, "environment", "Publishes task batches and scores the replicas' completions.", EnvConfig.from_env,
    lambda config: [EnvSimulator(config)], build_panel,
)  # fmt: skip
make_runner, build_app, main = SPACE.make_runner, SPACE.build_app, SPACE.main


if __name__ == "__main__":
    main()
