"""The anchor policy as the panels control it: the policy in force, its description, building
and writing a new one into the bucket's control object, and :class:`ControlledPolicy`, the
trainer's side, which follows that object at every publish."""

from __future__ import annotations

import collections
import logging
from typing import Any

from ..bucket import Bucket
from ..defaults import DEFAULT_ANCHOR_INTERVAL, DEFAULT_MAX_CATCHUP_RATIO
from ..errors import FormatError, ObjectNotFoundError, ObjectTooLargeError
from ..layout import CONTROL_KEY
from ..limits import MAX_CONTROL_BYTES
from ..protocol import Adaptive, AnchorPolicy, FixedInterval, Manifest, policy_from_json, policy_to_json
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


class ControlledPolicy(AnchorPolicy):
    """The policy the panels set: re-reads the bucket's control object at every decision, so any panel
    changes the anchor policy of a running trainer at its next publish.

    A missing control object means ``default``; an invalid one (too large, not a policy's settings)
    is ignored, logged and counted in ``refused``, and the policy in force stays.

    Args:
        bucket: The run's bucket.
        default: The trainer's own policy, in force until a control object says otherwise.
        refused: Where invalid control objects are counted (by key); default a counter of its own.
    """

    name = "controlled"

    def __init__(
        self, bucket: Bucket, default: AnchorPolicy, refused: collections.Counter[str] | None = None
    ) -> None:
        self.bucket = bucket
        self.policy = default
        self.refused = refused if refused is not None else collections.Counter()

    def refresh(self) -> AnchorPolicy:
        """Read the control object; returns the policy in force now."""
        try:
            policy = policy_from_json(self.bucket.get_limited(CONTROL_KEY, MAX_CONTROL_BYTES))
        except ObjectNotFoundError:
            return self.policy
        except (ObjectTooLargeError, FormatError) as exc:
            self.refused[CONTROL_KEY] += 1
            logger.warning("ignoring invalid control object (policy stays %s): %s", self.policy.settings(), exc)
            return self.policy
        if policy != self.policy:
            logger.info("anchor policy now %s", policy.settings())
            self.policy = policy
        return self.policy

    def wants_anchor(self, manifest: Manifest) -> bool:
        return self.refresh().wants_anchor(manifest)

    def settings(self) -> dict[str, Any]:
        return self.policy.settings()
