"""Applying a verified update: the only step of a sync that needs generation paused.

A delta is a scatter of its changed elements into the held state, and nothing else (it was
validated, decoded, verified and staged on the state's device before the pause); a scatter that
fails half-way is undone from the old values of the changed elements, the only rollback data kept.
An anchor is a copy into the held state's tensors: an engine's own weights when the subscriber keeps
those, else its own tensors, reused when the schema is the same.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..patch import scatter_
from ..read_once import FileMappings, read_once
from .held import HeldState, SubscriberStats
from .rehash import WeightsRehash
from .targets import same_schema
from .update import Update


class UpdateApplier:
    """Writes verified updates into a held state.

    Args:
        held: The state to write (the caller holds its lock).
        stats: Where applied updates are counted.
        rehash: The re-hash a write is reported to (it may be half-way through the state).
        weights: An engine's own tensors to copy anchors into; ``None``: tensors of the
            subscriber's own, on ``device``.
        device: Where the subscriber's own tensors live.
    """

    def __init__(
        self,
        held: HeldState,
        stats: SubscriberStats,
        rehash: WeightsRehash,
        *,
        weights: Mapping[str, torch.Tensor] | None,
        device: torch.device,
    ) -> None:
        self.held = held
        self.stats = stats
        self.rehash = rehash
        self.weights = weights
        self.device = device

    def apply(self, update: Update) -> None:
        """Write ``update``, which the caller checked follows the held state, and move the held
        state's version, hash and flags to it."""
        if update.kind == "anchor":
            self._anchor(update)
        else:
            self._delta(update)
            self.held.resync = False
            self.stats.deltas_applied += 1
        self.held.step = update.step
        self.held.state_hash = update.state_hash
        self.held.lanes = update.lanes

    def _anchor(self, update: Update) -> None:
        """Copy an anchor's tensors into the state: the weights given, the state held when it has
        the same schema, else new tensors on ``device`` (never views of the downloaded files, whose
        pages a later scatter would copy one by one)."""
        assert update.tensors is not None
        held = self.held
        self.rehash.restart()
        if self.weights is not None:
            state = {n: self.weights[n] for n in update.tensors}
        elif held.state and same_schema(held.state, update.tensors):
            state = held.state
        else:
            state = {n: torch.empty(t.shape, dtype=t.dtype, device=self.device) for n, t in update.tensors.items()}
        held.step, held.state_hash, held.lanes = None, None, None  # until every tensor is in
        held.state = state
        mappings = FileMappings()
        with torch.no_grad():
            for name, tensor in update.tensors.items():
                target = state[name].view(-1)  # contiguous: the weights or tensors of its own
                for start, part in read_once(tensor, mappings):  # the file's pages leave RSS as they are copied
                    target[start : start + part.numel()].copy_(part)
        update.tensors = None  # drop the views of the files
        held.aliases = update.aliases
        held.run_id = update.run_id
        held.resync = held.rebootstrap = False
        self.stats.anchors_applied += 1

    def _delta(self, update: Update) -> None:
        """Scatter a delta's changed elements; on a failure, restore the old values of those written."""
        assert update.patches is not None and update.old is not None
        state = self.held.state
        touched: list[str] = []  # restoring old values where the scatter did not happen yet is harmless
        try:
            for name, patch in update.patches.items():
                touched.append(name)
                scatter_(state[name], patch.index, patch.values)
        except BaseException:
            for name in reversed(touched):
                scatter_(state[name], update.patches[name].index, update.old[name])
            raise
        self.rehash.account(update)
