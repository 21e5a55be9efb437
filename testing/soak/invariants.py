"""What every trial checks: a :class:`TrialResult` per trial, the :class:`Ledger` of published
versions and object digests (no version lost, reused or skipped, no object rewritten, no replica
serving a mix of versions), ``verify_bucket`` and a checked subscriber sync."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading

import torch

from rlsync.bucket import LocalBucket
from rlsync.errors import BucketError, FormatError, SyncError
from rlsync.hashing import state_hash
from rlsync.protocol import Manifest, Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket

logger = logging.getLogger("testing.soak")


@dataclasses.dataclass
class TrialResult:
    """What one trial injected and found.

    Attributes:
        kind: The trial kind.
        faults: Faults injected, by name.
        lost: Published versions that were lost (a restarted publisher resumed
            below them, or an object the pointer still named vanished or changed).
        violations: Invariant violations, described.
        checks: Invariant checks that ran.
        notes: Things observed that are not faults nor violations (e.g. temporary files a killed writer left).
        seconds: Wall time.
    """

    kind: str
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lost: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    checks: int = 0
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        logger.error("%s: %s", self.kind, message)
        self.violations.append(message)

    def check(self, ok: bool, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.fail(message)
        return ok


class Ledger:
    """What the bucket published, as observed: version -> state hash, and each named object's sha256.

    Args:
        result: Where violations are reported.
    """

    def __init__(self, result: TrialResult) -> None:
        self.result = result
        self.versions: dict[int, str] = {}
        self.objects: dict[str, str] = {}
        self.pending: list[tuple[int, str, str]] = []
        self.lock = threading.Lock()

    def record(self, step: int, digest: str, where: str) -> None:
        """Record that ``step`` was published with ``digest``; a different hash for a known step is a reused version."""
        with self.lock:
            known = self.versions.setdefault(step, digest)
        if known != digest:
            self.result.lost += 1
            self.result.fail(f"version {step} published twice with different states ({where})")

    def observe(self, bucket: LocalBucket, *, expect_intact: bool = True) -> Manifest | None:
        """Read the pointer; record its versions and the sha256 of every object it names.

        With ``expect_intact``, a named object that is missing, of another size
        than the pointer says, or whose bytes changed since it was first seen is
        a violation (and a lost version).
        """
        try:
            manifest = read_manifest(bucket)
        except FormatError as exc:
            self.result.fail(f"pointer unreadable: {exc}")
            return None
        if manifest is None:
            return None
        self.result.checks += 1
        for entry in manifest.anchors:
            self.record(entry.step, entry.state_hash, "pointer")
        for delta in manifest.deltas:
            self.record(delta.step, delta.state_hash, "pointer")
        files = [(a.step, f) for a in manifest.anchors for f in a.files] + [(d.step, d.file) for d in manifest.deltas]
        for step, f in files:
            try:
                data = bucket.get(f.key)
            except BucketError:
                if expect_intact:
                    self.result.lost += 1
                    self.result.fail(f"{f.key} (version {step}) is named by the pointer but missing")
                continue
            digest = hashlib.sha256(data).hexdigest()
            with self.lock:
                first = self.objects.setdefault(f.key, digest)
            if expect_intact and (first != digest or len(data) != f.size):
                self.result.lost += 1
                self.result.fail(f"{f.key} (version {step}) changed after the pointer named it")
        return manifest

    def check_state(self, step: int | None, tensors: dict[str, torch.Tensor], claimed: str | None, where: str) -> None:
        """A subscriber's state must be exactly a published version: recomputed hash == published hash of its step."""
        if step is None:
            self.result.check(not tensors, f"{where}: holds tensors but no version")
            return
        actual = state_hash(tensors)
        self.check_hash(step, actual, claimed, where)

    def check_hash(self, step: int, actual: str, claimed: str | None, where: str) -> None:
        """Check a state seen at ``step``; a version not recorded yet (a reader can see the pointer
        before the publisher's call returns) is checked by :meth:`settle`."""
        with self.lock:
            published = self.versions.get(step)
            if published is None:
                self.pending.append((step, actual, where))
        self.result.check(claimed == actual, f"{where}: claims hash {str(claimed)[:12]} at {step}, holds {actual[:12]}")
        if published is not None:
            self._compare(step, actual, published, where)

    def _compare(self, step: int, actual: str, published: str | None, where: str) -> None:
        self.result.check(
            published == actual,
            f"{where}: serves step {step} with hash {actual[:12]}, published {str(published)[:12]} (a mix or a fork)",
        )

    def settle(self) -> None:
        """Check the states seen before their version was recorded (call once publishing is over)."""
        with self.lock:
            pending, self.pending = self.pending, []
        for step, actual, where in pending:
            self._compare(step, actual, self.versions.get(step), where)


def check_verified(bucket: LocalBucket, result: TrialResult, where: str) -> None:
    """Record a ``verify_bucket`` check of ``bucket`` in ``result``."""
    report = verify_bucket(bucket)
    result.check(report.ok, f"verify_bucket failed {where}: {report.errors}")


def checked_sync(sub: Subscriber, ledger: Ledger, where: str, rounds: int = 50) -> int:
    """Fetch and apply until nothing changes, checking the whole state after every apply, and that
    every refused update left the state exactly as it was.

    Returns:
        Updates refused.
    """
    refused = 0
    for _ in range(rounds):
        before = (sub.step, sub.state_hash, state_hash(sub.state))
        try:
            update = sub.fetch()
            if update is None:
                break
            sub.apply(update)
        except SyncError:
            refused += 1
            ledger.result.check(
                (sub.step, sub.state_hash, state_hash(sub.state)) == before,
                f"{where}: a refused update changed the state",
            )
            break
        ledger.check_state(sub.step, sub.state, sub.state_hash, where)
    return refused
