"""What the owner wants running: one small object per role and Space (``control/desired/<role>/<instance>.json``).

A Space restarts on a hardware change, an update or after sleeping, and its container's memory is gone. Start
and Stop on a panel record here whether the owner wants the role running, with the settings Start was given;
at boot (:func:`rlsync.spaces.restarts.resume_at_boot`) a role recorded ``running`` starts again by itself, with
those settings. A stop that the owner did not ask for (the runtime's SIGTERM before a restart) records nothing,
so the role comes back.

The object is read from the bucket, so it is untrusted like every other: bounded in size, parsed strictly,
every setting checked against its field's type (unknown fields, wrong types, non-finite numbers are refused),
and its ``bucket`` setting must be the bucket it was read from (a planted object cannot send the role to
another bucket). A refused object is logged and counted, and the role stays stopped.

The instance is the Space (``SPACE_ID``, e.g. ``alice/rl-sync-rollout`` as ``alice--rl-sync-rollout``; off a
Space the host name), so two duplicates of one role on one bucket each keep their own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import math
import time
import typing
from typing import Any

from ..bucket import Bucket, open_bucket
from ..errors import BucketError, FormatError, ObjectNotFoundError, ObjectTooLargeError
from ..jsonlimits import loads_bounded
from ..layout import desired_key
from ..limits import MAX_DESIRED_BYTES
from ..roles import Role
from .settings import instance_id

__all__ = [
    "Wanted", "DesiredState", "REFUSED", "settings_of", "write_desired", "read_desired", "record_wanted",
    "config_from_desired",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: The longest string setting accepted.
MAX_SETTING_CHARS = 4096
#: Desired-state objects refused (malformed, oversized, hostile), counted for the panels and tests.
REFUSED: collections.Counter[str] = collections.Counter()


class Wanted(enum.StrEnum):
    """What the owner asked for last."""

    RUNNING = "running"
    STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class DesiredState:
    """One role's desired state on one Space.

    Args:
        role: The role.
        wanted: Running or stopped.
        settings: The settings Start was given (field name to a JSON scalar); empty for a stop.
        at: When it was recorded (Unix seconds).
    """

    role: Role
    wanted: Wanted
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    at: float = 0.0

    def to_json(self) -> bytes:
        doc = {"role": self.role.value, "wanted": self.wanted.value, "settings": self.settings, "at": self.at}
        return json.dumps(doc, sort_keys=True).encode()


def settings_of(config: Any) -> dict[str, Any]:
    """The scalar fields of a role's config dataclass (what a Start records)."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) is None or type(getattr(config, f.name)) in (bool, int, float, str)
    }


def write_desired(bucket: Bucket, role: Role, wanted: Wanted, config: Any = None, instance: str | None = None) -> None:
    """Record what the owner wants of ``role`` on this Space (``config``: the settings Start was given).

    Raises:
        BucketError: the write failed.
    """
    state = DesiredState(Role(role), Wanted(wanted), settings_of(config) if config is not None else {}, time.time())
    bucket.put(desired_key(role, instance or instance_id()), state.to_json())


def record_wanted(role: Role, wanted: Wanted, config: Any, objects: typing.Sequence[Any] = ()) -> None:
    """What a panel's Start (``running``, with ``config``) or Stop records: written through the bucket of the role's
    objects, else the one ``config`` names (opened without creating it). A failure is logged, never raised: the
    role runs or stops all the same.

    Args:
        role: The role.
        wanted: What the owner asked for.
        config: The role's settings dataclass (anything else, or one without a ``bucket``: nothing is recorded).
        objects: The role's objects (their ``bucket``).
    """
    if not dataclasses.is_dataclass(config):
        return
    bucket = next((o.bucket for o in objects if isinstance(getattr(o, "bucket", None), Bucket)), None)
    url = getattr(config, "bucket", None)
    opened = None
    try:
        if bucket is None and isinstance(url, str):
            bucket = opened = open_bucket(url, create=False)
        if bucket is not None:
            write_desired(bucket, role, wanted, config if wanted is Wanted.RUNNING else None)
    except BucketError as exc:
        logger.warning("%s: could not record %s in the bucket (a restart will not know it): %s", role, wanted, exc)
    finally:
        if opened is not None:
            getattr(opened, "close", lambda: None)()


def read_desired(bucket: Bucket, role: Role, instance: str | None = None) -> DesiredState | None:
    """The recorded desired state of ``role`` on this Space (``None``: nothing recorded).

    Raises:
        FormatError: the object is too large, not JSON, or not a desired state of ``role``.
        BucketError: the read failed.
    """
    key = desired_key(role, instance or instance_id())
    try:
        data = bucket.get_limited(key, MAX_DESIRED_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectTooLargeError as exc:
        raise FormatError(f"{key}: {exc}") from None
    doc = loads_bounded(data, what=key, max_bytes=MAX_DESIRED_BYTES, max_depth=3)
    if not isinstance(doc, dict) or set(doc) != {"role", "wanted", "settings", "at"}:
        raise FormatError(f"{key} is not a desired-state object")
    if doc["role"] != Role(role).value or doc["wanted"] not in tuple(Wanted) or not isinstance(doc["settings"], dict):
        raise FormatError(f"{key}: another role, an unknown state or settings that are not an object")
    if type(doc["at"]) not in (int, float) or not math.isfinite(doc["at"]):
        raise FormatError(f"{key}: invalid time {doc['at']!r}")
    return DesiredState(Role(role), Wanted(doc["wanted"]), doc["settings"], float(doc["at"]))


def config_from_desired(base: Any, settings: dict[str, Any], bucket_url: str) -> Any:
    """``base`` (the role's config from its environment) with the recorded settings, each checked.

    Args:
        base: The role's config dataclass.
        settings: The recorded settings (untrusted).
        bucket_url: The bucket they were read from: a recorded ``bucket`` must name it.

    Raises:
        FormatError: an unknown field, a value not of its field's type (or a non-finite number, a string over
            :data:`MAX_SETTING_CHARS`), another bucket, or values the config refuses.
    """
    hints = typing.get_type_hints(type(base))
    names = {f.name for f in dataclasses.fields(base)}
    changes = {}
    for name, value in settings.items():
        if name not in names:
            raise FormatError(f"unknown setting {name!r}")
        changes[name] = _checked(name, value, hints[name])
    if "bucket" in changes and changes["bucket"] != bucket_url:
        raise FormatError(f"the recorded bucket {changes['bucket']!r} is not the bucket it was read from")
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"the recorded settings are refused: {exc}") from None


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` if it is of the type ``hint`` names (``X | None`` takes ``None``), else :class:`FormatError`."""
    args = typing.get_args(hint)
    if value is None and type(None) in args:
        return None
    kind = next((a for a in args if a is not type(None)), hint)
    ok = (
        (kind is bool and type(value) is bool)
        or (kind is int and type(value) is int)
        or (kind is float and type(value) in (int, float) and math.isfinite(value))
        or (kind is str and type(value) is str and len(value) <= MAX_SETTING_CHARS)
    )
    if not ok:
        raise FormatError(f"setting {name!r}: {value!r:.80} is not a valid {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value
