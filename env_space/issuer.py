"""Issuing task batches: the simulator's own batch numbering, publishing, pacing by the trainer's demand
and pruning old batches (:class:`TaskIssuer`, one part of :class:`~env_space.simulator.EnvSimulator`).

Batch numbers are the simulator's own: it resumes after the newest task object a simulator wrote, counts on
from there in memory, and never takes a planted key as its next number; keys beyond its numbering are
deleted as refused.
"""

from __future__ import annotations

import collections
import json
import logging
import time

from rlsync.bucket import Bucket
from rlsync.layout import (
    CLAIMS_PREFIX,
    DEMAND_KEY,
    MAX_BATCH,
    ROLLOUTS_PREFIX,
    SCORES_PREFIX,
    TASKS_PREFIX,
    task_key,
)
from rlsync.limits import MAX_OBJECT_BYTES
from rlsync.spaces.demand import Demand, batches_to_issue, batches_wanted, newest_version, read_demand
from rlsync.spaces.exchange import Refusals, get_json, list_batches, parse_tasks, put_json
from rlsync.spaces.interval_log import IntervalLog

from .bounded import FailureCounts
from .config import EnvConfig
from .environments import Environment

logger = logging.getLogger(__name__)
_RESUME_BELOW = 10**9  # a restart resumes only below this (a batch a second for 31 years): headroom to MAX_BATCH
_SAMPLES_PER_TASK = 4  # the replicas' default G, until the env has measured samples per batch
_RECENT_BATCHES = 16  # batches the samples-per-batch figure is measured over


class TaskIssuer:
    """Publishes task batches at the pace the trainer asks for, and prunes old ones.

    Args:
        config: The simulator's settings.
        bucket: The role's bucket.
        environment: Makes the tasks.
        failures: Where skipped batches are counted.
        refusals: Where refused demand and planted task objects are counted.
        summary: The role's interval log (``batches`` issued).
    """

    def __init__(
        self,
        config: EnvConfig,
        bucket: Bucket,
        environment: Environment,
        *,
        failures: FailureCounts,
        refusals: Refusals,
        summary: IntervalLog,
    ) -> None:
        self.config, self.bucket, self.environment = config, bucket, environment
        self.failures, self.refusals, self.summary = failures, refusals, summary  # shared with the simulator
        self.demand: Demand | None = None
        self.tasks_made = 0
        self.next_batch: int | None = None  # resumed from the bucket at the first publish
        self._batch_samples: collections.OrderedDict[int, int] = collections.OrderedDict()  # recent batch -> samples scored
        self.closed: set[int] = set()  # batches whose rollouts were cancelled or refused: nothing more in flight

    def _seed(self, batch: int) -> int:
        return self.config.seed * 1_000_003 + batch

    def _resume_batch(self) -> int:
        """The number after the newest task object a simulator wrote (its ``batch`` is the key's and its seed
        follows the numbering, whatever the environment and base seed; below ``_RESUME_BELOW``, so a
        planted number cannot use the numbers up; at most ``keep_batches`` reads from the top), else 0."""
        listed = sorted((b for b in list_batches(self.bucket, TASKS_PREFIX) if b < _RESUME_BELOW), reverse=True)
        for batch in listed[: self.config.keep_batches]:
            doc = get_json(self.bucket, task_key(batch))
            if not isinstance(doc, dict) or doc.get("batch") != batch:
                continue
            seed = doc.get("seed")
            if type(seed) is int and (seed - batch) % 1_000_003 == 0:
                return batch + 1
        return 0

    def own_next(self) -> int:
        """The next batch number this simulator will publish."""
        if self.next_batch is None:
            self.next_batch = self._resume_batch()
        return self.next_batch

    def publish_tasks(self) -> int:
        """Publish one batch of tasks; returns its number.

        Raises:
            RuntimeError: The batch numbers are used up (``MAX_BATCH``).
            ValueError: The batch would be refused by replicas (its number is skipped).
        """
        batch = self.own_next()
        if batch > MAX_BATCH:
            raise RuntimeError(f"task batch numbers are used up (the last is {MAX_BATCH})")
        seed = self._seed(batch)
        tasks = self.environment.tasks(self.config.tasks_per_batch, seed=seed)
        doc = {
            "batch": batch, "env": self.environment.name, "seed": seed, "n": len(tasks), "created_at": time.time(),
            "tasks": [{"task_id": t.task_id, "prompt": t.prompt} for t in tasks],
        }  # fmt: skip
        try:
            parse_tasks(doc)  # what replicas will check, and within what they read
            if len(json.dumps(doc, separators=(",", ":"))) > MAX_OBJECT_BYTES:
                raise ValueError(f"more than {MAX_OBJECT_BYTES} bytes")
        except ValueError as exc:
            self.next_batch = batch + 1  # this seed makes an object no replica reads: skip its number
            self.failures.add("tasks", "unreadable batch skipped")
            raise ValueError(f"task batch {batch} would be refused by replicas: {exc}") from None
        put_json(self.bucket, task_key(batch), doc)
        self.next_batch = batch + 1
        self.tasks_made += len(tasks)
        logger.debug("published task batch %d (%d %s tasks)", batch, len(tasks), self.environment.name)
        self.summary.add(batches=1)
        return batch

    def samples_per_batch(self) -> float:
        """Scored samples per task batch, over recent batches (all replicas' answers together)."""
        if not self._batch_samples:
            return float(self.config.tasks_per_batch * _SAMPLES_PER_TASK)
        return sum(self._batch_samples.values()) / len(self._batch_samples)

    def count_batch(self, batch: int, samples: int) -> None:
        """Note ``samples`` scored for ``batch`` (the measure of :meth:`samples_per_batch`)."""
        self._batch_samples[batch] = self._batch_samples.get(batch, 0) + samples
        self._batch_samples.move_to_end(batch)
        while len(self._batch_samples) > _RECENT_BATCHES:
            self._batch_samples.popitem(last=False)

    def issue_tasks(self) -> int:
        """Top up the task batches: what the trainer's demand asks for, else ``queue_depth`` waiting;
        returns the number of batches issued."""
        self.demand = read_demand(self.bucket, self.refusals, newest_version=newest_version(self.bucket))
        if self.demand is None:  # at most queue_depth per step, whatever the bucket holds
            issued = max(0, self.config.queue_depth - len(self.waiting_batches()))
            for _ in range(issued):
                self.publish_tasks()
            return issued
        batches = list(list_batches(self.bucket, TASKS_PREFIX))
        self.closed &= set(batches)
        scored = set(list_batches(self.bucket, SCORES_PREFIX))
        per_batch = self.samples_per_batch()
        if batches_wanted(self.demand, per_batch) > self.config.keep_batches:
            self.refusals.add(DEMAND_KEY, f"want_samples asks for more than the {self.config.keep_batches} batches kept")
        count = batches_to_issue(self.demand, batches, scored, self.closed, per_batch, self.config.keep_batches)
        for _ in range(count):
            self.publish_tasks()
        return count

    def waiting_batches(self) -> list[int]:
        """This simulator's batches that no replica has answered yet."""
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        newest = self.own_next()
        return [b for b in list_batches(self.bucket, TASKS_PREFIX) if b not in answered and b < newest]

    def prune(self) -> None:
        """Delete tasks, rollouts and scores of batches older than the newest ``keep_batches`` task batches
        (by rank, so a jump in numbering deletes nothing early), and task objects ahead of this simulator's
        numbering (planted; counted as refused)."""
        newest = self.own_next()
        behind = sorted(b for b in list_batches(self.bucket, TASKS_PREFIX) if b < newest)
        cutoff = behind[-self.config.keep_batches] if len(behind) > self.config.keep_batches else -1
        old = [k for prefix in (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX, CLAIMS_PREFIX)
               for b, keys in list_batches(self.bucket, prefix).items() if b < cutoff for k in keys]  # fmt: skip
        ahead = [k for b, keys in list_batches(self.bucket, TASKS_PREFIX).items() if b >= newest for k in keys]
        for key in ahead:
            self.refusals.add(key, "a task batch ahead of the environment's own numbering")
        if old or ahead:
            self.bucket.delete(old + ahead)
