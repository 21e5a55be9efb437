"""A replica's id is its own: before a replica starts, a live status object of its id written by another host
refuses the start (:func:`check_replica_id`).

Two replicas of one id (a duplicated Space keeping the template's ``ROLLOUT_REPLICA_ID``) would write the same
``rollouts/<batch>/<replica>.json`` objects with different contents and one status object, and the fleet table
would show one replica. A status is live while it is younger than :data:`LIVE_INTERVALS` status intervals (at least
:data:`MIN_LIVE_S`); its writer is the host it names (:func:`~rlsync.spaces.settings.space_owner`: the Space's id,
kept across restarts, else the host name), so a restarted Space takes its own id back at once.
"""

from __future__ import annotations

import time

from rlsync.bucket import Bucket
from rlsync.errors import ReplicaIdInUseError
from rlsync.layout import status_key
from rlsync.spaces.metrics import read_status

#: A status object is live for this many of the replica's status intervals.
LIVE_INTERVALS = 3
#: ... and at least this many seconds.
MIN_LIVE_S = 60.0


def check_replica_id(bucket: Bucket, replica_id: str, host: str, status_every_s: float, now: float | None = None) -> None:
    """Refuse ``replica_id`` when ``status/<replica_id>.json`` is live and written by another host.

    Args:
        bucket: The run's bucket.
        replica_id: The id this replica would write under.
        host: This replica's host (:func:`~rlsync.spaces.settings.space_owner`).
        status_every_s: Seconds between status writes (the replica's setting): sets how long a status is live.
        now: The time (default: ``time.time()``).

    Raises:
        ReplicaIdInUseError: another host's replica of this id wrote its status within the live window (a
            timestamp in the future counts as live for as long).
    """
    status = read_status(bucket, status_key(replica_id))
    if status is None or not status.host or status.host == host or status.updated_at is None:
        return
    age = (time.time() if now is None else now) - status.updated_at
    live_s = max(LIVE_INTERVALS * status_every_s, MIN_LIVE_S)
    if abs(age) < live_s:
        raise ReplicaIdInUseError(
            f"replica id {replica_id!r} is in use: status/{replica_id}.json was written {age:.0f}s ago by "
            f"{status.host!r}, not by this host ({host!r}). Set ROLLOUT_REPLICA_ID to an id of its own (or delete it: "
            "on a Space it defaults to the Space's id), or wait until that replica has been stopped for "
            f"{live_s:.0f}s"
        )
