"""The environment simulator role: tasks out, rewards back, only through the bucket.

Each iteration it issues task batches at the rate the trainer consumes them
(the trainer's ``control/demand.json``, see :mod:`rlsync.spaces.demand`; without
one it keeps ``queue_depth`` batches waiting), scores every rollouts object that
replicas wrote (cancelling those already too stale for the trainer) (regenerating the batch's
tasks from its seed, so answers never leave the environment), writes the
scored samples for the trainer, and mirrors its figures to ``metrics/env.json``.

Its parts, one job each: :class:`~env_space.batches.TaskIssuer` (numbering, issuing at the
trainer's demand, pruning), :class:`~env_space.scoring.Scorer` (user code on untrusted completions,
confined and bounded; a failure scores ``failure_reward`` and is counted) and
:class:`~env_space.env_figures.EnvFigures` (what ``metrics/env.json`` shows). This class reads
the rollouts, matches them to their tasks, cancels the stale ones and writes the scores.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from rlsync.adapters import adapter_bucket
from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, meter_of, wait_for_change
from rlsync.errors import BucketError, FormatError
from rlsync.layout import DEMAND_KEY, ROLLOUTS_PREFIX, replica_of, score_key, task_key
from rlsync.protocol import read_manifest
from rlsync.spaces.exchange import (
    MetricsLog,
    Refusals,
    SampleLimits,
    get_json,
    list_batches,
    open_role_bucket,
    read_samples,
    write_samples,
)

from .batches import TaskIssuer
from .bounded import FailureCounts
from .config import EnvConfig
from .env_figures import EnvFigures
from .environments import Environment, Task
from .scoring import Scorer
from .sources import open_environment
from .sources.settings import source_settings

logger = logging.getLogger(__name__)
_MAX_BACKOFF_S = 60.0  # longest wait between steps after failures in a row


class EnvSimulator:
    """Publishes task batches and scores the completions replicas write back.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: EnvConfig, bucket: Bucket | None = None) -> None:
        self.config = config
        self.bucket = open_role_bucket("env", config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        settings = source_settings(config.environment, config.source_settings)
        self._environment: Environment = open_environment(
            config.environment, chat_template=config.chat_template, settings=settings
        )
        self.failures = FailureCounts()
        self.refusals = Refusals()
        self.metrics = MetricsLog(self.bucket, "env", every_s=config.metrics_every_s if self.meter is not None else 0.0)
        self.issuer = TaskIssuer(self.bucket, self.environment, config, self.failures, self.refusals)
        self.scorer = Scorer(self.environment, config, self.failures)
        self.figures = EnvFigures(self.metrics, self.environment)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancelled = 0

    @property
    def environment(self) -> Environment:
        """The environment making and scoring the tasks (setting it sets it for every part)."""
        return self._environment

    @environment.setter
    def environment(self, environment: Environment) -> None:
        self._environment = environment
        for part in (self.issuer, self.scorer, self.figures):
            part.environment = environment

    # -- the parts' work, by name -------------------------------------------

    def batch_tasks(self, batch: int, doc: dict) -> dict[str, Task]:
        """The tasks of a batch, regenerated from its seed (:meth:`TaskIssuer.batch_tasks`)."""
        return self.issuer.batch_tasks(batch, doc)

    def publish_tasks(self) -> int:
        """Publish one batch of tasks (:meth:`TaskIssuer.publish_tasks`); returns its number."""
        return self.issuer.publish_tasks()

    def prune(self) -> None:
        """Delete old batches and planted ones (:meth:`TaskIssuer.prune`)."""
        self.issuer.prune()

    def score_sample(self, task: Task, completion: str) -> float:
        """Score one completion (:meth:`Scorer.score_sample`)."""
        return self.scorer.score_sample(task, completion)

    def score_samples(self, pairs: list[tuple[Task, str]]) -> list[float]:
        """Score ``(task, completion)`` pairs within the bounds (:meth:`Scorer.score_samples`)."""
        return self.scorer.score_samples(pairs)

    # -- scoring ------------------------------------------------------------

    def sample_limits(self) -> SampleLimits:
        """What a rollout may hold: token ids below ``vocab_size`` (when set), versions no newer
        than the newest published one (the adapter chain's in a LoRA run; none published yet: only version 0)."""
        try:
            manifest = read_manifest(adapter_bucket(self.bucket)) or read_manifest(self.bucket)
        except FormatError:
            manifest = None
        return SampleLimits(
            vocab_size=self.config.vocab_size or None,
            max_version=manifest.step if manifest is not None else 0,
            max_completion_tokens=self.config.max_completion_tokens,
        )

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
                demand = self.issuer.demand
                fresh = [s for s in kept if demand is None or s.version >= demand.min_version]
                self._cancelled += len(kept) - len(fresh)
                if not fresh:  # nothing the trainer would still take: cancelled, not scored
                    self.issuer.closed.add(batch)
                    self.bucket.delete([key])
                    continue
                for s, reward in zip(fresh, self.scorer.score_samples([(tasks[s.task_id], s.completion) for s in fresh])):
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

    # -- housekeeping -------------------------------------------------------

    def step(self) -> None:
        """One iteration: top up the task queue, score what arrived, publish figures."""
        self.issuer.issue_tasks()
        self.score_rollouts()
        self.issuer.prune()
        self.metrics.extra = self.figures.extra(
            tasks_made=self.issuer.tasks_made, cancelled_stale=self._cancelled,
            pacing="queue" if self.issuer.demand is None else "demand", refused=self.refusals.as_dict(),
            failures=self.failures.as_dict(), **({"hub": self.meter.snapshot()} if self.meter is not None else {}),
        )  # fmt: skip
        self.metrics.flush()

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
        self.metrics.flush(force=True)

    def start(self) -> None:
        """Run in a background thread."""
        if self.running:
            return
        self._stop.clear()
        self.figures.t0 = time.time()
        self._thread = threading.Thread(target=self.run, name="env", daemon=True)
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

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
