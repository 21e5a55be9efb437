"""Settings from environment variables: the one helper every configuration dataclass is read with.

Each component has one dataclass of settings. Library classes take it as an argument and default to
its defaults; only entry points (the ``rlsync`` command, the Spaces, the vLLM plug-in's entry) call
:func:`from_env`, which fills it from variables named ``PREFIX_FIELD`` (upper case). That is how a
Space passes settings: its variables and secrets become environment variables.

A field may name its variable itself with ``metadata={"env": "NAME"}`` (the variable is then
``PREFIX_NAME``), or opt out of the environment with ``metadata={"env": None}``. Several prefixes may
be given, later ones winning: ``("HUB", "ROLLOUT_HUB")`` reads ``HUB_SHARE`` then
``ROLLOUT_HUB_SHARE``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from typing import Any, Mapping, Sequence, TypeVar

from .errors import ConfigurationError

__all__ = ["ProcessSettings", "env_name", "from_env", "process_settings", "settings_table"]

T = TypeVar("T")


def _convert(raw: str, kind: Any, name: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw == "" or raw.lower() == "none":
            return None
        return _convert(raw, args[0], name)
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigurationError(f"{name}: expected a boolean, got {raw!r}")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        for value in (raw, raw.lower()):
            if value in kind._value2member_map_:
                return kind(value)
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigurationError(f"{name}: expected one of {choices}, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigurationError(f"{name}: expected {kind.__name__}, got {raw!r}") from None
    raise TypeError(f"{name}: unsupported setting type {kind}")


def _prefixes(prefix: str | Sequence[str]) -> tuple[str, ...]:
    return (prefix,) if isinstance(prefix, str) else tuple(prefix)


def env_name(field: dataclasses.Field, prefix: str) -> str | None:
    """The variable that sets ``field`` under ``prefix`` (``PREFIX_FIELD``), or ``None`` if it has none.

    Args:
        field: A field of a settings dataclass; ``metadata["env"]`` renames it (``None``: not settable).
        prefix: The variables' prefix, e.g. ``"TRAINER"``.
    """
    name = field.metadata.get("env", field.name)
    return None if name is None else f"{prefix}_{name}".upper()


def from_env(
    cls: type[T], prefix: str | Sequence[str], environ: Mapping[str, str] | None = None, **overrides: Any
) -> T:
    """Build ``cls`` from its defaults, then ``PREFIX_FIELD`` variables (later prefixes win), then ``overrides``.

    Args:
        cls: A settings dataclass.
        prefix: The variables' prefix, or several (``("HUB", "ROLLOUT_HUB")``: the second overrides the first).
        environ: The variables (default: ``os.environ``).
        **overrides: Field values that win over the environment (``None`` values are ignored).

    Returns:
        The settings.

    Raises:
        ConfigurationError: a variable cannot be converted to its field's type (the message names the variable).
        ValueError: the dataclass refuses the values (a ``ConfigurationError`` where it says which settings clash).
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        for each in _prefixes(prefix):
            var = env_name(field, each)
            if var is not None and var in environ:
                values[field.name] = _convert(environ[var], hints[field.name], var)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def settings_table(cls: type, prefix: str) -> list[tuple[str, str, str]]:
    """``(variable, default, description)`` rows for documentation (fields set from the environment only; a default
    computed when the settings are built shows its ``metadata["shown_default"]``)."""
    rows = []
    for field in dataclasses.fields(cls):
        var = env_name(field, prefix)
        if var is None:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.metadata.get("shown_default", "")
        rows.append((var, repr(default), field.metadata.get("help", "")))
    return rows


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """Settings of the whole process rather than of one component (variables ``RLSYNC_<FIELD>``)."""

    threads: int = dataclasses.field(default=0, metadata={"help": "the library's worker threads (0: one per CPU)"})
    cache: str = dataclasses.field(default="", metadata={"help": "cache root of built models ('': ~/.cache/rl-sync)"})
    bucket: str = dataclasses.field(default="", metadata={"help": "the combined app's bucket (app.py --bucket)"})


def process_settings(environ: Mapping[str, str] | None = None) -> ProcessSettings:
    """The :class:`ProcessSettings` from ``RLSYNC_<FIELD>`` variables (``environ``, default ``os.environ``).

    Raises:
        ConfigurationError: a variable does not parse (the message names it).
    """
    return from_env(ProcessSettings, "RLSYNC", environ)
