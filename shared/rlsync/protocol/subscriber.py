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

Which update comes next, what is refused before a download, and how a
refused subscriber resynchronises is :mod:`rlsync.protocol.chooser`'s job.
Applying a delta twice is refused.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Mapping, MutableMapping

import torch

from ..aliases import with_aliases
from ..bucket import Bucket
from ..errors import ChainError
from ..hashing import StateLanes
from .applier import UpdateApplier
from .chooser import UpdateChooser
from .fetcher import SCRATCH_PREFIX, UpdateFetcher
from .held import HeldField, HeldState, SubscriberStats
from .manifest import Manifest
from .rehash import WeightsRehash
from .update import Update

__all__ = ["SCRATCH_PREFIX", "Subscriber", "SubscriberStats", "Update"]

DEFAULT_MAX_PARALLEL_DOWNLOADS = 8

logger = logging.getLogger(__name__)


class Subscriber:
    """Follows a bucket and keeps a state (its own, or an engine's weights) bit-exact to the published one.

    It orders the work (fetch, then apply in the pause) under one lock; its parts do it, over one
    :class:`~.held.HeldState`: an :class:`~.chooser.UpdateChooser` picks the next update and refuses
    what does not follow, an :class:`~.fetcher.UpdateFetcher` downloads and verifies it before the
    pause, an :class:`~.applier.UpdateApplier` writes it in the pause, a :class:`~.rehash.WeightsRehash`
    re-hashes the weights in the background.

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
        self.stats = SubscriberStats()
        #: The largest state accepted before the first one (see the class's arguments; its fetcher checks it).
        self.max_state_bytes = max_state_bytes
        self._held = held = HeldState()
        self._fetcher = UpdateFetcher(
            bucket, held, self.stats, workdir=workdir, max_parallel_downloads=max_parallel_downloads,
            weights=weights, check_values=check_values, max_state_bytes=max_state_bytes,
        )  # fmt: skip
        #: Chooses the next update and refuses what does not follow (fetches a given entry for a replay).
        self.chooser = UpdateChooser(self._fetcher, held, self.stats, expect_metadata)
        self._rehash = WeightsRehash(held, self.stats)
        self._applier = UpdateApplier(held, self.stats, self._rehash, weights=weights, device=torch.device(device))

    @property
    def bucket(self) -> Bucket:
        """The bucket followed (may be replaced by another holding the same chain)."""
        return self._fetcher.bucket

    @bucket.setter
    def bucket(self, bucket: Bucket) -> None:
        self._fetcher.bucket = bucket

    @property
    def expect_metadata(self) -> dict[str, str]:
        """Pointer metadata entries the chain must carry (see the class's arguments); may be replaced."""
        return self.chooser.expect_metadata

    @expect_metadata.setter
    def expect_metadata(self, expect: dict[str, str]) -> None:
        self.chooser.expect_metadata = expect

    @property
    def manifest(self) -> Manifest | None:
        """The pointer last read (``None`` before the first one)."""
        return self.chooser.manifest

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
        """True after a refused update, until a verified update (see :mod:`rlsync.protocol.chooser`) is applied."""
        return self._held.resync

    def read_manifest(self) -> Manifest | None:
        """Read the pointer; ``None`` before the first publish."""
        return self.chooser.read_manifest()

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
            return self.chooser.next()

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
            raise self.chooser.refuse(ChainError(f"delta {delta.step} is based on another state than step {held.step}"))

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
