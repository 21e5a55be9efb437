"""The anchor policy as the panels control it: the policy in force, its description, and
building and writing a new one into the bucket's control object (the trainer reads it at
its next publish)."""

from __future__ import annotations

import logging
from typing import Any

from ..bucket import Bucket
from ..defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_MAX_CATCHUP_RATIO
from ..protocol import CONTROL_KEY, Adaptive, AnchorPolicy, FixedInterval, policy_to_json
from .snapshots import Snapshot

logger = logging.getLogger(__name__)


def current_policy(snap: Snapshot, default: AnchorPolicy | None = None) -> dict[str, Any]:
    """The anchor policy in force at the next publish.

    Returns:
        ``{"policy", "interval", "max_catchup_ratio", "source"}``; ``source`` is
        ``"control object"`` or ``"default"`` (the trainer's own setting applies).
    """
    policy = snap.policy or default or FixedInterval(DEFAULT_ANCHOR_INTERVAL)
    return {
        "policy": policy.name,
        "interval": getattr(policy, "interval", DEFAULT_ANCHOR_INTERVAL),
        "max_catchup_ratio": getattr(policy, "max_catchup_ratio", DEFAULT_MAX_CATCHUP_RATIO),
        "source": "control object" if snap.policy is not None else "default",
    }


def describe_policy(info: dict[str, Any]) -> str:
    """One line for :func:`current_policy`'s result."""
    if info["policy"] == "adaptive":
        what = f"adaptive, anchor when catch-up would exceed {info['max_catchup_ratio']:g} anchors"
    else:
        what = f"fixed, an anchor every {info['interval']} publishes"
    return f"Anchor policy: **{what}** ({info['source']})"


def make_policy(policy: str, interval: float | None, max_catchup_ratio: float | None) -> AnchorPolicy:
    """Build a policy from form values.

    Raises:
        ValueError: invalid values (interval < 1, ratio <= 1, unknown policy).
    """
    if policy == "adaptive":
        return Adaptive(float(max_catchup_ratio if max_catchup_ratio is not None else DEFAULT_MAX_CATCHUP_RATIO))
    if policy != "fixed":
        raise ValueError(f"unknown anchor policy {policy!r}")
    if interval is None or float(interval) != int(interval):
        raise ValueError(f"anchor interval must be a whole number, got {interval!r}")
    return FixedInterval(int(interval))


def write_policy(bucket: Bucket, policy: AnchorPolicy) -> None:
    """Write the control object; the trainer picks it up at its next publish."""
    bucket.put(CONTROL_KEY, policy_to_json(policy))
    logger.info("anchor policy set to %s in %s", policy.settings(), getattr(bucket, "url", "bucket"))
