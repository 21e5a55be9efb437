"""The environment's figures: rewards per version and per task type, recent episodes, rates."""

from __future__ import annotations

import time
from typing import Any

from rlsync.spaces.exchange import MetricsLog

from .environments import Environment, Task

_EPISODE_CHARS = 400  # prompt tail / completion head kept per recent episode for the panel


class EnvFigures:
    """What the environment mirrors to ``metrics/env.json``.

    Args:
        metrics: The role's metrics log (rows: mean reward per version).
        environment: The environment (its name prefixes the task types).
    """

    def __init__(self, metrics: MetricsLog, environment: Environment) -> None:
        self.metrics, self.environment = metrics, environment
        self.by_type: dict[str, list[float]] = {}  # "<source> / <task type>" -> [reward sum, count]
        self.episodes: list[dict] = []
        self.scored = 0
        self.t0 = time.time()

    def record(self, tasks: dict[str, Task], samples) -> None:
        """Count scored samples: a row per version, the per-type means, the newest episodes."""
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
        self.scored += len(samples)

    def extra(self, **fields: Any) -> dict[str, Any]:
        """The metrics object's state fields: rates since start, episodes, rewards by type, and ``fields``."""
        elapsed = max(time.time() - self.t0, 1e-9)
        return {
            "env": self.environment.name, "episodes": self.episodes, "tasks_per_s": fields.pop("tasks_made") / elapsed,
            "scores_per_s": self.scored / elapsed, "scored": self.scored,
            "by_type": {k: {"mean_reward": s / n, "count": n} for k, (s, n) in self.by_type.items()}, **fields,
        }  # fmt: skip
