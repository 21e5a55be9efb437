"""The trainer's side of demand-driven work (:mod:`rlsync.spaces.demand`) and its flow figures.

:class:`FlowControl` is a TRL callback. After every logged optimizer step it

- adds up what the step reports: samples trained, seconds the trainer waited for
  rollouts (``perf/rollout_wait_s``) and the step's compute time (the step minus that wait);
- writes ``control/demand.json`` (pacing ``demand``; also at train end): the newest published version, the newest task
  batch read, and how many more samples to keep in flight, sized from the measured step
  time and issue-to-read latency (:func:`~rlsync.spaces.demand.target_in_flight`).

:meth:`FlowControl.figures` is what ``metrics/trainer.json`` carries under ``flow``:
cumulative counts (trained, dropped stale, expired unread, degenerate, invalid), the
staleness histogram of the samples TRL took, and the total and per-step waiting time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback

from rlsync.bucket import Bucket
from rlsync.errors import BucketError
from rlsync.layout import DEMAND_KEY
from rlsync.spaces.demand import Demand, Pacing, target_in_flight, write_demand
from rlsync.spaces.metrics import FlowFigures
from rlsync.trl import BucketRolloutWorker, BucketWeightTransfer

logger = logging.getLogger(__name__)


class FlowControl(TrainerCallback):
    """Counts trained samples and waiting time; writes the demand object once per step.

    Args:
        bucket: The run's bucket.
        worker: The rollout worker (its counts, buffer, newest batch read and latency).
        transfer: The weight transfer (its newest published version).
        batch_size: Samples per optimizer step.
        max_staleness: Versions a sample may lag when trained.
        pacing: ``demand`` writes the demand object; ``queue`` removes a stale one and writes none.
    """

    def __init__(
        self, bucket: Bucket, worker: BucketRolloutWorker, transfer: BucketWeightTransfer, *,
        batch_size: int, max_staleness: int, pacing: Pacing = Pacing.DEMAND,
    ) -> None:  # fmt: skip
        self.bucket, self.worker, self.transfer = bucket, worker, transfer
        self.batch_size, self.max_staleness, self.pacing = batch_size, max_staleness, Pacing(pacing)
        self.trained = 0
        self.steps = 0
        self.wait_s = 0.0
        self.first_wait_s = 0.0  # before the first step: replicas loading, the first batch generated
        self.last_wait_s: float | None = None
        self.compute_s: float | None = None  # EMA of a step without its waiting
        self.started_at = time.time()
        self._buffered_at_write = 0  # samples in the buffer when the demand was last written
        self._read_batch_at_write = -1  # the read_batch it said
        worker.on_poll = self.refresh_if_starving

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.started_at = time.time()
        if self.pacing is Pacing.QUEUE:
            try:
                self.bucket.delete([DEMAND_KEY])
            except BucketError as exc:
                logger.warning("could not remove %s: %s", DEMAND_KEY, exc)
        self.publish_demand()
        return control

    def on_train_end(self, args, state, control, **kwargs: Any):
        """Once more after the final publish (the weight sync's callbacks flush it first): the last
        demand names the version the run ended at."""
        self.publish_demand()
        return control

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs: Any):
        logs = logs or {}
        if "loss" not in logs:
            return control
        self.add_step(logs.get("batch/samples_per_step"), logs.get("perf/rollout_wait_s"), logs.get("perf/step_s"))
        self.publish_demand()
        return control

    def add_step(self, samples: float | None, wait_s: float | None, step_s: float | None) -> None:
        """Account one optimizer step (the values TRL logs for it; ``None`` when it logged none)."""
        self.steps += 1
        self.trained += int(samples or 0)
        self.last_wait_s = float(wait_s or 0.0)
        self.wait_s += self.last_wait_s
        if self.steps == 1:
            self.first_wait_s = self.last_wait_s
        if step_s:
            compute = max(float(step_s) - self.last_wait_s, 1e-3)
            self.compute_s = compute if self.compute_s is None else 0.7 * self.compute_s + 0.3 * compute

    def demand(self) -> Demand | None:
        """The demand now (``None`` before the first publish). Its version is the newest *published*
        one: a version sent to the background publisher is not in the bucket yet, and the env and
        replicas refuse a demand newer than the pointer (:func:`~rlsync.spaces.demand.read_demand`)."""
        version = self.transfer.published_version
        if version is None:
            return None
        target = target_in_flight(self.batch_size, self.max_staleness, self.compute_s, self.worker.latency_s)
        newest, buffered = self.worker.newest_batch, self.worker.rollout_buffer.qsize()
        return Demand(
            version=version, max_staleness=self.max_staleness, read_batch=-1 if newest is None else newest,
            want_samples=max(0, target - buffered), step_s=self.compute_s or 0.0,
            latency_s=self.worker.latency_s or 0.0, buffered_steps=buffered / max(self.batch_size, 1),
        )  # fmt: skip

    def refresh_if_starving(self) -> None:
        """Rewrite the demand between steps when the trainer starves on the one written.

        No step ends then, so none would write it, and the env would wait on a demand it takes
        as met. Either the buffer ran empty since it was written (TRL took and dropped stale
        samples), or batches were read past its ``read_batch`` without filling a step (read and
        dropped stale, as after a restart on a bucket holding old scores): the env would count
        those batches as in flight. One write at most per batch read.
        """
        buffered, newest = self.worker.rollout_buffer.qsize(), self.worker.newest_batch
        drained = self._buffered_at_write and not buffered
        read_past = newest is not None and newest > self._read_batch_at_write and buffered < self.batch_size
        if drained or read_past:
            self.publish_demand()

    def publish_demand(self) -> None:
        """Write ``control/demand.json`` (pacing ``demand`` only; errors are logged)."""
        demand = self.demand() if self.pacing is Pacing.DEMAND else None
        if demand is None:
            return
        self._buffered_at_write, self._read_batch_at_write = self.worker.rollout_buffer.qsize(), demand.read_batch
        try:
            write_demand(self.bucket, demand)
        except BucketError as exc:
            logger.warning("could not write %s: %s", DEMAND_KEY, exc)

    def figures(self) -> FlowFigures:
        """Cumulative flow figures for ``metrics/trainer.json``."""
        wall = max(time.time() - self.started_at, 1e-9)
        return FlowFigures(
            **self.worker.flow(), trained=self.trained, steps=self.steps, pacing=self.pacing,
            wait_s_total=self.wait_s, wait_s_last=self.last_wait_s, wait_share=self.wait_s / wall,
            wait_s_first_step=self.first_wait_s, wait_share_after_first_step=(self.wait_s - self.first_wait_s) / wall,
            wall_s=wall, step_compute_s=self.compute_s,
        )  # fmt: skip
