"""Which update a subscriber fetches next, and refusing what does not follow.

From where the held state stands and the pointer, the next update is a delta based on the state,
the newest anchor newer than it, or none (up to date). A pointer that goes back, names the
state's step with another state, or whose chain metadata or format differs is refused.

An update whose object is gone because retention dropped it after the subscriber read
the pointer (a reader slowed by pacing or retries while the trainer published on) is
not refused: the subscriber reads the pointer again and, when it no longer names that
version, continues from it (the newer anchor). On a missing object the pointer still
names, a truncated or corrupt delta, or a hash mismatch, the subscriber
refuses the update, keeps its last good state, and resynchronises from the next
pointer it can verify: an anchor newer than its state, or, once the pointer has
changed since the refusal (e.g. a replayed old pointer was replaced by the genuine
one), a delta based on exactly its state (base and result hashes checked).
"""

from __future__ import annotations

import logging
from typing import Mapping

from ..errors import ChainError, FormatError, MissingUpdateError, SyncError
from ..format import check_version
from .fetcher import UpdateFetcher
from .held import HeldState, SubscriberStats
from .manifest import AnchorEntry, DeltaEntry, Manifest
from .update import Update

__all__ = ["UpdateChooser"]

logger = logging.getLogger(__name__)


class UpdateChooser:
    """Chooses a subscriber's next update from the pointer, has the fetcher download it, and refuses
    what does not follow (counted in ``stats``; the subscriber then waits for a pointer it can verify).

    Its callers hold :attr:`HeldState.lock <rlsync.protocol.held.HeldState.lock>`.

    Args:
        fetcher: Reads the pointer and downloads and verifies updates.
        held: The state the updates must follow.
        stats: The subscriber's counters.
        expect_metadata: Pointer metadata entries the chain must carry.

    Attributes:
        manifest: The pointer last read (``None`` before the first one).
        expect_metadata: Pointer metadata entries the chain must carry.
    """

    def __init__(
        self, fetcher: UpdateFetcher, held: HeldState, stats: SubscriberStats, expect_metadata: Mapping[str, str] | None = None
    ) -> None:
        self._fetcher, self._held, self._stats = fetcher, held, stats
        self.expect_metadata = dict(expect_metadata or {})
        self.manifest: Manifest | None = None
        self._announced_run: str | None = None
        self._refused_at: tuple[int, str] | None = None  # the pointer (step, hash) when an update was refused

    def read_manifest(self) -> Manifest | None:
        """Read the pointer; ``None`` before the first publish."""
        if (manifest := self._fetcher.read_manifest()) is not None:
            self.manifest = manifest
        return manifest

    def next(self, again: bool = True) -> Update | None:
        """The next update, fetched and verified; ``None`` when there is none to apply (see the module docstring).
        With `again`, an update retention dropped meanwhile is looked for again in the new pointer."""
        manifest, held = self.read_manifest(), self._held
        if manifest is None:
            return None
        wrong = {k: manifest.metadata.get(k) for k, v in self.expect_metadata.items() if manifest.metadata.get(k) != v}
        if wrong:
            raise self.refuse(ChainError(f"the chain's metadata {wrong} differs from this subscriber's {self.expect_metadata}"))
        try:
            check_version(manifest.format_version, "chain")
        except FormatError as exc:
            raise self.refuse(exc) from None
        if held.rebootstrap:  # the weights are not the verified state: only an anchor can repair them
            return self.anchor(manifest.anchors[-1], again)
        if manifest.step == held.step:
            if manifest.state_hash == held.state_hash:
                held.resync = False  # the pointer names exactly this state again
            elif not held.resync:  # same step, other state: a fork
                raise self.refuse(ChainError(f"the pointer names step {held.step} with another state than this one"))
            return None
        if held.step is not None and manifest.step < held.step:
            raise self.refuse(ChainError(f"pointer went back from {held.step} to {manifest.step}"))
        run_changed = held.step is not None and manifest.run_id != held.run_id
        if run_changed and self._announced_run != manifest.run_id:  # one line per new run, not per poll
            self._announced_run = manifest.run_id
            logger.warning(
                "the bucket's run changed from %r (version %d) to %r (version %d): re-bootstrapping from its newest anchor",
                held.run_id, held.step, manifest.run_id, manifest.step,
            )  # fmt: skip
        entry = manifest.delta_after(held.step) if held.step is not None and not run_changed else None
        if entry is not None and not held.resync:
            return self.delta(entry, again)
        newer = [a for a in manifest.anchors if held.step is None or a.step > held.step]
        if newer:
            return self.anchor(newer[-1], again)
        if not held.resync:
            raise self.refuse(ChainError(f"no retained delta or anchor continues step {held.step}"))
        if entry is not None and self._refused_at != (manifest.step, manifest.state_hash):
            # a pointer changed since the refusal: verified by its base and result hashes
            return self.delta(entry, again)
        return None

    def delta(self, entry: DeltaEntry, again: bool = False) -> Update | None:
        """The delta `entry`, fetched and verified (`again`: as in :meth:`next`); refused if it fails."""
        try:
            return self._fetcher.delta(entry)
        except SyncError as exc:
            if again and isinstance(exc, MissingUpdateError) and self._dropped(entry):
                return self.next(again=False)
            raise self.refuse(exc) from None

    def anchor(self, entry: AnchorEntry, again: bool = False) -> Update | None:
        """The anchor `entry`, fetched and verified (`again`: as in :meth:`next`); refused if it fails."""
        try:
            self._fetcher.check_size("anchor", entry.step, entry.nbytes)
        except FormatError as exc:
            raise self.refuse(exc, wait=False)
        try:
            return self._fetcher.anchor(entry, self.manifest.run_id if self.manifest else "")
        except SyncError as exc:
            if again and isinstance(exc, MissingUpdateError) and self._dropped(entry):
                return self.next(again=False)
            logger.error("refused anchor %d: %s", entry.step, exc)
            raise self.refuse(exc, wait=False)

    def _dropped(self, entry: DeltaEntry | AnchorEntry) -> bool:
        """Whether the pointer, read again, no longer names `entry`: retention dropped it while it was being
        read (one pointer read; an object the pointer still names is missing for real)."""
        manifest = self.read_manifest()
        if manifest is None or entry in (manifest.deltas if isinstance(entry, DeltaEntry) else manifest.anchors):
            return False
        logger.info("%s %d was dropped by retention while it was read: continuing from the pointer of step %d",
                    "delta" if isinstance(entry, DeltaEntry) else "anchor", entry.step, manifest.step)  # fmt: skip
        return True

    def refuse(self, error: SyncError, *, wait: bool = True) -> SyncError:
        """Count ``error``; with ``wait``, log it and wait for a pointer it can verify (see the module docstring)."""
        if wait:
            self._held.resync = True
            if self.manifest is not None:
                self._refused_at = (self.manifest.step, self.manifest.state_hash)
            logger.error("refused update: %s; keeping step %s until a pointer it can verify", error, self._held.step)
        self._stats.refused += 1
        self._stats.last_error = str(error)
        return error
