"""What the hostile-object trials share: bystander objects outside the publisher's prefixes that
nothing the publisher, its retention or its sweep does may touch (issue 26: 0 files touched outside
the run's prefixes), and one publish followed by a replica, where a trainer that dies or a replica
holding non-finite weights is a violation."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import torch

from rlsync.bucket import LocalBucket
from rlsync.errors import SyncError
from rlsync.protocol import Publisher, Subscriber

from .invariants import Ledger, TrialResult, checked_sync

#: Keys other roles own, and an old temporary-looking file outside the publisher's prefixes.
BYSTANDER_KEYS = ("control/other.json", "tasks/000000000001.json", "scores/000000000001.json",
                  "metrics/env.json", "status/replica-x.json", "user/.tmp-0123456789ab")  # fmt: skip
OLD_S = 7 * 3600.0  # older than the publisher's 6 h sweep age


def plant_bystanders(bucket: LocalBucket, rng: random.Random) -> dict[str, str]:
    """Write the bystander objects (aged past the sweep) and return their digests by path."""
    for key in BYSTANDER_KEYS:
        path = bucket.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(1, 64)))
        past = path.stat().st_mtime - OLD_S
        os.utime(path, (past, past))
    return digests(bucket)


def digests(bucket: LocalBucket) -> dict[str, str]:
    """sha256 of every bystander file that exists."""
    out = {}
    for key in BYSTANDER_KEYS:
        path: Path = bucket.root / key
        if path.exists():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def check_bystanders(bucket: LocalBucket, before: dict[str, str], result: TrialResult) -> None:
    """Every bystander is still there with the same bytes."""
    after = digests(bucket)
    touched = sorted(k for k in before if after.get(k) != before[k])
    result.notes["bystander files checked"] += len(before)
    result.check(not touched, f"files outside the run's prefixes were touched: {touched}")


def check_finite(state: dict[str, torch.Tensor], result: TrialResult, where: str) -> None:
    """A replica's state has no NaN or Inf (the toy model's weights are all finite)."""
    bad = [n for n, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    result.check(not bad, f"{where}: non-finite published weights in {bad[:3]}")


def publish_and_follow(
    pub: Publisher, step: int, master: dict[str, torch.Tensor], ledger: Ledger, follower: Subscriber
) -> bool:
    """Publish ``step``, record it, sync ``follower`` and check its weights are finite.

    Returns:
        False when the publish raised (the trainer would have died; a violation is recorded).
    """
    try:
        rec = pub.publish(step, master)
    except SyncError as exc:
        ledger.result.fail(f"the trainer died at step {step}: {type(exc).__name__}: {exc}")
        return False
    ledger.record(rec.step, rec.state_hash, "publisher")
    checked_sync(follower, ledger, "follower")
    check_finite(follower.state, ledger.result, "follower")
    return True
