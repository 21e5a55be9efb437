"""TRL's terminal output, quiet: its per-step lines and metrics dict at DEBUG, its callbacks added once.

``AsyncGRPOTrainer`` logs five INFO lines per weight sync ("Weight sync: pausing vLLM...", ...), one
per wait for a sample and one per stale sample it drops, and transformers' ``PrinterCallback`` prints
its ~40-key metrics dict after every step: about 3,000 lines in 200 s of the CPU demo, in which the
roles' own summaries are lost. :func:`quiet_trl` turns those into DEBUG records (shown with
``--log-level debug``); the roles log one summary line per interval instead
(:mod:`rlsync.spaces.interval_log`).

:class:`AsyncGRPOTrainer` is TRL's trainer with one change: TRL adds two ``StepIntervalCallback``
instances (the weight sync, and the per-step metrics flush every step), and transformers warns at
start that the class is added twice, with the whole callback list. Here the per-step flush is added
as a :class:`EveryStep` callback instead, so no callback class is added twice.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PrinterCallback, TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOTrainer as _TrlAsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback

logger = logging.getLogger(__name__)

#: The logger of TRL's async GRPO trainer (weight-sync progress, waits, per-sample drops).
TRL_TRAINER_LOGGER = "trl.experimental.async_grpo.async_grpo_trainer"


class TrlStepLines(logging.Filter):
    """TRL's INFO lines as DEBUG records: passed on only when its logger is enabled for DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_trl_lines() -> None:
    """Install :class:`TrlStepLines` on TRL's trainer logger (once)."""
    trl_logger = logging.getLogger(TRL_TRAINER_LOGGER)
    if not any(isinstance(f, TrlStepLines) for f in trl_logger.filters):
        trl_logger.addFilter(TrlStepLines())


class DebugLogs(TrainerCallback):
    """TRL's metrics dict of each logging step as one DEBUG line (in place of ``PrinterCallback``'s print)."""

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs: Any):
        if logs:
            logger.debug("step %d: %s", state.global_step, logs)
        return control


class EveryStep(TrainerCallback):
    """Calls ``fn`` after every optimizer step (TRL's second ``StepIntervalCallback``, under its own class)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.fn()


class AsyncGRPOTrainer(_TrlAsyncGRPOTrainer):
    """TRL's ``AsyncGRPOTrainer``, its per-step metrics flush added as :class:`EveryStep` (see the module docstring)."""

    def add_callback(self, callback: Any) -> None:
        if (
            type(callback) is StepIntervalCallback
            and callback.every_n_steps == 1
            and any(type(c) is StepIntervalCallback for c in self.callback_handler.callbacks)
        ):
            callback = EveryStep(callback.fn)
        super().add_callback(callback)


def quiet_trl(trainer: Any) -> None:
    """Make ``trainer``'s terminal output quiet: TRL's per-step lines at DEBUG, its metrics dict a DEBUG line."""
    quiet_trl_lines()
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(DebugLogs())
