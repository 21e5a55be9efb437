"""The registry of environment sources: each registers its name, its module, the package it needs, an
example spec and its settings dataclass (whose fields are the panel's form), with :func:`register_source`
on that dataclass (``ENV_RG_*``, ``ENV_DATASET_*``, ``ENV_OPENENV_*``).

Kept apart from the sources' modules so that the panel can show their forms without importing
reasoning-gym, datasets or openenv-core.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlsync.spaces.settings import from_env

__all__ = [
    "SOURCES", "DatasetSourceConfig", "OpenEnvConfig", "ReasoningGymConfig", "Source", "register_source", "source_settings",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Source:
    """One environment source of ``ENV_ENVIRONMENT=<name>:<argument>``.

    Args:
        name: The prefix of its specs.
        module: Its module, imported only when selected; it defines ``from_spec(argument, *, chat_template, settings)``.
        package: What ``pip install`` gives it.
        example: A spec the panel offers.
        settings: Its settings dataclass (the fields are its form).
        env_prefix: Its environment variables' prefix (``ENV_RG``: ``ENV_RG_<FIELD>``).
    """

    name: str
    module: str
    package: str
    example: str
    settings: type
    env_prefix: str

    def read(self, **overrides: Any) -> Any:
        """The settings from the source's environment variables, then ``overrides``.

        Raises:
            ValueError: a variable does not parse, or an override is not a field.
        """
        return from_env(self.settings, self.env_prefix, **overrides)


#: Source name -> :class:`Source`, in registration order.
SOURCES: dict[str, Source] = {}


def register_source(name: str, *, module: str, package: str, example: str, env_prefix: str) -> Any:
    """Class decorator on a source's settings dataclass: register the source.

    Raises:
        ValueError: the name is taken.
    """

    def register(cls: type) -> type:
        if name in SOURCES and SOURCES[name].settings.__qualname__ != cls.__qualname__:
            raise ValueError(f"environment source {name!r} is registered already")
        SOURCES[name] = Source(name, module, package, example, cls, env_prefix)
        return cls

    return register


@register_source(
    "reasoning_gym", module="env_space.sources.reasoning_gym", package="reasoning-gym",
    example="reasoning_gym:leg_counting=2,basic_arithmetic", env_prefix="ENV_RG",
)  # fmt: skip
@dataclasses.dataclass
class ReasoningGymConfig:
    """Settings of the reasoning-gym source (environment variables ``ENV_RG_<FIELD>``)."""

    level: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "difficulty: curriculum level of every generator (0 = easiest); -1 = the generators' defaults"
        },
    )
    overrides: str = dataclasses.field(
        default="", metadata={"help": 'JSON: generator config fields, e.g. {"leg_counting": {"max_animals": 4}}'}
    )
    system_prompt: str = dataclasses.field(
        default="default", metadata={"help": "a key of reasoning_gym.utils.SYSTEM_PROMPTS, or the text itself"}
    )
    answer_tag: str = dataclasses.field(
        default="answer", metadata={"help": "tag holding the final answer: <answer>...</answer>"}
    )


@register_source(
    "dataset", module="env_space.sources.datasets_source", package="datasets math-verify", example="dataset:openai/gsm8k",
    env_prefix="ENV_DATASET",
)  # fmt: skip
@dataclasses.dataclass
class DatasetSourceConfig:
    """Settings of the dataset source (environment variables ``ENV_DATASET_<FIELD>``)."""

    subset: str = dataclasses.field(default="", metadata={"help": "dataset configuration name, e.g. main for gsm8k"})
    split: str = dataclasses.field(default="train", metadata={"help": "split to draw prompts from"})
    prompt_column: str = dataclasses.field(
        default="prompt", metadata={"help": "column with the prompt (text or chat messages)"}
    )
    answer_column: str = dataclasses.field(default="answer", metadata={"help": "column with the reference answer"})
    type_column: str = dataclasses.field(
        default="", metadata={"help": "column naming the task type for the panel ('' = none)"}
    )
    rewards: str = dataclasses.field(
        default="math_verify",
        metadata={"help": "reward functions with weights: NAME[=W],... (built-in or module.function)"},
    )
    system_prompt: str = dataclasses.field(
        default="", metadata={"help": "system message put before string prompts ('' = none)"}
    )
    answer_tag: str = dataclasses.field(
        default="answer", metadata={"help": "tag of the final answer for exact_match and format"}
    )
    reward_timeout_s: float = dataclasses.field(
        default=5.0, metadata={"help": "time bound of one reward function call"}
    )
    reward_isolation: str = dataclasses.field(
        default="process", metadata={"help": "process (one confined worker, killed when a call overstays) or thread (a confined fork per call)"}
    )


@register_source(
    "openenv", module="env_space.sources.openenv_client", package="openenv-core", example="openenv:http://127.0.0.1:8000",
    env_prefix="ENV_OPENENV",
)  # fmt: skip
@dataclasses.dataclass
class OpenEnvConfig:
    """Settings of the OpenEnv source (environment variables ``ENV_OPENENV_<FIELD>``)."""

    prompt_field: str = dataclasses.field(default="prompt", metadata={"help": "observation field holding the prompt"})
    action_field: str = dataclasses.field(
        default="message", metadata={"help": "action field the completion is sent in"}
    )
    type_field: str = dataclasses.field(
        default="task_type", metadata={"help": "observation field naming the task type ('' = none)"}
    )
    timeout_s: float = dataclasses.field(default=30.0, metadata={"help": "connect and message timeout"})
    batch_timeout_s: float = dataclasses.field(
        default=120.0, metadata={"help": "time bound of making one task batch (plus at most one call's timeout)"}
    )
    max_message_mb: float = dataclasses.field(
        default=1.0, metadata={"help": "largest WebSocket message accepted from the server"}
    )


def source_settings(spec: str, overrides: str = "") -> Any | None:
    """The settings of the source ``spec`` selects: its ``ENV_<SOURCE>_*`` variables, then ``overrides``.

    Args:
        spec: ``ENV_ENVIRONMENT`` (``reasoning_gym:...``); a registered environment name has no settings.
        overrides: JSON object of field values (what the panel's source form sets), ``""`` for none.

    Returns:
        The settings dataclass, or ``None`` for a registered environment or an unknown source.

    Raises:
        ValueError: ``overrides`` is not a JSON object of the source's fields, or a variable does not parse.
    """
    source = SOURCES.get(spec.partition(":")[0]) if ":" in spec else None
    cls = source.settings if source is not None else None
    values = json.loads(overrides) if overrides.strip() else {}
    if not isinstance(values, dict):
        raise ValueError(f"source settings must be a JSON object, got {overrides!r}")
    if cls is None:
        if values:
            raise ValueError(f"{spec!r} takes no source settings, got {sorted(values)}")
        return None
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {spec.partition(':')[0]} settings {sorted(unknown)}")
    return source.read(**values)
