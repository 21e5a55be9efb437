"""The registry of environment sources: each source module of this package registers its name, the package
it needs, an example spec and its settings dataclass (whose fields are the panel's form), with
:func:`register_source` on that dataclass, in its own file; adding a source is one new file.

A source module imports its packages (reasoning-gym, datasets, openenv-core) only when an environment is made,
so that the panel shows every source's form without them: the registry imports every module of this package
that registers a source (:func:`discover`, on first import of the registry) and nothing else.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

from rlsync.spaces.settings import from_env

__all__ = ["SOURCES", "Source", "discover", "register_source", "source_settings"]


@dataclasses.dataclass(frozen=True)
class Source:
    """One environment source of ``ENV_ENVIRONMENT=<name>:<argument>``.

    Args:
        name: The prefix of its specs.
        module: Its module; it defines ``from_spec(argument, *, chat_template, settings)``.
        package: What ``pip install`` gives it.
        example: A spec the panel offers.
        settings: Its settings dataclass (the fields are its form).
        env_prefix: Its environment variables' prefix (``ENV_RG``: ``ENV_RG_<FIELD>``).
        requires: The modules it imports when used (checked, not imported, before it is opened).
    """

    name: str
    module: str
    package: str
    example: str
    settings: type
    env_prefix: str
    requires: tuple[str, ...] = ()

    def read(self, **overrides: Any) -> Any:
        """The settings from the source's environment variables, then ``overrides``.

        Raises:
            ValueError: a variable does not parse, or an override is not a field.
        """
        return from_env(self.settings, self.env_prefix, **overrides)


#: Source name -> :class:`Source`, in registration order.
SOURCES: dict[str, Source] = {}


def register_source(
    name: str, *, package: str, example: str, env_prefix: str, requires: tuple[str, ...] = (), module: str | None = None
) -> Any:
    """Class decorator on a source's settings dataclass: register the source.

    Args:
        name: The prefix of its specs (``<name>:<argument>``).
        package: What ``pip install`` gives it.
        example: A spec the panel offers.
        env_prefix: Its environment variables' prefix.
        requires: The modules it imports when used.
        module: The module defining ``from_spec`` (default: the settings class's own).

    Raises:
        ValueError: the name is taken.
    """

    def register(cls: type) -> type:
        if name in SOURCES and SOURCES[name].settings.__qualname__ != cls.__qualname__:
            raise ValueError(f"environment source {name!r} is registered already")
        SOURCES[name] = Source(name, module or cls.__module__, package, example, cls, env_prefix, tuple(requires))
        return cls

    return register


def discover(folder: Path = Path(__file__).parent, package: str = __package__) -> None:
    """Import every module of a package that registers a source (each is read first: the others, e.g. the
    evaluators and the OpenEnv server, import their packages at once).

    Args:
        folder: The package's folder (default: this one, run on first import of the registry).
        package: Its import name.
    """
    for found in pkgutil.iter_modules([str(folder)]):
        path = folder / f"{found.name}.py"
        if path != Path(__file__) and path.is_file() and "@register_source(" in path.read_text(encoding="utf-8"):
            importlib.import_module(f"{package}.{found.name}")


def __getattr__(name: str) -> type:
    """A registered source's settings class by its name (``settings.DatasetSourceConfig``)."""
    for source in list(SOURCES.values()):
        if source.settings.__name__ == name:
            return source.settings
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


discover()
