"""The anchor-policy interface and its registry: each policy registers its name once, with
:func:`register_policy`, in its own module of this package (discovered on first use of the registry)."""

from __future__ import annotations

import abc
import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import Any

from ...errors import FormatError
from ..manifest import Manifest

__all__ = ["DEFAULT_POLICY", "AnchorPolicy", "policy_class", "policy_names", "register_policy"]

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
    """Import every module of this package once (each registers its policy)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name != "base":
            importlib.import_module(f"{__package__}.{module.name}")


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


