"""The environment sources' entries in :mod:`rlsync.registry` (``Kind.ENV_SOURCE``): each source module of this
package registers its name, its ``from_spec``, its settings dataclass (whose fields are the panel's form) and
variables' prefix, and as details the package it needs, the modules it imports and an example spec, in its own
file; adding a source is one new file.

The registry reads this package's files without importing them, so the panel shows every source's form
without reasoning-gym, datasets or openenv-core installed; a source's module is imported when it is used.
"""

from __future__ import annotations

import json
from typing import Any

from rlsync.registry import Entry, Kind, entries, get

__all__ = ["read_source_settings", "source_settings", "sources"]


def sources() -> list[Entry]:
    """The registered environment sources, by name."""
    return entries(Kind.ENV_SOURCE)


def read_source_settings(name: str, **overrides: Any) -> Any:
    """Source ``name``'s settings from its variables (``<env_prefix>_<FIELD>``), then ``overrides``.

    Raises:
        UnknownNameError: no such source.
        ConfigurationError: a variable does not parse, or an override is not a field.
    """
    return get(Kind.ENV_SOURCE, name).read_settings(**overrides)


def __getattr__(name: str) -> type:
    """A registered source's settings class by its name (``settings.DatasetSourceConfig``)."""
    for entry in sources():
        if isinstance(entry.settings, str) and entry.settings.endswith(f":{name}"):
            return entry.settings_class()  # type: ignore[return-value]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    name = spec.partition(":")[0] if ":" in spec else None
    entry = next((e for e in sources() if e.name == name), None)
    values = json.loads(overrides) if overrides.strip() else {}
    if not isinstance(values, dict):
        raise ValueError(f"source settings must be a JSON object, got {overrides!r}")
    if entry is None:
        if values:
            raise ValueError(f"{spec!r} takes no source settings, got {sorted(values)}")
        return None
    return entry.read_settings(**values)
