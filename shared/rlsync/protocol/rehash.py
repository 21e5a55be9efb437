"""The full re-hash of a subscriber's weights, off the critical path.

A delta is checked against the hash the subscriber maintains, not against a re-hash of the weights,
so memory corruption or a writer outside the protocol would go unseen: :meth:`WeightsRehash.run`
re-hashes the actual weights in full (a replica runs it in the background, at an interval and at
every anchor). It reads a chunk at a time under the held state's lock, so updates are applied
meanwhile: a delta's changes below the read position are added to the pass (:meth:`WeightsRehash.account`),
and an anchor ends it (:meth:`WeightsRehash.restart`). A mismatch is counted, and the subscriber
re-bootstraps from the newest anchor.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from ..dtypes import tensor_bits
from ..hashing import CHUNK_ELEMENTS, change_lanes, slice_lanes, zero_lanes
from .held import HeldState, SubscriberStats
from .update import Update

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Cursor:
    """Where a running pass is: its tensor, the elements before ``position`` hashed into ``lanes``. A
    delta applied meanwhile adds its changes below ``position`` to ``lanes``, so the pass ends with the
    tensor's lanes as they are then."""

    name: str
    position: int
    lanes: np.ndarray


class WeightsRehash:
    """Re-hashes a held state in full and compares it with the hash the updates were verified against.

    Args:
        held: The state to re-hash (its lock is taken for each chunk).
        stats: Where passes, mismatches and the verified version are counted.
    """

    def __init__(self, held: HeldState, stats: SubscriberStats) -> None:
        self.held = held
        self.stats = stats
        self._generation = 0  # anchors applied: a pass ends when the state is replaced
        self._cursor: _Cursor | None = None

    def run(self) -> bool | None:
        """One full pass (see :meth:`rlsync.protocol.Subscriber.verify_weights`).

        Returns:
            ``True`` when every tensor matches, ``False`` on a mismatch (counted; the held state is
            marked for a re-bootstrap), ``None`` when there is no state yet, the state already waits for
            that re-bootstrap (a mismatch is counted once), or an anchor replaced it during the pass.
        """
        held, t0 = self.held, time.perf_counter()
        with held.lock:
            if held.lanes is None or held.rebootstrap:  # no state yet, or a mismatch already counted
                return None
            generation, names = self._generation, sorted(held.state)
        for name in names:
            cursor = _Cursor(name, 0, zero_lanes())
            numel = held.state[name].numel()
            while True:
                with held.lock:
                    if generation != self._generation:
                        return None
                    if cursor.position >= numel:
                        break
                    self._cursor = cursor
                    flat = held.state[name].detach().reshape(-1)
                    end = min(numel, cursor.position + CHUNK_ELEMENTS)
                    cursor.lanes += slice_lanes(name, flat[cursor.position : end], cursor.position, numel)
                    cursor.position = end
            with held.lock:
                self._cursor = None
                if generation != self._generation:
                    return None
                assert held.lanes is not None
                if not np.array_equal(cursor.lanes, held.lanes.tensors[name]):
                    self._differ(name)
                    return False
        with held.lock:
            self.stats.rehashes += 1
            self.stats.last_rehash_s = time.perf_counter() - t0
            self.stats.verified_step, self.stats.verified_hash = held.step, held.state_hash or ""
        return True

    def restart(self) -> None:
        """The held state is being replaced (an anchor): a running pass ends without a verdict."""
        self._generation += 1
        self._cursor = None

    def account(self, update: Update) -> None:
        """Add the changes of a delta just scattered to a pass inside one of its tensors (the changes
        below the read position: those above it are read as they are now)."""
        assert update.patches is not None and update.old is not None
        cursor = self._cursor
        if cursor is None or cursor.name not in update.patches:
            return
        patch, target = update.patches[cursor.name], self.held.state[cursor.name]
        below = (patch.index < cursor.position).cpu()
        old, new = (tensor_bits(v[below.to(v.device)]) for v in (update.old[cursor.name], patch.values))
        cursor.lanes += change_lanes(cursor.name, target.element_size(), target.numel(), patch.index.cpu()[below].numpy(), old, new)

    def _differ(self, name: str) -> None:
        held = self.held
        self.stats.rehash_mismatches += 1
        self.stats.refused += 1
        self.stats.last_error = f"the weights differ from the verified state of step {held.step} (first in {name!r})"
        held.rebootstrap = held.resync = True
        logger.error("%s: re-bootstrapping from the newest anchor", self.stats.last_error)
