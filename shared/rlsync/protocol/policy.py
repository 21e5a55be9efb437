"""Anchor policies: when the publisher writes a full anchor instead of a delta, and their registry.

Policies are plain objects whose settings may be changed while a run goes on
(from the UI, or through the control object in the bucket); the publisher asks
the policy at every publish, so a change takes effect at the next one.

Every policy is a dataclass in its own module of :mod:`rlsync.protocol.policies`, registered under its
``name`` in :mod:`rlsync.registry` (``Kind.ANCHOR_POLICY``; the interface lives in ``policies/base.py``, this
module is the policies' serialized form). Its dataclass fields are its settings, and their metadata
(``label``, ``minimum``, ``step``, ``help``) is what a form shows for them: the control object's
parser, the panels' form and the trainer's settings are built from the registry, so adding a policy
is one new file in that package (discovered on first use of the registry).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import FormatError
from ..jsonlimits import loads_bounded
from ..limits import MAX_CONTROL_BYTES
from .policies.adaptive import Adaptive
from .policies.base import DEFAULT_POLICY, AnchorPolicy, policy_class, policy_names
from .policies.fixed import FixedInterval

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
    name = settings.get("policy")
    cls = policy_class(name) if isinstance(name, str) and name in policy_names() else None
    if cls is None or settings.keys() != {"policy", *(f.name for f in cls.setting_fields())}:
        raise FormatError(f"control object is not an anchor policy's settings (keys {sorted(settings)[:8]})")
    return policy_from_settings(settings)


__all__ = [
    "DEFAULT_POLICY", "Adaptive", "AnchorPolicy", "FixedInterval", "policy_class", "policy_from_form", "policy_from_json",
    "policy_from_settings", "policy_names", "policy_to_json",
]  # fmt: skip
