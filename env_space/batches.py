"""The environment's task batches: their numbering, issuing them at the trainer's demand, and pruning.

Batch numbers are the simulator's own: it resumes after the newest task object a simulator wrote,
counts on from there in memory, and never takes a planted key as its next number; keys beyond its
numbering are deleted as refused.
"""

from __future__ import annotations

import collections
import json
import logging
import time

from rlsync.bucket import Bucket
from rlsync.layout import MAX_BATCH, ROLLOUTS_PREFIX, SCORES_PREFIX, TASKS_PREFIX, task_key
from rlsync.limits import MAX_OBJECT_BYTES
from rlsync.spaces.demand import Demand, batches_to_issue, read_demand
from rlsync.spaces.exchange import MAX_TASKS, Refusals, get_json, list_batches, parse_tasks, put_json

from .bounded import FailureCounts
from .config import EnvConfig
from .environments import Environment, Task

logger = logging.getLogger(__name__)
_RESUME_BELOW = 10**9  # a restart resumes only below this (a batch a second for 31 years): headroom to MAX_BATCH
_SAMPLES_PER_TASK = 4  # the replicas' default G, until the env has measured samples per batch


class TaskIssuer:
    """Numbers, writes and prunes the task batches of one environment.

    Args:
        bucket: The run's bucket.
        environment: Makes the tasks.
        config: The simulator's settings (``seed``, ``tasks_per_batch``, ``queue_depth``, ``keep_batches``).
        failures: Where a batch no replica could read is counted.
        refusals: Where planted task objects and invalid demand objects are counted.
    """

    def __init__(
        self, bucket: Bucket, environment: Environment, config: EnvConfig, failures: FailureCounts, refusals: Refusals
    ) -> None:
        self.bucket, self.environment, self.config = bucket, environment, config
        self.failures, self.refusals = failures, refusals
        self.next_batch: int | None = None  # resumed from the bucket at the first publish
        self.tasks_made = 0
        self.demand: Demand | None = None
        self.batch_samples: collections.OrderedDict[int, int] = collections.OrderedDict()  # recent batch -> samples scored
        self.closed: set[int] = set()  # batches whose rollouts were cancelled or refused: nothing more in flight

    def batch_tasks(self, batch: int, doc: dict) -> dict[str, Task]:
        """The tasks of a batch, regenerated from its environment and seed.

        Raises:
            ValueError: ``doc`` is not a task object an environment wrote (unknown environment,
                ``n`` or ``seed`` not integers, ``n`` not the number of tasks it lists).
        """
        try:
            if doc.get("env") != self.environment.name:
                raise ValueError(f"made by {doc.get('env')!r}, not by this simulator's {self.environment.name!r}")
            env = self.environment
            n, seed = doc["n"], doc["seed"]
            if type(n) is not int or type(seed) is not int or not isinstance(doc.get("tasks"), list) or n != len(doc["tasks"]):
                raise ValueError(f"n={n!r}, seed={seed!r} do not describe its task list")
            if not 0 < n <= MAX_TASKS or abs(seed) >= 1 << 63:
                raise ValueError(f"n={n!r} is not in [1, {MAX_TASKS}] or seed={seed!r} is not a 64-bit integer"[:200])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"task batch {batch}: {exc}") from None
        return {t.task_id: t for t in env.tasks(n, seed=seed)}

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
        logger.info("published task batch %d (%d %s tasks)", batch, len(tasks), self.environment.name)
        return batch

    def samples_per_batch(self) -> float:
        """Scored samples per task batch, over recent batches (all replicas' answers together)."""
        if not self.batch_samples:
            return float(self.config.tasks_per_batch * _SAMPLES_PER_TASK)
        return sum(self.batch_samples.values()) / len(self.batch_samples)

    def issue_tasks(self) -> int:
        """Top up the task batches: what the trainer's demand asks for, else ``queue_depth`` waiting;
        returns the number of batches issued."""
        self.demand = read_demand(self.bucket, self.refusals)
        if self.demand is None:  # at most queue_depth per step, whatever the bucket holds
            issued = max(0, self.config.queue_depth - len(self.waiting_batches()))
            for _ in range(issued):
                self.publish_tasks()
            return issued
        batches = list(list_batches(self.bucket, TASKS_PREFIX))
        self.closed &= set(batches)
        scored = set(list_batches(self.bucket, SCORES_PREFIX))
        count = batches_to_issue(self.demand, batches, scored, self.closed, self.samples_per_batch())
        for _ in range(count):
            self.publish_tasks()
        return count

    def waiting_batches(self) -> list[int]:
        """This simulator's batches that no replica has answered yet."""
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        newest = self.own_next()
        return [b for b in list_batches(self.bucket, TASKS_PREFIX) if b not in answered and b < newest]

    def count_batch(self, batch: int, samples: int) -> None:
        self.batch_samples[batch] = self.batch_samples.get(batch, 0) + samples
        self.batch_samples.move_to_end(batch)
        while len(self.batch_samples) > 16:
            self.batch_samples.popitem(last=False)

    def prune(self) -> None:
        """Delete tasks, rollouts and scores of batches older than the newest ``keep_batches`` task batches
        (by rank, so a jump in numbering deletes nothing early), and task objects ahead of this simulator's
        numbering (planted; counted as refused)."""
        newest = self.own_next()
        behind = sorted(b for b in list_batches(self.bucket, TASKS_PREFIX) if b < newest)
        cutoff = behind[-self.config.keep_batches] if len(behind) > self.config.keep_batches else -1
        old = [k for prefix in (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX)
               for b, keys in list_batches(self.bucket, prefix).items() if b < cutoff for k in keys]  # fmt: skip
        ahead = [k for b, keys in list_batches(self.bucket, TASKS_PREFIX).items() if b >= newest for k in keys]
        for key in ahead:
            self.refusals.add(key, "a task batch ahead of the environment's own numbering")
        if old or ahead:
            self.bucket.delete(old + ahead)
