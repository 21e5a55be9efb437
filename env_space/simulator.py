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
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time

from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, meter_of, wait_for_change
from rlsync.errors import BucketError
from rlsync.layout import (
    CLAIMS_PREFIX,
    DEMAND_KEY,
    MAX_BATCH,
    ROLLOUTS_PREFIX,
    SCORES_PREFIX,
    TASKS_PREFIX,
    replica_of,
    score_key,
    task_key,
)
from rlsync.limits import MAX_OBJECT_BYTES
from rlsync.spaces.demand import Demand, Pacing, batches_to_issue, batches_wanted, newest_version, read_demand
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.exchange import (
    MAX_REWARD,
    MAX_TASKS,
    Refusals,
    SampleLimits,
    get_json,
    list_batches,
    open_role_bucket,
    parse_tasks,
    put_json,
    read_samples,
    write_samples,
)
from rlsync.spaces.metrics import (
    EPISODES,
    EnvMetrics,
    Episode,
    HubCounts,
    MetricsLog,
    RefusalCounts,
    RewardRow,
    TypeReward,
)
from rlsync.supervised import SupervisedThread

from .bounded import BoundedResult, FailureCounts, ScoringFailure, finite_reward
from .config import EnvConfig
from .environments import Environment, Scoring, Task
from .isolation import Confinement, run_confined
from .sources import open_environment
from .sources.settings import source_settings

logger = logging.getLogger(__name__)
_EPISODE_CHARS = 400  # prompt tail / completion head kept per recent episode for the panel
_MAX_BACKOFF_S = 60.0  # longest wait between steps after failures in a row
_RESUME_BELOW = 10**9  # a restart resumes only below this (a batch a second for 31 years): headroom to MAX_BATCH
_SAMPLES_PER_TASK = 4  # the replicas' default G, until the env has measured samples per batch


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
        self.environment: Environment = open_environment(
            config.environment, chat_template=config.chat_template, settings=settings
        )
        self.failures = FailureCounts()
        self.by_type: dict[str, list[float]] = {}  # "<source> / <task type>" -> [reward sum, count]
        self.metrics = MetricsLog(self.bucket, EnvMetrics, every_s=config.metrics_every_s if self.meter is not None else 0.0)
        self.episodes: list[Episode] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tasks_made = 0
        self._next_batch: int | None = None  # resumed from the bucket at the first publish
        self._scored = 0
        self._cancelled = 0
        self._t0 = time.time()
        self.refusals = Refusals()
        self.summary = IntervalLog(logger, self._summary_line)
        self.demand: Demand | None = None
        self._batch_samples: collections.OrderedDict[int, int] = collections.OrderedDict()  # recent batch -> samples scored
        self._closed: set[int] = set()  # batches whose rollouts were cancelled or refused: nothing more in flight

    # -- tasks --------------------------------------------------------------

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

    def _own_next(self) -> int:
        """The next batch number this simulator will publish."""
        if self._next_batch is None:
            self._next_batch = self._resume_batch()
        return self._next_batch

    def publish_tasks(self) -> int:
        """Publish one batch of tasks; returns its number.

        Raises:
            RuntimeError: The batch numbers are used up (``MAX_BATCH``).
        """
        batch = self._own_next()
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
            self._next_batch = batch + 1  # this seed makes an object no replica reads: skip its number
            self.failures.add("tasks", "unreadable batch skipped")
            raise ValueError(f"task batch {batch} would be refused by replicas: {exc}") from None
        put_json(self.bucket, task_key(batch), doc)
        self._next_batch = batch + 1
        self._tasks_made += len(tasks)
        logger.debug("published task batch %d (%d %s tasks)", batch, len(tasks), self.environment.name)
        self.summary.add(batches=1)
        return batch

    def samples_per_batch(self) -> float:
        """Scored samples per task batch, over recent batches (all replicas' answers together)."""
        if not self._batch_samples:
            return float(self.config.tasks_per_batch * _SAMPLES_PER_TASK)
        return sum(self._batch_samples.values()) / len(self._batch_samples)

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
        self._closed &= set(batches)
        scored = set(list_batches(self.bucket, SCORES_PREFIX))
        per_batch = self.samples_per_batch()
        if batches_wanted(self.demand, per_batch) > self.config.keep_batches:
            self.refusals.add(DEMAND_KEY, f"want_samples asks for more than the {self.config.keep_batches} batches kept")
        count = batches_to_issue(self.demand, batches, scored, self._closed, per_batch, self.config.keep_batches)
        for _ in range(count):
            self.publish_tasks()
        return count

    def waiting_batches(self) -> list[int]:
        """This simulator's batches that no replica has answered yet."""
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        newest = self._own_next()
        return [b for b in list_batches(self.bucket, TASKS_PREFIX) if b not in answered and b < newest]

    # -- scoring ------------------------------------------------------------

    def sample_limits(self) -> SampleLimits:
        """What a rollout may hold: token ids below ``vocab_size`` (when set), versions no newer
        than the newest published one (the adapter chain's in a LoRA run; none published yet: only version 0)."""
        return SampleLimits(
            vocab_size=self.config.vocab_size or None,
            max_version=newest_version(self.bucket),
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
                    self._closed.add(batch)
                    continue
                header, samples = read
                kept = [s for s in samples if s.task_id in tasks and s.prompt == tasks[s.task_id].prompt]
                if len(kept) < len(samples):
                    self.failures.add("rollouts", "unknown task or changed prompt", len(samples) - len(kept))
                fresh = [s for s in kept if self.demand is None or s.version >= self.demand.min_version]
                self._cancelled += len(kept) - len(fresh)
                self.summary.add(cancelled=len(kept) - len(fresh))
                if not fresh:  # nothing the trainer would still take: cancelled, not scored
                    self._closed.add(batch)
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
                self._record(tasks, fresh)
                self._count_batch(batch, len(fresh))
                scored += len(fresh)
        return scored

    def _count_batch(self, batch: int, samples: int) -> None:
        self._batch_samples[batch] = self._batch_samples.get(batch, 0) + samples
        self._batch_samples.move_to_end(batch)
        while len(self._batch_samples) > 16:
            self._batch_samples.popitem(last=False)

    def score_sample(self, task: Task, completion: str) -> float:
        """Score one completion (see :meth:`score_samples`)."""
        return self.score_samples([(task, completion)])[0]

    def score_samples(self, pairs: list[tuple[Task, str]]) -> list[float]:
        """Score ``(task, completion)`` pairs (one rollouts object), each bounded by ``score_timeout_s`` and
        all by ``score_budget_s``; a failure scores ``failure_reward`` and is counted.

        Returns:
            One reward per pair.
        """
        config = self.config
        if self.environment.scoring is Scoring.CONFINED:
            confinement = Confinement(config.score_timeout_s, config.score_budget_s, config.score_memory_mb)
            results = run_confined(lambda pair: self.environment.score(*pair), pairs, confinement)
        else:
            results = self._score_in_process(pairs)
        return [self._reward(result) for result in results]

    def _score_in_process(self, pairs: list[tuple[Task, str]]) -> list[BoundedResult]:
        """For :attr:`Scoring.SELF_BOUNDED` environments: each call bounds itself; the budget is checked between calls."""
        deadline = time.monotonic() + self.config.score_budget_s
        results = []
        for task, completion in pairs:
            if time.monotonic() >= deadline:
                results.append(BoundedResult(failure="budget"))
                continue
            try:
                results.append(BoundedResult(self.environment.score(task, completion)))
            except ScoringFailure as exc:
                results.append(BoundedResult(failure=exc.reason))
            except Exception as exc:  # noqa: BLE001 - user code or a remote server: anything it raises is a failure
                results.append(BoundedResult(failure=f"error:{type(exc).__name__}"))
        return results

    def _reward(self, result: BoundedResult) -> float:
        if result.ok:
            result = finite_reward(result.value)
        if result.ok and abs(result.value) > MAX_REWARD:
            result = BoundedResult(failure="out_of_range")
        if not result.ok:
            self.failures.add("score", result.failure)
            return self.config.failure_reward
        return result.value

    def _record(self, tasks: dict[str, Task], samples) -> None:
        if not samples:
            return
        source = self.environment.name.partition(":")[0]
        for s in samples:
            total = self.by_type.setdefault(f"{source} / {tasks[s.task_id].meta.get('type', source)}", [0.0, 0])
            total[0] += s.reward
            total[1] += 1
        versions = sorted({s.version for s in samples})
        for v in versions:
            rewards = [s.reward for s in samples if s.version == v]
            self.metrics.add(RewardRow(version=v, mean_reward=sum(rewards) / len(rewards), count=len(rewards)))
        self.summary.add(scored=len(samples), reward=sum(s.reward for s in samples))
        self.summary.note(version=versions[-1])
        for s in samples[:4]:
            self.episodes.append(Episode(
                version=s.version, type=tasks[s.task_id].meta.get("type", source),
                prompt=s.prompt[-_EPISODE_CHARS:], completion=s.completion[:_EPISODE_CHARS], reward=round(s.reward, 3),
            ))  # fmt: skip
        del self.episodes[:-EPISODES]
        self._scored += len(samples)

    # -- housekeeping -------------------------------------------------------

    def prune(self) -> None:
        """Delete tasks, rollouts and scores of batches older than the newest ``keep_batches`` task batches
        (by rank, so a jump in numbering deletes nothing early), and task objects ahead of this simulator's
        numbering (planted; counted as refused)."""
        newest = self._own_next()
        behind = sorted(b for b in list_batches(self.bucket, TASKS_PREFIX) if b < newest)
        cutoff = behind[-self.config.keep_batches] if len(behind) > self.config.keep_batches else -1
        old = [k for prefix in (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX, CLAIMS_PREFIX)
               for b, keys in list_batches(self.bucket, prefix).items() if b < cutoff for k in keys]  # fmt: skip
        ahead = [k for b, keys in list_batches(self.bucket, TASKS_PREFIX).items() if b >= newest for k in keys]
        for key in ahead:
            self.refusals.add(key, "a task batch ahead of the environment's own numbering")
        if old or ahead:
            self.bucket.delete(old + ahead)

    def step(self) -> None:
        """One iteration: top up the task queue, score what arrived, publish figures."""
        self.issue_tasks()
        self.score_rollouts()
        self.prune()
        elapsed = max(time.time() - self._t0, 1e-9)
        self.metrics.state = EnvMetrics(
            env=self.environment.name,
            episodes=list(self.episodes),
            tasks_per_s=self._tasks_made / elapsed,
            scores_per_s=self._scored / elapsed,
            scored=self._scored,
            cancelled_stale=self._cancelled,
            pacing=Pacing.QUEUE if self.demand is None else Pacing.DEMAND,
            refused=RefusalCounts.of(self.refusals),
            failures=self.failures.as_dict(),
            by_type={k: TypeReward(mean_reward=s / n, count=n) for k, (s, n) in self.by_type.items()},
            hub=HubCounts(**self.meter.snapshot()) if self.meter is not None else None,
        )
        self.metrics.flush()
        self.summary.flush()

    def _summary_line(self, counts, latest: dict, seconds: float) -> str:
        """The env's line per interval: batches issued, samples scored and their mean reward, cancellations."""
        parts = [f"issued {int(counts['batches'])} task batches"]
        if counts["scored"]:
            parts.append(f"scored {int(counts['scored'])} samples (mean reward {counts['reward'] / counts['scored']:.3f}, "
                         f"newest version {latest.get('version')})")  # fmt: skip
        if counts["cancelled"]:
            parts.append(f"cancelled {int(counts['cancelled'])} stale")
        return f"env {self.environment.name} ({seconds:.0f}s): " + ", ".join(parts)

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
        self._t0 = time.time()
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

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
