"""The environment simulator role: tasks out, rewards back, only through the bucket.

Each iteration it issues task batches at the rate the trainer consumes them
(the trainer's ``control/demand.json``, see :mod:`rlsync.spaces.demand`; without
one it keeps ``queue_depth`` batches waiting), scores every rollouts object that
replicas wrote (cancelling those already too stale for the trainer) (regenerating the batch's
tasks from its seed, so answers never leave the environment), writes the
scored samples for the trainer, and mirrors its figures to ``metrics/env.json``.

Scoring runs user code (reward functions, verifiers, remote environments) on untrusted
completions: it runs confined (:class:`~env_space.environments.Scoring`), each sample
bounded by ``score_timeout_s`` and each rollouts object by ``score_budget_s``, so one
object cannot hold up the others' scores. An exception, a timeout, a non-finite reward
or one beyond ``MAX_REWARD`` scores the sample ``failure_reward`` and counts the reason,
and the simulator carries on.

Batch numbers are the simulator's own: it resumes after the newest task object a
simulator wrote, counts on from there in memory, and never takes a planted key as its
next number; keys beyond its numbering are deleted as refused.

The jobs live in parts: :class:`~env_space.issuer.TaskIssuer` (numbering, publishing, pacing,
pruning), :class:`~env_space.scoring.Scorer` (bounded scoring) and :class:`~env_space.figures.EnvFigures` (the
figures and the summary line); :class:`EnvSimulator` joins them, routes the rollouts and runs the loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, meter_of, wait_for_change
from rlsync.errors import BucketError
from rlsync.layout import DEMAND_KEY, ROLLOUTS_PREFIX, replica_of, score_key, task_key
from rlsync.roles import Role
from rlsync.spaces.demand import Demand
from rlsync.spaces.role_control import OneThreadRole
from rlsync.spaces.exchange import (
    Refusals,
    SampleLimits,
    get_json,
    list_batches,
    open_role_bucket,
    read_samples,
    write_samples,
)
from rlsync.supervised import SupervisedThread

from .bounded import FailureCounts
from .config import EnvConfig
from .environments import Environment, Task
from .figures import EnvFigures
from .issuer import TaskIssuer
from .scoring import Scorer
from .sources import open_environment
from .sources.settings import source_settings

logger = logging.getLogger(__name__)
_MAX_BACKOFF_S = 60.0  # longest wait between steps after failures in a row


class EnvSimulator(OneThreadRole):
    """Publishes task batches and scores the completions replicas write back: it joins a
    :class:`~env_space.issuer.TaskIssuer` (numbering, pacing, pruning), a :class:`~env_space.scoring.Scorer`
    (bounded scoring) and :class:`~env_space.figures.EnvFigures`.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: EnvConfig, bucket: Bucket | None = None) -> None:
        self.config = config
        self.bucket = open_role_bucket(Role.ENV, config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        settings = source_settings(config.environment, config.source_settings)
        environment = open_environment(config.environment, chat_template=config.chat_template, settings=settings)
        self.failures = FailureCounts()
        self.figures = EnvFigures(self.bucket, self.meter, config.metrics_every_s, logger, lambda: self.environment.name)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refusals = Refusals()
        self.issuer = TaskIssuer(
            config, self.bucket, environment, failures=self.failures, refusals=self.refusals, summary=self.figures.summary
        )
        self.scorer = Scorer(config, self.bucket, environment, self.failures)

    @property
    def environment(self) -> Environment:
        """The task source (issuer and scorer use the same one)."""
        return self.issuer.environment

    @environment.setter
    def environment(self, environment: Environment) -> None:
        self.issuer.environment = self.scorer.environment = environment

    @property
    def demand(self) -> Demand | None:
        """The trainer's demand as last read (``None``: none, the queue paces)."""
        return self.issuer.demand

    # -- tasks (see TaskIssuer) ----------------------------------------------

    def batch_tasks(self, batch: int, doc: dict) -> dict[str, Task]:
        """The tasks of a batch, regenerated from its environment and seed (:meth:`Scorer.batch_tasks`)."""
        return self.scorer.batch_tasks(batch, doc)

    def publish_tasks(self) -> int:
        """Publish one batch of tasks; returns its number (:meth:`TaskIssuer.publish_tasks`)."""
        return self.issuer.publish_tasks()

    def samples_per_batch(self) -> float:
        """Scored samples per task batch, over recent batches (all replicas' answers together)."""
        return self.issuer.samples_per_batch()

    def issue_tasks(self) -> int:
        """Top up the task batches: what the trainer's demand asks for, else ``queue_depth`` waiting;
        returns the number of batches issued."""
        return self.issuer.issue_tasks()

    def waiting_batches(self) -> list[int]:
        """This simulator's batches that no replica has answered yet."""
        return self.issuer.waiting_batches()

    def prune(self) -> None:
        """Delete old batches and planted task objects (:meth:`TaskIssuer.prune`)."""
        self.issuer.prune()

    # -- scoring ------------------------------------------------------------

    def sample_limits(self) -> SampleLimits:
        """What a rollout may hold (:meth:`Scorer.sample_limits`)."""
        return self.scorer.sample_limits()

    def score_rollouts(self) -> int:
        """Score every valid rollouts object in the bucket; returns the number of samples scored.

        Objects that fail :func:`~rlsync.spaces.exchange.parse_samples` are deleted unscored and counted
        in :attr:`refusals`.
        """
        scored = 0
        listed = list_batches(self.bucket, ROLLOUTS_PREFIX)
        limits = self.sample_limits()  # after listing: every listed rollout was made from a version published by now
        for batch, keys in sorted(listed.items()):
            doc = get_json(self.bucket, task_key(batch))
            try:
                tasks = self.batch_tasks(batch, doc) if isinstance(doc, dict) else None
            except ValueError as exc:
                logger.warning("ignoring task batch %d: %s", batch, exc)
                tasks = None
            for key in keys:
                replica = replica_of(key)
                read = read_samples(self.bucket, key, limits=limits, refusals=self.refusals)
                if tasks is None or read is None or replica is None:  # refused objects are already logged and counted
                    logger.info("dropping %s: refused, or its task batch is gone", key)
                    self.bucket.delete([key])
                    self.issuer.closed.add(batch)
                    continue
                header, samples = read
                kept = [s for s in samples if s.task_id in tasks and s.prompt == tasks[s.task_id].prompt]
                if len(kept) < len(samples):
                    self.failures.add("rollouts", "unknown task or changed prompt", len(samples) - len(kept))
                fresh = [s for s in kept if self.demand is None or s.version >= self.demand.min_version]
                self.figures.cancel(len(kept) - len(fresh))
                if not fresh:  # nothing the trainer would still take: cancelled, not scored
                    self.issuer.closed.add(batch)
                    self.bucket.delete([key])
                    continue
                for s, reward in zip(fresh, self.score_samples([(tasks[s.task_id], s.completion) for s in fresh])):
                    s.reward = reward
                issued_at = doc.get("created_at")
                write_samples(
                    self.bucket, score_key(batch, replica), fresh, batch=batch, replica=replica, env=doc["env"],
                    **({"issued_at": issued_at} if type(issued_at) in (int, float) and math.isfinite(issued_at) else {}),
                )  # fmt: skip
                self.bucket.delete([key])
                self.figures.record(tasks, fresh)
                self.issuer.count_batch(batch, len(fresh))
                scored += len(fresh)
        return scored

    def score_sample(self, task: Task, completion: str) -> float:
        """Score one completion (see :meth:`score_samples`)."""
        return self.score_samples([(task, completion)])[0]

    def score_samples(self, pairs: list[tuple[Task, str]]) -> list[float]:
        """Score ``(task, completion)`` pairs within bounds (:meth:`Scorer.score_samples`); one reward per pair."""
        return self.scorer.score_samples(pairs)

    # -- housekeeping -------------------------------------------------------

    def step(self) -> None:
        """One iteration: top up the task queue, score what arrived, publish figures."""
        self.issue_tasks()
        self.score_rollouts()
        self.prune()
        self.figures.publish(
            tasks_made=self.issuer.tasks_made, demand=self.demand, refusals=self.refusals, failures=self.failures
        )

    # -- lifecycle ----------------------------------------------------------

    def run(self) -> None:
        """Run until :meth:`stop`; bucket errors and failing sources are logged (and counted) and retried,
        waiting twice as long after each failure in a row (up to a minute)."""
        failed = 0
        while not self._stop.is_set():
            since = generation(self.bucket)
            try:
                self.step()
                failed = 0
            except BucketError as exc:
                logger.warning("bucket error, retrying: %s", exc)
                failed += 1
            except Exception as exc:  # a failing source (user code, a remote server) must not end the role
                logger.exception("environment step failed, retrying")
                self.failures.add("step", f"error:{type(exc).__name__}")
                failed += 1
            if failed:  # twice as long after each failure in a row, up to a minute
                self._stop.wait(min(self.config.poll_s * 2 ** min(failed, 16), max(self.config.poll_s, _MAX_BACKOFF_S)))
                continue
            timeout = self.config.poll_s if since is None else IDLE_WAIT_S
            # rollouts to score, or the trainer's demand for more tasks
            wait_for_change(self.bucket, self._stop, timeout, (ROLLOUTS_PREFIX, DEMAND_KEY), since)
        self.figures.metrics.flush(force=True)

    def start(self) -> None:
        """Run in a background thread."""
        if self.running:
            return
        self._stop.clear()
        self.figures.t0 = time.time()
        self._thread = SupervisedThread(self.run, name="env", stop=self._stop, restart=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        close = getattr(self.environment, "close", None)  # sources holding connections (openenv)
        if close is not None:
            close()

    def close(self) -> None:
        """Stop and stop watching the bucket."""
        self.stop()
        if self._owns_watch:
            self.bucket.close()
