"""Anchor policies: when the publisher writes a full anchor instead of a delta, and their registry.

Policies are plain objects whose settings may be changed while a run goes on
(from the UI, or through the control object in the bucket); the publisher asks
the policy at every publish, so a change takes effect at the next one.

Every policy is a dataclass in its own module of :mod:`rlsync.protocol.policies`, registered under its
``name`` with :func:`register_policy`. Its dataclass fields are its settings, and their metadata
(``label``, ``minimum``, ``step``, ``help``) is what a form shows for them: the control object's
parser, the panels' form and the trainer's settings are built from the registry, so adding a policy
is one new file in that package (discovered on first use of the registry).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import json
import pkgutil
from typing import Any, Mapping

from ..errors import FormatError
from ..jsonlimits import loads_bounded
from ..limits import MAX_CONTROL_BYTES
from .manifest import Manifest

#: The policy used when none is named.
DEFAULT_POLICY = "fixed"

_REGISTRY: dict[str, type["AnchorPolicy"]] = {}
_discovered = False


class AnchorPolicy(abc.ABC):
    """Decides whether the next publish is an anchor (subclasses are dataclasses of their settings)."""

    name: str

    @abc.abstractmethod
    def wants_anchor(self, manifest: Manifest) -> bool:
        """Whether the publish after the version ``manifest`` describes should be an anchor."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for people, e.g. ``"fixed, an anchor every 10 publishes"``."""

    @classmethod
    def setting_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The policy's settings: its dataclass fields (metadata: ``label``, ``minimum``, ``step``, ``help``)."""
        return dataclasses.fields(cls)  # type: ignore[arg-type]

    def settings(self) -> dict[str, Any]:
        """JSON-able settings, as stored in the control object: ``{"policy": name, <field>: value, ...}``."""
        return {"policy": self.name, **{f.name: getattr(self, f.name) for f in self.setting_fields()}}


def register_policy(cls: type[AnchorPolicy]) -> type[AnchorPolicy]:
    """Class decorator: register an anchor policy under its ``name``.

    Raises:
        ValueError: the name is taken by another class, or the class is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"anchor policy {cls.__name__} must be a dataclass of its settings")
    known = _REGISTRY.get(cls.name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"anchor policy name {cls.name!r} is taken by {known.__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    """Import every module of :mod:`rlsync.protocol.policies` once (each registers its policy)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    from . import policies

    for module in pkgutil.iter_modules(policies.__path__):
        importlib.import_module(f"{policies.__name__}.{module.name}")


def policy_names() -> list[str]:
    """The registered policies' names, the default first."""
    _discover()
    return sorted(_REGISTRY, key=lambda name: (name != DEFAULT_POLICY, name))


def policy_class(name: str) -> type[AnchorPolicy]:
    """The policy registered as ``name``.

    Raises:
        FormatError: no such policy.
    """
    _discover()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown anchor policy {name!r}; use one of {policy_names()}") from None


def policy_from_settings(settings: Mapping[str, Any]) -> AnchorPolicy:
    """Build a policy from its :meth:`AnchorPolicy.settings` (missing settings take their defaults;
    settings of other policies are ignored).

    Raises:
        FormatError: unknown policy or invalid values.
    """
    cls = policy_class(settings.get("policy", DEFAULT_POLICY))
    values = {f.name: settings[f.name] for f in cls.setting_fields() if f.name in settings}
    try:
        return cls(**values)
    except (ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"invalid anchor policy settings: {exc}") from None


def policy_from_form(name: str, values: Mapping[str, Any]) -> AnchorPolicy:
    """Build a policy from form values (numbers arrive as floats; an ``int`` setting must be whole).

    Raises:
        ValueError: unknown policy or invalid values.
    """
    settings: dict[str, Any] = {"policy": name}
    for f in policy_class(name).setting_fields():
        value = values.get(f.name)
        if value is None:
            continue
        if f.type in (int, "int"):
            if float(value) != int(value):
                raise ValueError(f"{f.name} must be a whole number, got {value!r}")
            value = int(value)
        elif f.type in (float, "float"):
            value = float(value)
        settings[f.name] = value
    return policy_from_settings(settings)


def policy_to_json(policy: AnchorPolicy) -> bytes:
    """Serialize a policy for the control object."""
    return json.dumps(policy.settings()).encode()


def policy_from_json(data: bytes) -> AnchorPolicy:
    """Parse a control object written by :func:`policy_to_json`: exactly one policy's settings.

    Raises:
        FormatError: not a JSON object, or not exactly the keys of a known policy's settings
            (any other object, e.g. ``{"note": "hi"}``, would otherwise mean the defaults).
    """
    settings = loads_bounded(data, what="control object", max_bytes=MAX_CONTROL_BYTES)
    if not isinstance(settings, dict):
        raise FormatError("control object is not a JSON object")
    _discover()
    cls = _REGISTRY.get(settings.get("policy")) if isinstance(settings.get("policy"), str) else None
    if cls is None or settings.keys() != {"policy", *(f.name for f in cls.setting_fields())}:
        raise FormatError(f"control object is not an anchor policy's settings (keys {sorted(settings)[:8]})")
    return policy_from_settings(settings)


from .policies.adaptive import Adaptive  # noqa: E402 - the built-in policies, importable from here
from .policies.fixed import FixedInterval  # noqa: E402

__all__ = [
    "DEFAULT_POLICY", "Adaptive", "AnchorPolicy", "FixedInterval", "policy_class", "policy_from_form", "policy_from_json",
    "policy_from_settings", "policy_names", "policy_to_json", "register_policy",
]  # fmt: skip
