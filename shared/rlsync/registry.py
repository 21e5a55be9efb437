"""One registry for every way to extend the project: codecs, bucket backends, anchor policies, environment
sources, environments and rollout engines.

An entry is one top-level call in the module that implements it, naming what to import lazily:

>>> register(Kind.CODEC, "gapzz", "rlsync.codecs.gapzz:GapZigzagCodec", summary="gaps, zigzag varints")

The extensions live in home packages (:func:`add_home`). The registry *reads* those calls from the homes'
files with :mod:`ast` (literal arguments only) and imports a module only when its entry is first used
(:meth:`Entry.load`): names, help texts, panel choices, CLI choices and validation need none of the
packages a backend imports (huggingface_hub, vLLM, reasoning-gym), and a new backend is one new file
in its kind's home. Running the module registers the same entry again, which is harmless.

The library's homes are listed here; the Space packages add theirs (``env_space``, ``env_space.sources``,
``rollout_space.engines``) on import, so the library never imports the Space layer. Code outside the homes
(a test, a user's package) calls :func:`register` at run time with the object itself or a ``"module:Attr"``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.util
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import ConfigurationError, UnknownNameError

__all__ = ["Entry", "Kind", "add_home", "check_choice", "entries", "get", "names", "register"]


class Kind(enum.StrEnum):
    """What an entry extends (its value is its name in lower case: ``Kind("engine")``).

    ``CODEC``: delta codecs (``TRAINER_CODEC``, ``rlsync diff --codec``); ``BUCKET``: bucket backends by URL scheme,
    with their capabilities; ``ANCHOR_POLICY``: anchor policies (``TRAINER_ANCHOR_POLICY``, the control object);
    ``ENV_SOURCE``: ``ENV_ENVIRONMENT=<source>:<argument>``; ``ENVIRONMENT``: ``ENV_ENVIRONMENT=<name>``;
    ``ENGINE``: ``ROLLOUT_ENGINE``, with their capabilities.
    """

    CODEC = enum.auto()
    BUCKET = enum.auto()
    ANCHOR_POLICY = enum.auto()
    ENV_SOURCE = enum.auto()
    ENVIRONMENT = enum.auto()
    ENGINE = enum.auto()


#: Each kind in messages ("unknown rollout engine 'x'").
LABELS = {
    Kind.CODEC: "codec", Kind.BUCKET: "bucket backend", Kind.ANCHOR_POLICY: "anchor policy",
    Kind.ENV_SOURCE: "environment source", Kind.ENVIRONMENT: "environment", Kind.ENGINE: "rollout engine",
}  # fmt: skip


def _import(reference: str) -> Any:
    module, sep, attr = reference.partition(":")
    if not sep or not module or not attr:
        raise ConfigurationError(f"a registry target is 'module:Attr', got {reference!r}")
    value: Any = importlib.import_module(module)
    for part in attr.split("."):
        value = getattr(value, part)
    return value


def _key(target: Any) -> str:
    """A target's identity: its ``"module:Attr"`` (an object's module and qualified name)."""
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__qualname__)}"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered extension.

    Args:
        kind: What it extends.
        name: The name users write (``ROLLOUT_ENGINE=vllm``, ``hf://``, ``--codec gapzz``).
        target: ``"module:Attr"`` (imported on first :meth:`load`) or the object itself.
        settings: Its settings dataclass, ``"module:Attr"`` or the class (``None``: it has none).
        env_prefix: Its variables' prefix (``ENV_RG``: ``ENV_RG_<FIELD>``), ``None`` when it reads none.
        capabilities: What it can do, in its kind's words (a bucket's ``"metered"``, an engine's ``"fp8"``).
        summary: One line for help texts and panels.
        details: Anything else its kind needs (an env source's package and example).
    """

    kind: Kind
    name: str
    target: Any
    settings: Any = None
    env_prefix: str | None = None
    capabilities: frozenset[str] = frozenset()
    summary: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def load(self) -> Any:
        """The registered object (its module imported on first use).

        Raises:
            ImportError: its module or a package it needs is not installed.
        """
        return _import(self.target) if isinstance(self.target, str) else self.target

    def settings_class(self) -> type | None:
        """Its settings dataclass, or ``None``."""
        return _import(self.settings) if isinstance(self.settings, str) else self.settings

    def read_settings(self, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
        """Its settings from ``<env_prefix>_<FIELD>`` variables, then ``overrides`` (``None`` if it has none).

        Raises:
            ConfigurationError: a variable does not parse, or an override is not one of its fields.
        """
        from .config import from_env

        cls = self.settings_class()
        if cls is None:
            return None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigurationError(f"unknown {self.name} settings {sorted(unknown)}")
        return from_env(cls, self.env_prefix or (), environ, **overrides)

    def has(self, capability: str | enum.Enum) -> bool:
        """Whether it declares ``capability``."""
        return (capability.value if isinstance(capability, enum.Enum) else capability) in self.capabilities


_LIBRARY_HOMES = ("rlsync.codecs", "rlsync.bucket", "rlsync.protocol.policies")
_homes: list[str] = list(_LIBRARY_HOMES)
_read: set[str] = set()
_entries: dict[tuple[Kind, str], Entry] = {}
_lock = threading.RLock()


def register(
    kind: Kind | str,
    name: str,
    target: Any,
    *,
    settings: Any = None,
    env_prefix: str | None = None,
    capabilities: tuple[str, ...] | frozenset[str] = (),
    summary: str = "",
    **details: Any,
) -> Entry:
    """Register ``target`` as the ``kind`` called ``name`` (see :class:`Entry` for the arguments).

    Returns:
        The entry (the one registered already when it is the same target).

    Raises:
        ConfigurationError: ``name`` is taken by another target, or is empty.
    """
    kind = Kind(kind)
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a {LABELS[kind]} needs a non-empty name, got {name!r}")
    entry = Entry(kind, name, target, settings, env_prefix, frozenset(capabilities), summary, dict(details))
    with _lock:
        known = _entries.get((kind, name))
        if known is not None:
            if _key(known.target) != _key(target):
                raise ConfigurationError(f"{LABELS[kind]} {name!r} is taken by {_key(known.target)}")
            if isinstance(known.target, str) and not isinstance(target, str):
                _entries[(kind, name)] = entry  # the object itself, now that its module ran
            return _entries[(kind, name)]
        _entries[(kind, name)] = entry
    return entry


def add_home(package: str) -> None:
    """Read ``package``'s modules (or the module itself) for registrations, on the next query.

    Args:
        package: An importable package or module name (``"rollout_space.engines"``).
    """
    with _lock:
        if package not in _homes:
            _homes.append(package)


def _files(home: str) -> list[Path]:
    """The ``.py`` files of package ``home`` (or the module itself), found without importing it or its parents
    (``rlsync.protocol`` would bring torch)."""
    top, *rest = home.split(".")
    spec = importlib.util.find_spec(top)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root, *rest)
        if path.is_dir():
            return sorted(path.glob("*.py"))
        if path.with_suffix(".py").is_file():
            return [path.with_suffix(".py")]
    if spec is not None and not rest and spec.origin:
        return [Path(spec.origin)]
    raise ConfigurationError(f"registry home {home!r} is not importable")


def _literal(node: ast.expr, where: str) -> Any:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Kind":
        return Kind[node.attr]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ConfigurationError(f"{where}: register() takes literal arguments (strings, tuples, Kind.X)") from None


def _declarations(path: Path) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """The arguments of the top-level ``register(Kind.X, ...)`` calls of one file (plain or assigned)."""
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        call = node.value if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "register"):
            continue
        if not call.args or not isinstance(call.args[0], (ast.Attribute, ast.Constant)):
            continue
        where = f"{path}:{call.lineno}"
        args = [_literal(arg, where) for arg in call.args]
        kwargs = {kw.arg: _literal(kw.value, where) for kw in call.keywords if kw.arg is not None}
        if isinstance(args[0], Kind) or args[0] in Kind._value2member_map_:
            yield args, kwargs


def _discover() -> None:
    with _lock:
        for home in list(_homes):
            if home not in _read:
                _read.add(home)
                for path in _files(home):
                    for args, kwargs in _declarations(path):
                        register(*args, **kwargs)


def entries(kind: Kind | str) -> list[Entry]:
    """Every entry of ``kind``, by name."""
    kind = Kind(kind)
    _discover()
    return sorted((e for (k, _), e in list(_entries.items()) if k is kind), key=lambda e: e.name)


def names(kind: Kind | str) -> list[str]:
    """The names of ``kind``'s entries, sorted."""
    return [entry.name for entry in entries(kind)]


def get(kind: Kind | str, name: str) -> Entry:
    """The entry of ``kind`` called ``name``.

    Raises:
        UnknownNameError: no such entry (the message lists the known names; a ``ConfigurationError`` and a
            ``KeyError``).
    """
    kind = Kind(kind)
    if (kind, name) not in _entries:  # a module asking for its own entry needs no discovery
        _discover()
    try:
        return _entries[(kind, name)]
    except (KeyError, TypeError):
        raise UnknownNameError(f"unknown {LABELS[kind]} {name!r}; known: {', '.join(names(kind))}") from None


def check_choice(kind: Kind | str, value: str, variable: str, also: tuple[str, ...] = ()) -> None:
    """Refuse a setting that names no entry of ``kind`` (nor one of ``also``, e.g. ``"auto"``), at start.

    Args:
        kind: What the setting names.
        value: Its value.
        variable: The variable that sets it, for the message (``TRAINER_CODEC``).
        also: Other values it accepts.

    Raises:
        UnknownNameError: the message names the variable and the values that work.
    """
    known = [*also, *names(kind)]
    if value not in known:
        raise UnknownNameError(f"{variable}={value!r} names no {LABELS[Kind(kind)]}; use one of {', '.join(known)}")
