"""The environment simulator role: tasks out, rewards back, only through the bucket.

Each iteration it keeps ``queue_depth`` task batches waiting for replicas,
scores every rollouts object that replicas wrote (regenerating the batch's
tasks from its seed, so answers never leave the environment), writes the
scored samples for the trainer, and mirrors its figures to ``metrics/env.json``.

Scoring runs user code (reward functions, verifiers, remote environments), so each
call is bounded by ``score_timeout_s``; an exception, a timeout or a non-finite
reward scores the sample ``failure_reward`` and counts the reason, and the
simulator carries on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from rlsync.bucket import Bucket, BucketError, open_bucket
from rlsync.errors import FormatError
from rlsync.spaces.exchange import (
    ROLLOUTS_PREFIX,
    SCORES_PREFIX,
    TASKS_PREFIX,
    MetricsLog,
    Refusals,
    SampleLimits,
    get_json,
    list_batches,
    put_json,
    read_samples,
    replica_of,
    score_key,
    task_key,
    write_samples,
)
from rlsync.adapters import adapter_bucket
from rlsync.protocol import read_manifest
from rlsync.spaces.settings import from_env

from .bounded import FailureCounts, call_bounded, finite_reward
from .environments import Environment, Task
from .sources import open_environment
from .sources.settings import source_settings

logger = logging.getLogger(__name__)
_EPISODE_CHARS = 400  # prompt tail / completion head kept per recent episode for the panel


@dataclasses.dataclass
class EnvConfig:
    """Settings of the environment Space (environment variables ``ENV_<FIELD>``)."""

    bucket: str = dataclasses.field(default="./runs/bucket", metadata={"help": "bucket URL or path"})
    environment: str = dataclasses.field(
        default="reverse",
        metadata={"help": "reverse | arithmetic | reasoning_gym:NAME[=W],... | dataset:HUB_ID_OR_PATH | openenv:URL"},
    )
    chat_template: str = dataclasses.field(
        default="", metadata={"help": "model id/path whose chat template formats source prompts ('' = plain text)"}
    )
    source_settings: str = dataclasses.field(
        default="", metadata={"help": "JSON object of source settings, over the ENV_RG_/ENV_DATASET_/ENV_OPENENV_ variables"}
    )
    score_timeout_s: float = dataclasses.field(default=10.0, metadata={"help": "time bound of one scoring call"})
    failure_reward: float = dataclasses.field(default=0.0, metadata={"help": "reward of a sample whose scoring failed"})
    tasks_per_batch: int = dataclasses.field(default=8, metadata={"help": "tasks in one batch"})
    queue_depth: int = dataclasses.field(default=2, metadata={"help": "batches kept waiting for replicas"})
    keep_batches: int = dataclasses.field(default=64, metadata={"help": "batches kept in the bucket"})
    poll_s: float = dataclasses.field(default=0.5, metadata={"help": "seconds between bucket polls"})
    seed: int = dataclasses.field(default=0, metadata={"help": "base seed of task generation"})
    vocab_size: int = dataclasses.field(default=0, metadata={"help": "refuse token ids at or above it (0: the trainer checks them)"})
    max_completion_tokens: int = dataclasses.field(default=4096, metadata={"help": "refuse rollouts with longer completions"})

    @classmethod
    def from_env(cls, **overrides) -> "EnvConfig":
        return from_env(cls, "ENV", **overrides)


class EnvSimulator:
    """Publishes task batches and scores the completions replicas write back.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
    """

    def __init__(self, config: EnvConfig, bucket: Bucket | None = None) -> None:
        self.config = config
        self.bucket = bucket or open_bucket(config.bucket)
        settings = source_settings(config.environment, config.source_settings)
        self.environment: Environment = open_environment(
            config.environment, chat_template=config.chat_template, settings=settings
        )
        self.failures = FailureCounts()
        self.by_type: dict[str, list[float]] = {}  # "<source> / <task type>" -> [reward sum, count]
        self.metrics = MetricsLog(self.bucket, "env")
        self.episodes: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tasks_made = 0
        self._scored = 0
        self._t0 = time.time()
        self.refusals = Refusals()

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
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"task batch {batch}: {exc}") from None
        return {t.task_id: t for t in env.tasks(n, seed=seed)}

    def publish_tasks(self) -> int:
        """Publish one batch of tasks; returns its number."""
        batches = list_batches(self.bucket, TASKS_PREFIX)
        batch = max(batches, default=-1) + 1
        seed = self.config.seed * 1_000_003 + batch
        tasks = self.environment.tasks(self.config.tasks_per_batch, seed=seed)
        put_json(self.bucket, task_key(batch), {
            "batch": batch, "env": self.environment.name, "seed": seed, "n": len(tasks), "created_at": time.time(),
            "tasks": [{"task_id": t.task_id, "prompt": t.prompt} for t in tasks],
        })  # fmt: skip
        self._tasks_made += len(tasks)
        logger.info("published task batch %d (%d %s tasks)", batch, len(tasks), self.environment.name)
        return batch

    def waiting_batches(self) -> list[int]:
        """Batches no replica has answered yet."""
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        return [b for b in list_batches(self.bucket, TASKS_PREFIX) if b not in answered]

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
                    continue
                header, samples = read
                kept = [s for s in samples if s.task_id in tasks and s.prompt == tasks[s.task_id].prompt]
                if len(kept) < len(samples):
                    self.failures.add("rollouts", "unknown task or changed prompt", len(samples) - len(kept))
                for s in kept:
                    s.reward = self.score_sample(tasks[s.task_id], s.completion)
                write_samples(self.bucket, score_key(batch, replica), kept, batch=batch, replica=replica, env=doc["env"])
                self.bucket.delete([key])
                self._record(tasks, kept)
                scored += len(kept)
        return scored

    def score_sample(self, task: Task, completion: str) -> float:
        """Score one completion, bounded in time; a failure scores ``failure_reward`` and is counted."""
        result = call_bounded(self.environment.score, task, completion, timeout_s=self.config.score_timeout_s)
        if result.ok:
            result = finite_reward(result.value)
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
            self.metrics.add(version=v, mean_reward=sum(rewards) / len(rewards), count=len(rewards))
        for s in samples[:4]:
            self.episodes.append({
                "version": s.version, "type": tasks[s.task_id].meta.get("type", source),
                "prompt": s.prompt[-_EPISODE_CHARS:], "completion": s.completion[:_EPISODE_CHARS],
                "reward": round(s.reward, 3),
            })  # fmt: skip
        del self.episodes[:-20]
        self._scored += len(samples)

    # -- housekeeping -------------------------------------------------------

    def prune(self) -> None:
        """Delete tasks, rollouts and scores of batches older than ``keep_batches``."""
        batches = list_batches(self.bucket, TASKS_PREFIX)
        if not batches:
            return
        cutoff = max(batches) - self.config.keep_batches
        old = [k for prefix in (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX)
               for b, keys in list_batches(self.bucket, prefix).items() if b < cutoff for k in keys]  # fmt: skip
        if old:
            self.bucket.delete(old)

    def step(self) -> None:
        """One iteration: top up the task queue, score what arrived, publish figures."""
        while len(self.waiting_batches()) < self.config.queue_depth:
            self.publish_tasks()
        self.score_rollouts()
        self.prune()
        elapsed = max(time.time() - self._t0, 1e-9)
        self.metrics.extra = {
            "env": self.environment.name,
            "episodes": self.episodes,
            "tasks_per_s": self._tasks_made / elapsed,
            "scores_per_s": self._scored / elapsed,
            "scored": self._scored,
            "refused": self.refusals.as_dict(),
            "failures": self.failures.as_dict(),
            "by_type": {k: {"mean_reward": s / n, "count": n} for k, (s, n) in self.by_type.items()},
        }
        self.metrics.flush()

    # -- lifecycle ----------------------------------------------------------

    def run(self) -> None:
        """Run until :meth:`stop`; bucket errors and failing sources are logged (and counted) and retried."""
        while not self._stop.is_set():
            try:
                self.step()
            except BucketError as exc:
                logger.warning("bucket error, retrying: %s", exc)
            except Exception as exc:  # a failing source (user code, a remote server) must not end the role
                logger.exception("environment step failed, retrying")
                self.failures.add("step", f"error:{type(exc).__name__}")
            self._stop.wait(self.config.poll_s)

    def start(self) -> None:
        """Run in a background thread."""
        if self.running:
            return
        self._stop.clear()
        self._t0 = time.time()
        self._thread = threading.Thread(target=self.run, name="env", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        close = getattr(self.environment, "close", None)  # sources holding connections (openenv)
        if close is not None:
            close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
