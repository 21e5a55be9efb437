"""Replay a bucket's whole retained chain and check every hash."""

from __future__ import annotations

import dataclasses
import logging

from ..bucket import Bucket
from ..errors import SyncError
from .publisher import read_manifest
from .subscriber import Subscriber

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class VerifyReport:
    """Outcome of :func:`verify_bucket`."""

    anchors_checked: int = 0
    deltas_checked: int = 0
    newest_step: int | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def verify_bucket(bucket: Bucket) -> VerifyReport:
    """Replay from the oldest retained anchor through every delta and later anchor,
    checking every file against the pointer, every anchor's content hash, every
    delta's base and result hash, and that the chain has no gap.

    Returns:
        A report; ``report.errors`` lists every problem found.
    """
    report = VerifyReport()
    manifest = read_manifest(bucket)
    if manifest is None:
        report.errors.append(f"{bucket.url}: no pointer object; nothing published")
        return report
    report.newest_step = manifest.step
    sub = Subscriber(bucket)
    sub.manifest = manifest
    try:
        sub.apply(sub._fetch_anchor(manifest.anchors[0]))
        report.anchors_checked += 1
    except SyncError as exc:
        report.errors.append(f"anchor {manifest.anchors[0].step}: {exc}")
        return report
    later = {a.step: a for a in manifest.anchors[1:]}
    replayed: dict[int, str] = {}
    try:
        for entry in manifest.deltas_since(sub.step):
            if entry.base_step != sub.step and entry.base_step in later:  # an anchor without companion delta
                sub.apply(sub._fetch_anchor(later.pop(entry.base_step)))
                report.anchors_checked += 1
            if entry.base_step != sub.step:
                report.errors.append(f"gap: delta {entry.step} is based on {entry.base_step}, replay is at {sub.step}")
                return report
            sub.apply(sub._fetch_delta(entry))
            report.deltas_checked += 1
            replayed[entry.step] = sub.state_hash or ""
        for step, anchor in sorted(later.items()):
            if step > (sub.step or -1):  # beyond the deltas: continue the replay from it
                sub.apply(sub._fetch_anchor(anchor))
            else:  # reached by deltas: its content must check out and equal the replayed state
                Subscriber(bucket)._fetch_anchor(anchor)
                if replayed.get(step) != anchor.state_hash:
                    report.errors.append(f"anchor {step} differs from the state the deltas replay to")
            report.anchors_checked += 1
    except SyncError as exc:
        report.errors.append(f"at step {sub.step}: {exc}")
        return report
    if report.ok and sub.step != manifest.step:
        report.errors.append(f"replay ended at step {sub.step}, the pointer says {manifest.step}")
    if report.ok and sub.state_hash != manifest.state_hash:
        report.errors.append("replayed state does not match the pointer's hash")
    return report
