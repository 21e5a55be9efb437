"""The subscriber: a replica's side of the bucket protocol.

A subscriber bootstraps from the newest anchor, then applies the deltas after
it in order. Work is split in two so that a replica can keep generating while
an update downloads:

* :meth:`Subscriber.fetch` downloads, decodes and verifies the next update
  without touching the state: sizes, format, names, shapes, dtypes, indices, and
  the state hash. For a delta that is the current hash updated with the changed
  elements (their old bits gathered from the state, their new bits from the delta:
  O(changed), see :mod:`rlsync.hashing`), compared with the hash the trainer
  published; for an anchor, the hash of its tensors in one pass;
* :meth:`Subscriber.apply` writes it (the only step that needs generation
  paused): a delta's scatter of the changed elements, an anchor's copy. Nothing
  else runs in the pause; a scatter that fails half-way is undone from the old
  values of the changed elements.

The state is either the subscriber's own or, with ``weights``, an engine's own
serving tensors, written in place: then a replica keeps no second copy of the
model. Because a delta is checked against the hash the subscriber maintains, not
against a re-hash of the weights, :meth:`Subscriber.verify_weights` re-hashes the
actual weights in full, off the critical path (a replica runs it in the
background); a mismatch (memory corruption, a writer outside the protocol) is
counted, and the subscriber re-bootstraps from the newest anchor.

A sharded trainer's update has one file per rank: the files download
concurrently (at most ``max_parallel_downloads`` at a time) and are validated
and merged in the pointer's order.

An update whose object is gone because retention dropped it after the subscriber read
the pointer (a reader slowed by pacing or retries while the trainer published on) is
not refused: the subscriber reads the pointer again and, when it no longer names that
version, continues from it (the newer anchor). On a missing object the pointer still
names, a truncated or corrupt delta, or a hash mismatch, the subscriber
refuses the update, keeps its last good state, and resynchronises from the next
pointer it can verify: an anchor newer than its state, or, once the pointer has
changed since the refusal (e.g. a replayed old pointer was replaced by the genuine
one), a delta based on exactly its state (base and result hashes checked). Applying
a delta twice is refused.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Mapping, MutableMapping

import torch

from ..aliases import with_aliases
from ..bucket import Bucket
from ..errors import ChainError, FormatError, MissingUpdateError, SyncError
from ..format import check_version
from ..hashing import StateLanes
from .applier import UpdateApplier
from .fetcher import SCRATCH_PREFIX, UpdateFetcher
from .held import HeldField, HeldState, SubscriberStats
from .manifest import AnchorEntry, DeltaEntry, Manifest
from .rehash import WeightsRehash
from .update import Update

__all__ = ["SCRATCH_PREFIX", "Subscriber", "SubscriberStats", "Update"]

DEFAULT_MAX_PARALLEL_DOWNLOADS = 8

logger = logging.getLogger(__name__)


class Subscriber:
    """Follows a bucket and keeps a state (its own, or an engine's weights) bit-exact to the published one.

    It chooses the next update and refuses what does not follow; its parts do the work, over one
    :class:`~.held.HeldState`: an :class:`~.fetcher.UpdateFetcher` before the pause, an
    :class:`~.applier.UpdateApplier` in it, a :class:`~.rehash.WeightsRehash` in the background.

    Args:
        bucket: The bucket to follow (read access is enough).
        device: Where the state's tensors live.
        workdir: Scratch folder for anchor downloads (default: a temporary folder); scratch
            folders older than ``SCRATCH_MAX_AGE_S`` there (left by killed processes) are removed.
        max_parallel_downloads: Files of one update downloaded at once.
        expect_metadata: Pointer metadata entries the chain must carry (e.g. an adapter chain's
            base model hash); a chain whose metadata disagrees is refused before any download.
        weights: Tensors to keep in sync in place, by name: an engine's own serving weights
            (contiguous; tied names may share one storage). Anchors are copied into them and
            deltas scattered into them, so no second copy of the model exists; every anchor
            must name all of them. Default: the subscriber holds a state of its own on ``device``.
        check_values: Called with each tensor an anchor would load and the new values of each
            patch a delta would write (name, 1-D values), after decoding and before anything is
            applied; raising :class:`~rlsync.errors.FormatError` refuses the update (e.g. an FP8
            chain's scales, :func:`rlsync.fp8.check_fp8_values`).
        max_state_bytes: The largest state accepted before the first one (e.g. the serving
            engine's model size); ``None``: no bound but the pointer's own until then. Updates
            are bounded by the state's size from then on.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        device: str | torch.device = "cpu",
        workdir: str | Path | None = None,
        max_parallel_downloads: int = DEFAULT_MAX_PARALLEL_DOWNLOADS,
        expect_metadata: Mapping[str, str] | None = None,
        weights: MutableMapping[str, torch.Tensor] | None = None,
        check_values: Callable[[str, torch.Tensor], None] | None = None,
        max_state_bytes: int | None = None,
    ) -> None:
        self.expect_metadata = dict(expect_metadata or {})
        self.stats = SubscriberStats()
        self.manifest: Manifest | None = None
        self._held = held = HeldState()
        self._fetcher = UpdateFetcher(
            bucket, held, self.stats, workdir=workdir, max_parallel_downloads=max_parallel_downloads,
            weights=weights, check_values=check_values, max_state_bytes=max_state_bytes,
        )  # fmt: skip
        self._rehash = WeightsRehash(held, self.stats)
        self._applier = UpdateApplier(held, self.stats, self._rehash, weights=weights, device=torch.device(device))
        self._announced_run: str | None = None
        self._refused_at: tuple[int, str] | None = None  # the pointer (step, hash) when an update was refused

    @property
    def bucket(self) -> Bucket:
        """The bucket followed (may be replaced by another holding the same chain)."""
        return self._fetcher.bucket

    @bucket.setter
    def bucket(self, bucket: Bucket) -> None:
        self._fetcher.bucket = bucket

    @property
    def max_state_bytes(self) -> int | None:
        """The largest state accepted before the first one (see the class's arguments)."""
        return self._fetcher.max_state_bytes

    #: The published state: each tensor once, under the name the state hash covers.
    state: HeldField[dict[str, torch.Tensor]] = HeldField()
    #: Tied names of the state (alias -> name in :attr:`state`), from the last anchor.
    aliases: HeldField[dict[str, str]] = HeldField()
    #: The version of :attr:`state` (``None`` before the first anchor).
    step: HeldField[int | None] = HeldField()
    #: The hash of :attr:`state` (``None`` before the first anchor).
    state_hash: HeldField[str | None] = HeldField()
    #: The run :attr:`state` belongs to (``None`` before the first anchor).
    run_id: HeldField[str | None] = HeldField()
    #: The state's hash, per tensor, as the verified updates made it (``None`` before the first anchor).
    lanes: HeldField[StateLanes | None] = HeldField()

    @property
    def model_state(self) -> dict[str, torch.Tensor]:
        """:attr:`state` with the tied names restored, each bound to the tensor it aliases (for
        ``model.load_state_dict``, which wants every name of a tied model)."""
        return with_aliases(self.state, self.aliases)

    @property
    def needs_resync(self) -> bool:
        """True after a refused update, until a verified update (see the module docstring) is applied."""
        return self._held.resync

    def read_manifest(self) -> Manifest | None:
        """Read the pointer; ``None`` before the first publish."""
        if (manifest := self._fetcher.read_manifest()) is not None:
            self.manifest = manifest
        return manifest

    def fetch(self) -> Update | None:
        """Download and validate the next update toward the newest version.

        Returns:
            The update, or ``None`` when up to date (or, after a refused update,
            when no newer anchor exists yet).

        Raises:
            SyncError: the update is missing, truncated, corrupt or does not
                match; the state is untouched and the subscriber will resync
                from the next anchor.
            BucketError: the bucket failed; retry later.
        """
        with self._held.lock:
            return self._fetch()

    def _fetch(self, again: bool = True) -> Update | None:
        """:meth:`fetch`; with `again`, an update retention dropped meanwhile is looked for again in the new pointer."""
        manifest, held = self.read_manifest(), self._held
        if manifest is None:
            return None
        wrong = {k: manifest.metadata.get(k) for k, v in self.expect_metadata.items() if manifest.metadata.get(k) != v}
        if wrong:
            raise self._refuse(ChainError(f"the chain's metadata {wrong} differs from this subscriber's {self.expect_metadata}"))
        try:
            check_version(manifest.format_version, "chain")
        except FormatError as exc:
            raise self._refuse(exc) from None
        if held.rebootstrap:  # the weights are not the verified state: only an anchor can repair them
            return self._fetch_anchor(manifest.anchors[-1], again)
        if manifest.step == held.step:
            if manifest.state_hash == held.state_hash:
                held.resync = False  # the pointer names exactly this state again
            elif not held.resync:  # same step, other state: a fork
                raise self._refuse(ChainError(f"the pointer names step {held.step} with another state than this one"))
            return None
        if held.step is not None and manifest.step < held.step:
            raise self._refuse(ChainError(f"pointer went back from {held.step} to {manifest.step}"))
        run_changed = held.step is not None and manifest.run_id != held.run_id
        if run_changed and self._announced_run != manifest.run_id:  # one line per new run, not per poll
            self._announced_run = manifest.run_id
            logger.warning(
                "the bucket's run changed from %r (version %d) to %r (version %d): re-bootstrapping from its newest anchor",
                held.run_id, held.step, manifest.run_id, manifest.step,
            )  # fmt: skip
        entry = manifest.delta_after(held.step) if held.step is not None and not run_changed else None
        if entry is not None and not held.resync:
            return self._fetch_delta(entry, again)
        newer = [a for a in manifest.anchors if held.step is None or a.step > held.step]
        if newer:
            return self._fetch_anchor(newer[-1], again)
        if not held.resync:
            raise self._refuse(ChainError(f"no retained delta or anchor continues step {held.step}"))
        if entry is not None and self._refused_at != (manifest.step, manifest.state_hash):
            # a pointer changed since the refusal: verified by its base and result hashes
            return self._fetch_delta(entry, again)
        return None

    def _fetch_delta(self, entry: DeltaEntry, again: bool = False) -> Update | None:
        try:
            return self._fetcher.delta(entry)
        except SyncError as exc:
            if again and isinstance(exc, MissingUpdateError) and self._dropped(entry):
                return self._fetch(again=False)
            raise self._refuse(exc) from None

    def _dropped(self, entry: DeltaEntry | AnchorEntry) -> bool:
        """Whether the pointer, read again, no longer names `entry`: retention dropped it while it was being
        read (one pointer read; an object the pointer still names is missing for real)."""
        manifest = self.read_manifest()
        if manifest is None or entry in (manifest.deltas if isinstance(entry, DeltaEntry) else manifest.anchors):
            return False
        logger.info("%s %d was dropped by retention while it was read: continuing from the pointer of step %d",
                    "delta" if isinstance(entry, DeltaEntry) else "anchor", entry.step, manifest.step)  # fmt: skip
        return True

    def _fetch_anchor(self, entry: AnchorEntry, again: bool = False) -> Update | None:
        try:
            self._fetcher.check_size("anchor", entry.step, entry.nbytes)
        except FormatError as exc:
            raise self._refuse(exc, wait=False)
        try:
            return self._fetcher.anchor(entry, self.manifest.run_id if self.manifest else "")
        except SyncError as exc:
            if again and isinstance(exc, MissingUpdateError) and self._dropped(entry):
                return self._fetch(again=False)
            logger.error("refused anchor %d: %s", entry.step, exc)
            raise self._refuse(exc, wait=False)

    def _refuse(self, error: SyncError, *, wait: bool = True) -> SyncError:
        """Count ``error``; with ``wait``, log it and wait for a pointer it can verify (see the module docstring)."""
        if wait:
            self._held.resync = True
            if self.manifest is not None:
                self._refused_at = (self.manifest.step, self.manifest.state_hash)
            logger.error("refused update: %s; keeping step %s until a pointer it can verify", error, self._held.step)
        self.stats.refused += 1
        self.stats.last_error = str(error)
        return error

    def apply(self, update: Update) -> None:
        """Write a fetched (already verified) update into :attr:`state`: the only step that needs
        generation paused.

        Raises:
            ChainError: the update does not follow the current state (replayed, out of order,
                or the state changed since it was fetched); nothing changes. If it names the
                current step but another base state, it is also counted as refused and the
                subscriber waits for the next anchor.
        """
        with self._held.lock:
            t0 = time.perf_counter()
            if update.kind == "delta":
                self._check_follows(update)
            self._applier.apply(update)
            self.stats.last_apply_s = time.perf_counter() - t0
            logger.info("applied %s %d (%d bytes)", update.kind, update.step, update.nbytes)

    def _check_follows(self, delta: Update) -> None:
        held = self._held
        if held.rebootstrap:
            raise ChainError(f"delta {delta.step} not applied: the weights are being resynchronised from an anchor")
        if delta.base_step != held.step:  # replayed or out of order: the state is still good
            raise ChainError(f"delta {delta.base_step}->{delta.step} does not apply to step {held.step}")
        if delta.base_hash != held.state_hash:  # same step, another state: a fork, resync from the next anchor
            raise self._refuse(ChainError(f"delta {delta.step} is based on another state than step {held.step}"))

    def verify_weights(self) -> bool | None:
        """Re-hash the state (the engine's actual weights) in full and compare it with the state
        hash the updates were verified against. Meant for a background thread: the state is read a
        chunk at a time, so updates are applied meanwhile (each waits for at most one chunk).

        Returns:
            ``True`` when every tensor matches, ``False`` on a mismatch (counted; the subscriber then
            re-bootstraps from the newest anchor), ``None`` when there is no state yet, it already waits
            for that re-bootstrap, or an anchor replaced it during the pass.
        """
        return self._rehash.run()

    def sync(self, max_updates: int | None = None) -> list[Update]:
        """Fetch and apply updates until up to date.

        Returns:
            The applied updates.
        """
        applied = []
        while max_updates is None or len(applied) < max_updates:
            update = self.fetch()
            if update is None:
                break
            self.apply(update)
            applied.append(update)
        return applied
