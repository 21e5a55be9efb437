"""Gradio panel of the environment Space: ``python env_space/app.py``.

The settings form is prefilled from ``EnvConfig.from_env()`` (``ENV_<FIELD>``
variables), with a selector of the registered environments; Start builds an
:class:`~env_space.simulator.EnvSimulator` with the form's values and runs it in
a background thread, Stop stops it. The page then shows, read from the bucket's
``metrics/env.json`` (and ``metrics/trainer.json``): mean reward per policy
version, the recent scored episodes (prompt, completion, reward), and the tasks
and scores per second.

Access: on a public Space anyone could press Start / Stop. Set the ``PANEL_AUTH``
secret to ``user:password`` and the panel asks for that login (Gradio auth)
whenever ``SPACE_ID`` is set; or make the Space private, or hide the controls
behind Hugging Face OAuth (``gr.LoginButton``). The HF token is only read from
the environment and never shown.

Server: ``GRADIO_SERVER_NAME`` (default ``0.0.0.0``), ``PORT`` (default 7860).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script, from the repository or a Space root
    sys.path.insert(0, _ROOT)

import logging
from typing import Any

import gradio as gr

from env_space.environments import list_environments
from env_space.simulator import EnvConfig, EnvSimulator
from shared.spaces import components, forms, frames, role_control, snapshots

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
    current = {"url": config.bucket}
    live = components.Live(bucket_url if bucket_url is not None else (lambda: current["url"]), timer)
    skip = ("bucket",) if bucket_url is not None else ()
    envs = list_environments()
    with gr.Accordion("Environment settings", open=bucket_url is None):
        form = forms.config_form(
            config, overrides={"environment": lambda **kw: gr.Dropdown(envs, **kw)}, skip=skip, prefix=prefix
        )

    def make_config(*values: Any) -> EnvConfig:
        return forms.config_from_form(config, list(form), values)

    with live:
        controls = components.role_controls(
            runner,
            make_config,
            list(form.values()),
            live,
            on_started=lambda c: current.update(url=c.bucket),
            prefix=prefix,
        )
        summary = components.summary_line(live, frames.env_summary, elem_id=f"{prefix}env-summary")
        reward = components.reward_plot(live, prefix=prefix)
        episodes = components.episodes_table(live, prefix=prefix)
    return {**controls, "form": form, "summary": summary, "reward": reward, "episodes": episodes, "live": live}


def build_app(config: EnvConfig | None = None, runner: role_control.RoleRunner | None = None) -> gr.Blocks:
    """The environment Space's panel as a ``gr.Blocks`` (not launched).

    Args:
        config: Form defaults (default: ``EnvConfig.from_env()``).
        runner: The simulator runner (default: a new one).
    """
    config = config or EnvConfig.from_env()
    runner = runner or make_runner()
    with gr.Blocks(title="RL Sync: environment") as demo:
        gr.Markdown("# RL Sync: environment\nPublishes task batches and scores the replicas' completions.")
        build_panel(runner, config)
    return demo


def main() -> None:
    """Launch the environment panel (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    build_app().launch(**components.launch_options())


if __name__ == "__main__":
    main()
