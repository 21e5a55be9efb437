"""The environment's figures (:class:`EnvFigures`): rewards per policy version and per source and task type,
recent episodes, rates and counts, mirrored to ``metrics/env.json``, and its summary line per interval."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rlsync.bucket import Bucket
from rlsync.bucket.budget import RequestMeter
from rlsync.spaces.demand import Demand, Pacing
from rlsync.spaces.exchange import Refusals
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.metrics import EPISODES, EnvMetrics, Episode, HubCounts, MetricsLog, RefusalCounts, RewardRow, TypeReward

from .bounded import FailureCounts
from .environments import Task

_EPISODE_CHARS = 400  # prompt tail / completion head kept per recent episode for the panel


class EnvFigures:
    """What the environment has done, for its panel and its log.

    Args:
        bucket: Where ``metrics/env.json`` goes.
        meter: The bucket's request meter (``None``: not metered; the metrics object is then written at every step).
        every_s: Seconds between writes of the metrics object on a metered bucket.
        logger: Where the summary line goes.
        name: The environment's current name.
    """

    def __init__(
        self, bucket: Bucket, meter: RequestMeter | None, every_s: float, logger: logging.Logger, name: Callable[[], str]
    ) -> None:
        self.meter = meter
        self.name = name
        self.metrics = MetricsLog(bucket, EnvMetrics, every_s=every_s if meter is not None else 0.0)
        self.by_type: dict[str, list[float]] = {}  # "<source> / <task type>" -> [reward sum, count]
        self.episodes: list[Episode] = []
        self.scored = 0
        self.cancelled = 0
        self.t0 = time.time()
        self.summary = IntervalLog(logger, self._summary_line)

    def cancel(self, count: int) -> None:
        """``count`` samples cancelled unscored (too stale for the trainer)."""
        self.cancelled += count
        self.summary.add(cancelled=count)

    def record(self, tasks: dict[str, Task], samples: list[Any]) -> None:
        """Scored ``samples`` of ``tasks``: their rewards per version and per task type, a few as recent episodes."""
        if not samples:
            return
        source = self.name().partition(":")[0]
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
        self.scored += len(samples)

    def publish(self, *, tasks_made: int, demand: Demand | None, refusals: Refusals, failures: FailureCounts) -> None:
        """Write the figures to ``metrics/env.json`` (when due) and the summary line (when due)."""
        elapsed = max(time.time() - self.t0, 1e-9)
        self.metrics.state = EnvMetrics(
            env=self.name(),
            episodes=list(self.episodes),
            tasks_per_s=tasks_made / elapsed,
            scores_per_s=self.scored / elapsed,
            scored=self.scored,
            cancelled_stale=self.cancelled,
            pacing=Pacing.QUEUE if demand is None else Pacing.DEMAND,
            refused=RefusalCounts.of(refusals),
            failures=failures.as_dict(),
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
        return f"env {self.name()} ({seconds:.0f}s): " + ", ".join(parts)
