"""The bucket protocol: publisher, subscriber, anchor policies, retention, pointer."""

from .lock import LOCK_KEY, FencedError, RunLockedError, read_lock
from .manifest import (
    CONTROL_KEY,
    POINTER_KEY,
    AnchorEntry,
    DeltaEntry,
    FileEntry,
    Manifest,
    anchor_folder,
    delta_key,
)
from .policy import Adaptive, AnchorPolicy, FixedInterval, policy_from_json, policy_from_settings, policy_to_json
from .publisher import NonFiniteError, PublishRecord, Publisher, RunExistsError, read_manifest
from .retention import prune, sweep_orphans
from .subscriber import Subscriber, SubscriberStats, Update

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
    "policy_to_json",
    "prune",
    "read_manifest",
    "sweep_orphans",
]
