"""Replay a bucket's whole retained chain and check every hash."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..bucket import Bucket
from ..errors import SyncError
from ..retry import RetryPolicy, call_with_retries
from .manifest import AnchorEntry, Manifest
from .run import read_manifest
from .subscriber import Subscriber

@dataclasses.dataclass
class VerifyReport:
    """Outcome of :func:`verify_bucket`."""

    anchors_checked: int = 0
    deltas_checked: int = 0
    newest_step: int | None = None
    errors: list[str] = dataclasses.field(default_factory=list)
    raced: list[str] = dataclasses.field(default_factory=list)  # replays restarted: a publish deleted files meanwhile

    @property
    def ok(self) -> bool:
        return not self.errors


MAX_ATTEMPTS = 5


class _Vanished(Exception):
    """A file of the snapshot disappeared and the current pointer no longer names it (retention)."""


def verify_bucket(
    bucket: Bucket, *, attempts: int = MAX_ATTEMPTS, on_checked: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Replay from the oldest retained anchor through every delta and later anchor,
    checking every file against the pointer, every anchor's content hash, every
    delta's base and result hash, and that the chain has no gap.

    The replay follows one snapshot of the pointer. A trainer publishing meanwhile
    may delete files of that snapshot (retention); when a file fails, the pointer is
    read again: if it no longer names the file, the replay starts over from the new
    snapshot (up to ``attempts`` times); if it still does, the failure is reported.

    Args:
        bucket: The bucket to verify.
        attempts: Replays to start before giving up on a bucket that retention keeps changing.
        on_checked: Called with ``(bytes checked so far, bytes of the snapshot)`` after each
            file (progress bars); the total grows when a replay starts over.

    Returns:
        A report; ``report.errors`` lists every problem found, ``report.raced`` the replays
        restarted because a concurrent publish deleted files.

    Raises:
        ValueError: ``attempts`` is below 1.
    """
    raced: list[str] = []

    def replay() -> VerifyReport:
        manifest = read_manifest(bucket)
        if manifest is None:
            return VerifyReport(errors=[f"{bucket.url}: no pointer object; nothing published"], raced=raced)
        try:
            return dataclasses.replace(_replay(bucket, manifest, on_checked), raced=raced)
        except _Vanished as exc:
            raced.append(str(exc))
            raise

    try:  # a replay that lost a race to retention starts over at once from the newer pointer
        return call_with_retries(
            replay, policy=RetryPolicy.at_once(attempts), retryable=_Vanished, give_up=lambda err, *_: _Vanished(str(err)),
            describe=f"verify {bucket.url} (raced a concurrent publish; replaying the newer pointer)",
        )  # fmt: skip
    except _Vanished:
        return VerifyReport(
            errors=[f"the bucket changed under every one of {attempts} replays (retention kept deleting files)"], raced=raced
        )


def _still_named(bucket: Bucket, keys: list[str]) -> bool:
    """Whether the current pointer still names any of ``keys``."""
    try:
        current = read_manifest(bucket)
    except SyncError:
        return True
    if current is None:
        return False
    named = {f.key for a in current.anchors for f in a.files} | {f.key for d in current.deltas for f in d.files}
    return any(k in named for k in keys)


def _replay(bucket: Bucket, manifest: Manifest, on_checked: Callable[[int, int], None] | None = None) -> VerifyReport:
    """One replay of ``manifest``; raises :class:`_Vanished` when retention removed a file meanwhile."""
    report = VerifyReport(newest_step=manifest.step)
    total = sum(a.nbytes for a in manifest.anchors) + sum(d.nbytes for d in manifest.deltas)
    done = 0

    def count(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if on_checked is not None:
            on_checked(done, total)
    sub = Subscriber(bucket)
    sub.chooser.manifest = manifest

    def checked(keys: list[str], action: Callable[[], object]) -> None:
        try:
            action()
        except SyncError:
            if not all(bucket.exists(k) for k in keys) and not _still_named(bucket, keys):
                raise _Vanished(f"retention deleted {keys[0]} since the replay started") from None
            raise

    def anchor(entry: AnchorEntry, apply: bool = True) -> None:
        keys = [f.key for f in entry.files]
        if apply:
            checked(keys, lambda: sub.apply(sub.chooser.anchor(entry)))
        else:
            checked(keys, lambda: Subscriber(bucket).chooser.anchor(entry))
        report.anchors_checked += 1
        count(entry.nbytes)

    try:
        anchor(manifest.anchors[0])
    except SyncError as exc:
        report.errors.append(f"anchor {manifest.anchors[0].step}: {exc}")
        return report
    later = {a.step: a for a in manifest.anchors[1:]}
    replayed: dict[int, str] = {}
    try:
        for entry in manifest.deltas_since(sub.step):
            if entry.base_step != sub.step and entry.base_step in later:  # an anchor without companion delta
                anchor(later.pop(entry.base_step))
            if entry.base_step != sub.step:
                report.errors.append(f"gap: delta {entry.step} is based on {entry.base_step}, replay is at {sub.step}")
                return report
            checked([f.key for f in entry.files], lambda entry=entry: sub.apply(sub.chooser.delta(entry)))
            report.deltas_checked += 1
            count(entry.nbytes)
            replayed[entry.step] = sub.state_hash or ""
        for step, entry in sorted(later.items()):
            if step > (sub.step or -1):  # beyond the deltas: continue the replay from it
                anchor(entry)
            else:  # reached by deltas: its content must check out and equal the replayed state
                anchor(entry, apply=False)
                if replayed.get(step) != entry.state_hash:
                    report.errors.append(f"anchor {step} differs from the state the deltas replay to")
    except SyncError as exc:
        report.errors.append(f"at step {sub.step}: {exc}")
        return report
    if report.ok and sub.step != manifest.step:
        report.errors.append(f"replay ended at step {sub.step}, the pointer says {manifest.step}")
    if report.ok and sub.state_hash != manifest.state_hash:
        report.errors.append("replayed state does not match the pointer's hash")
    return report
