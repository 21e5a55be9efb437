"""The anchor-policy interface, and its entries in :mod:`rlsync.registry` (``Kind.ANCHOR_POLICY``): each policy
registers its name once, in its own module of this package (read, not imported, until it is used)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from ...errors import ConfigurationError, FormatError, UnknownNameError
from ...registry import Kind, get, names
from ..manifest import Manifest

__all__ = ["DEFAULT_POLICY", "AnchorPolicy", "policy_class", "policy_names"]

#: The policy used when none is named.
DEFAULT_POLICY = "fixed"


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


def policy_names() -> list[str]:
    """The registered policies' names, the default first."""
    return sorted(names(Kind.ANCHOR_POLICY), key=lambda name: (name != DEFAULT_POLICY, name))


def policy_class(name: str) -> type[AnchorPolicy]:
    """The policy registered as ``name``.

    Raises:
        FormatError: no such policy.
        ConfigurationError: its class is not an :class:`AnchorPolicy` dataclass of that name.
    """
    try:
        cls = get(Kind.ANCHOR_POLICY, name).load()
    except UnknownNameError:
        raise FormatError(f"unknown anchor policy {name!r}; use one of {policy_names()}") from None
    is_policy = isinstance(cls, type) and issubclass(cls, AnchorPolicy) and dataclasses.is_dataclass(cls)
    if not is_policy or cls.name != name:
        raise ConfigurationError(f"anchor policy {name!r} must be an AnchorPolicy dataclass of its settings named so")
    return cls
