"""The anchor policy as the panels control it: the policy in force, its description, building
and writing a new one into the bucket's control object, and :class:`ControlledPolicy`, the
trainer's side, which follows that object at every publish."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from ..bucket import Bucket
from ..errors import ConfigurationError, FormatError, ObjectNotFoundError, ObjectTooLargeError
from ..layout import CONTROL_KEY
from ..limits import MAX_CONTROL_BYTES
from ..protocol import AnchorPolicy, Manifest, policy_from_json, policy_to_json
from ..protocol.policy import DEFAULT_POLICY, policy_class, policy_from_form, policy_names
from .snapshots import Snapshot

logger = logging.getLogger(__name__)


def current_policy(snap: Snapshot, default: AnchorPolicy | None = None) -> dict[str, Any]:
    """The anchor policy in force at the next publish.

    Returns:
        ``{"policy", "description", "source", <setting>: value, ...}``: the value of every registered
        policy's settings (the policy in force's own, the others' defaults), so a form shows them all;
        ``source`` is ``"control object"`` or ``"default"`` (the trainer's own setting applies).
    """
    policy = snap.policy or default or policy_class(DEFAULT_POLICY)()
    values = {f.name: f.default for f in setting_fields()}
    values.update({k: v for k, v in policy.settings().items() if k != "policy"})
    return {
        "policy": policy.name, "description": policy.describe(),
        "source": "control object" if snap.policy is not None else "default", **values,
    }  # fmt: skip


def describe_policy(info: dict[str, Any]) -> str:
    """One line for :func:`current_policy`'s result."""
    return f"Anchor policy: **{info['description']}** ({info['source']})"


def setting_fields() -> list[dataclasses.Field]:
    """The settings of every registered policy, in registry order (a form shows one input each)."""
    seen: dict[str, dataclasses.Field] = {}
    for name in policy_names():
        for field in policy_class(name).setting_fields():
            seen.setdefault(field.name, field)
    return list(seen.values())


def make_policy(policy: str, values: dict[str, Any]) -> AnchorPolicy:
    """Build a policy from form values (:func:`~rlsync.protocol.policy.policy_from_form`).

    Raises:
        ConfigurationError: invalid values (e.g. interval < 1, ratio <= 1, unknown policy).
    """
    try:
        return policy_from_form(policy, values)
    except FormatError as exc:
        raise ConfigurationError(str(exc)) from None


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

    def describe(self) -> str:
        return self.policy.describe()
