"""Anchor policies: when the publisher writes a full anchor instead of a delta.

Policies are plain objects whose settings may be changed while a run goes on
(from the UI, or through the control object in the bucket); the publisher asks
the policy at every publish, so a change takes effect at the next one.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
from typing import Any

from ..defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_MAX_CATCHUP_RATIO
from ..errors import FormatError
from ..jsonlimits import loads_bounded
from ..limits import MAX_CONTROL_BYTES
from .manifest import Manifest

# Bounds that keep the pointer and a new replica's catch-up within limits: the pointer lists
# every retained delta (~300 bytes each, more for sharded parts) and must stay under its 16 MiB
# (the publisher also anchors early when it passes its share, see Publisher); catching up costs
# the newest anchor plus every delta since, so at most MAX_CATCHUP_RATIO anchors' worth.
MAX_INTERVAL = 1_000
MAX_CATCHUP_RATIO = 100.0


class AnchorPolicy(abc.ABC):
    """Decides whether the next publish is an anchor."""

    name: str

    @abc.abstractmethod
    def wants_anchor(self, manifest: Manifest) -> bool:
        """Whether the publish after the version ``manifest`` describes should be an anchor."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """JSON-able settings, as stored in the control object."""


@dataclasses.dataclass
class FixedInterval(AnchorPolicy):
    """An anchor every ``interval`` publishes (the others are deltas).

    Args:
        interval: Publishes per anchor; 1 makes every publish an anchor.
    """

    interval: int = DEFAULT_ANCHOR_INTERVAL
    name = "fixed"

    def __post_init__(self) -> None:
        if type(self.interval) is not int or not 1 <= self.interval <= MAX_INTERVAL:
            raise ValueError(f"anchor interval must be an integer in [1, {MAX_INTERVAL}], got {self.interval!r}")

    def wants_anchor(self, manifest: Manifest) -> bool:
        return len(manifest.deltas_since(manifest.newest_anchor.step)) + 1 >= self.interval

    def settings(self) -> dict[str, Any]:
        return {"policy": self.name, "interval": self.interval}


@dataclasses.dataclass
class Adaptive(AnchorPolicy):
    """An anchor when catching up would cost a new replica too much.

    A replica joining now downloads the newest anchor plus every delta after it.
    When that, plus one more delta the size of the last one, would exceed
    ``max_catchup_ratio`` anchors, the next publish is an anchor.

    Args:
        max_catchup_ratio: Bound on catch-up bytes relative to one anchor (> 1).
    """

    max_catchup_ratio: float = DEFAULT_MAX_CATCHUP_RATIO
    name = "adaptive"

    def __post_init__(self) -> None:
        ratio = self.max_catchup_ratio
        if type(ratio) not in (int, float) or not math.isfinite(ratio) or not 1.0 < ratio <= MAX_CATCHUP_RATIO:
            raise ValueError(f"max_catchup_ratio must be a finite number in (1, {MAX_CATCHUP_RATIO:g}], got {ratio!r}")

    def wants_anchor(self, manifest: Manifest) -> bool:
        anchor = manifest.newest_anchor
        since = manifest.deltas_since(anchor.step)
        next_delta = since[-1].nbytes if since else 0
        return manifest.catchup_bytes() + next_delta > self.max_catchup_ratio * anchor.nbytes

    def settings(self) -> dict[str, Any]:
        return {"policy": self.name, "max_catchup_ratio": self.max_catchup_ratio}


def policy_from_settings(settings: dict[str, Any]) -> AnchorPolicy:
    """Build a policy from its :meth:`AnchorPolicy.settings`.

    Raises:
        FormatError: unknown policy or invalid values.
    """
    try:
        kind = settings.get("policy", "fixed")
        if kind == FixedInterval.name:
            return FixedInterval(settings.get("interval", DEFAULT_ANCHOR_INTERVAL))
        if kind == Adaptive.name:
            return Adaptive(settings.get("max_catchup_ratio", DEFAULT_MAX_CATCHUP_RATIO))
    except (ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"invalid anchor policy settings: {exc}") from None
    raise FormatError(f"unknown anchor policy {kind!r}; use 'fixed' or 'adaptive'")


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
    expected = {FixedInterval.name: {"policy", "interval"}, Adaptive.name: {"policy", "max_catchup_ratio"}}
    keys = expected.get(settings.get("policy"))  # type: ignore[arg-type]
    if keys is None or settings.keys() != keys:
        raise FormatError(f"control object is not an anchor policy's settings (keys {sorted(settings)[:8]})")
    return policy_from_settings(settings)
