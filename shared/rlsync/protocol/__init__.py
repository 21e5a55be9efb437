"""The bucket protocol: publisher, subscriber, anchor policies, retention, pointer."""

from ..errors import FencedError, NonFiniteError, RunExistsError, RunLockedError
from ..layout import CONTROL_KEY, LOCK_KEY, POINTER_KEY, anchor_folder, delta_key
from .lock import read_lock
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest
from .policy import (
    Adaptive,
    AnchorPolicy,
    FixedInterval,
    policy_from_json,
    policy_from_settings,
    policy_names,
    policy_to_json,
)
from .publisher import Publisher, PublishRecord
from .retention import prune, sweep_orphans
from .run import read_manifest
from .subscriber import Subscriber
from .update import Update
from .held import SubscriberStats

__all__ = [
    "CONTROL_KEY",
    "LOCK_KEY",
    "FencedError",
    "RunLockedError",
    "read_lock",
    "POINTER_KEY",
    "Adaptive",
    "AnchorEntry",
    "AnchorPolicy",
    "DeltaEntry",
    "FileEntry",
    "FixedInterval",
    "Manifest",
    "NonFiniteError",
    "PublishRecord",
    "Publisher",
    "RunExistsError",
    "Subscriber",
    "SubscriberStats",
    "Update",
    "anchor_folder",
    "delta_key",
    "policy_from_json",
    "policy_from_settings",
    "policy_names",
    "policy_to_json",
    "prune",
    "read_manifest",
    "sweep_orphans",
]
