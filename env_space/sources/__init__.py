"""Environment sources beyond the built-in toy tasks, chosen by ``ENV_ENVIRONMENT``.

``ENV_ENVIRONMENT`` is either the name of a registered environment (``reverse``,
``arithmetic``; see :mod:`env_space.environments`) or ``<source>:<argument>``:

- ``reasoning_gym:leg_counting=2,basic_arithmetic``: reasoning-gym generators with weights
  (:mod:`env_space.sources.reasoning_gym`, settings ``ENV_RG_*``);
- ``dataset:openai/gsm8k`` (a Hub dataset) or ``dataset:/path/saved/with/save_to_disk``, scored
  by TRL-style reward functions (:mod:`env_space.sources.datasets_source`, ``ENV_DATASET_*``);
- ``openenv:http://host:8000``: an OpenEnv environment server, one step per episode
  (:mod:`env_space.sources.openenv_client`, ``ENV_OPENENV_*``).

Each source is one module of this package that registers itself in :mod:`rlsync.registry`
(``Kind.ENV_SOURCE``: name, ``from_spec``, settings and their form, package, example); the registry reads
this package's files (:func:`rlsync.registry.add_home`) and finds it. A source imports its packages only when
selected, so the toy tasks and the panel's forms need none of them; a missing package gives an error
naming what to install.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from env_space.environments import Environment, get_environment
from rlsync.errors import UnknownNameError
from rlsync.registry import Kind, add_home, get

from .prompts import render_prompt

__all__ = ["open_environment", "parse_weighted"]

add_home(__name__)  # the environment sources, one module each

def parse_weighted(text: str) -> dict[str, float]:
    """Parse ``"a=2,b,c=0.5"`` into ``{"a": 2.0, "b": 1.0, "c": 0.5}`` (weight 1 when omitted).

    Raises:
        ValueError: An empty name, a repeated name, or a weight that is not a finite number > 0.
    """
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, weight = (part.strip() for part in item.partition("="))
        if not name:
            raise ValueError(f"empty name in {text!r}")
        if name in out:
            raise ValueError(f"{name!r} is listed twice in {text!r}")
        value = float(weight) if sep else 1.0
        if not 0 < value < float("inf"):
            raise ValueError(f"weight of {name!r} must be a finite number > 0, got {weight!r}")
        out[name] = value
    return out


def open_environment(spec: str, *, chat_template: str = "", settings: Any | None = None) -> Environment:
    """The environment ``spec`` names (see the module docstring).

    Args:
        spec: A registered environment name, or ``<source>:<argument>``.
        chat_template: Model id or path whose tokenizer's chat template formats the prompts
            of the external sources (``""``: plain text).
        settings: The source's settings object (default: read from its ``ENV_*`` variables).

    Raises:
        KeyError: Unknown environment or source.
        ImportError: The source's package is not installed.
        ValueError: Bad settings, or a chat template that cannot be loaded.
    """
    source, sep, argument = spec.partition(":")
    if not sep:
        return get_environment(spec)
    if chat_template:  # fail at start, not at the first batch
        render_prompt([{"role": "user", "content": "check"}], chat_template)
    try:
        entry = get(Kind.ENV_SOURCE, source)
    except UnknownNameError as exc:
        raise UnknownNameError(f"unknown environment source {source!r}; {str(exc).partition('; ')[2]}") from None
    try:
        missing = [name for name in entry.details.get("requires", ()) if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"no module named {missing[0]!r}")
        from_spec = entry.load()
    except ImportError as exc:
        raise ImportError(f"the {source!r} source needs `pip install {entry.details['package']}` ({exc})") from exc
    return from_spec(argument, chat_template=chat_template, settings=settings)
