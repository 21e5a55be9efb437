"""The published state: the weights replicas hold, as the trainer last published them, and what a new
version makes of them.

:class:`PublishedState`, the :class:`~rlsync.protocol.Publisher`'s base, keeps the serving tensors (its
change detector's shadow copy), their state hash per tensor and their tied names; it finds a new version's
changes (refusing those that turn finite values into NaN or Inf) and its state hash, and takes a written
version in. The publisher decides what each version is and has it written.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import torch

from ..delta_format import Change
from ..detect import ChangeDetector, serving_copy
from ..hashing import StateLanes, changes_lanes
from .finite import check_finite_changes


class PublishedState:
    """The published state and the changes and hash of the next version.

    Args:
        dtype: Serving dtype for floating-point tensors (``None``: as given).
        chunk_elements: Elements compared at once by change detection.
        allow_non_finite: Publish states that turn finite values into NaN or Inf (refused with
            :class:`NonFiniteError` by default).
    """

    def __init__(self, *, dtype: torch.dtype | None, chunk_elements: int, allow_non_finite: bool) -> None:
        self.dtype = dtype
        self.detector = ChangeDetector(dtype, chunk_elements)  # its ``published``: the serving tensors
        self.allow_non_finite = allow_non_finite
        self._lanes: StateLanes | None = None  # the published state's hash, per tensor
        #: Tied names of the published state: alias -> published name (see :mod:`rlsync.aliases`).
        self.aliases: dict[str, str] = {}

    def continued_by(self, state: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> bool:
        """Whether ``state`` (tied names ``aliases``) has the published state's names, shapes, dtypes and tied names."""
        return self.detector.compatible(state) and aliases == self.aliases

    def changes(self, state: Mapping[str, torch.Tensor]) -> dict[str, Change]:
        """``state``'s changes from the published state (:meth:`ChangeDetector.diff`), checked finite."""
        changes = self.detector.diff(state)
        check_finite_changes(changes, allowed=self.allow_non_finite)
        return changes

    def stream_changes(self, tensors: Iterable[tuple[str, torch.Tensor]], *, what: str) -> dict[str, Change]:
        """:meth:`changes` of ``(name, tensor)`` pairs compared as they arrive (:meth:`ChangeDetector.diff_stream`)."""
        changes = self.detector.diff_stream(tensors, what=what)
        check_finite_changes(changes, allowed=self.allow_non_finite)
        return changes

    def delta_lanes(self, changes: Mapping[str, Change]) -> StateLanes:
        """The hash of the published state with ``changes`` applied, from the changes alone."""
        assert self._lanes is not None
        return self._lanes.updated(lanes_of_changes(changes))

    def take_delta(self, changes: Mapping[str, Change], lanes: StateLanes) -> None:
        """Apply a written delta's ``changes`` (new hash ``lanes``) to the published state."""
        self._lanes = lanes
        self.detector.commit(changes)

    def anchor_state(
        self, state: Mapping[str, torch.Tensor], *, owned: bool, continues: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Change] | None, StateLanes]:
        """An anchor's serving tensors, its changes from the published state (``None`` unless it
        ``continues`` it: a companion delta) and its hash.
        ``owned``: ``state`` holds contiguous serving-dtype tensors nobody else modifies, kept without a copy."""
        serving = dict(state) if owned else {n: serving_copy(t, self.dtype) for n, t in state.items()}
        changes = self.changes(serving) if continues and self.detector.compatible(serving) else None
        return serving, changes, StateLanes.of(serving)

    def take_anchor(self, serving: dict[str, torch.Tensor], lanes: StateLanes, aliases: Mapping[str, str]) -> None:
        """Make a written anchor (from :meth:`anchor_state`) the published state."""
        self._lanes, self.detector.published, self.aliases = lanes, serving, dict(aliases)


def lanes_of_changes(changes: Mapping[str, Change]) -> dict[str, np.ndarray]:
    """What each tensor's changes add to its state-hash lanes (:func:`rlsync.hashing.change_lanes`).

    The indices are each change's own (a whole tensor's, or a slice's mapped to the whole tensor by
    the caller)."""
    return changes_lanes({n: (c.new_bits.itemsize, math.prod(c.shape), c.index, c.old_bits, c.new_bits) for n, c in changes.items()})
