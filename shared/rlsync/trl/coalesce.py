"""Publish less often while the Hub's request budget is short.

Every publish costs requests (the delta, the pointer, the figures). :class:`PublishCoalescing`
stretches ``AsyncGRPOTrainer``'s weight-sync interval while the trainer's
:class:`~rlsync.bucket.budget.RequestMeter` says the budget is short, doubling it up to
``max_factor`` times the configured one, and brings it back once the budget recovers. Nothing is
lost: a delta is always against the last *published* state, so publishing every k steps yields
the same weights at each published version, and TRL's version counter only moves on a real sync
(its staleness accounting stays right).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

__all__ = ["PublishCoalescing"]

logger = logging.getLogger(__name__)


class PublishCoalescing(TrainerCallback):
    """Adapts the weight-sync interval of an ``AsyncGRPOTrainer`` to the request budget.

    Args:
        trainer: The ``AsyncGRPOTrainer`` (its ``_sync_weight`` step-interval callback is adjusted).
        meter: The trainer's :class:`~rlsync.bucket.budget.RequestMeter` (its ``short`` property).
        max_factor (`int`, *optional*, defaults to 8): Longest interval, in multiples of the configured one.
    """

    def __init__(self, trainer: Any, meter: Any, max_factor: int = 8) -> None:
        self.trainer = trainer
        self.meter = meter
        self.base = int(trainer.args.weight_sync_steps)
        self.max_factor = max_factor
        self.factor = 1
        self.coalesced = 0

    def _interval_callback(self) -> Any | None:
        for callback in self.trainer.callback_handler.callbacks:
            if type(callback).__name__ == "StepIntervalCallback" and getattr(callback.fn, "__name__", "") == "_sync_weight":
                return callback
        return None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % (self.base * self.factor):
            return control  # change the interval only on its grid, so a stretch is at most doubled per publish
        short = self.meter.short
        factor = min(self.max_factor, self.factor * 2) if short else 1
        if factor != self.factor:
            self.factor = factor
            interval = self.base * factor
            callback = self._interval_callback()
            if callback is not None:
                callback.every_n_steps = interval
            args.weight_sync_steps = interval  # FinalWeightSync reads the grid from here
            logger.info("request budget %s: publishing every %d step(s)", "short" if short else "back", interval)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.factor > 1 and state.global_step % self.base == 0 and state.global_step % (self.base * self.factor):
            self.coalesced += 1
        return control

    @property
    def notice(self) -> str:
        """What the panel says while publishes are coalesced ('' when they are not)."""
        if self.factor == 1:
            return ""
        return f"request budget short: publishing every {self.base * self.factor} steps ({self.coalesced} publishes coalesced)"
