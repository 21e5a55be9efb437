"""Scoring completions within bounds (:class:`Scorer`, one part of :class:`~env_space.simulator.EnvSimulator`).

Scoring runs user code (reward functions, verifiers, remote environments) on untrusted completions: it runs
confined (:class:`~env_space.environments.Scoring`), each sample bounded by ``score_timeout_s`` and each
rollouts object by ``score_budget_s``. An exception, a timeout, a non-finite reward or one beyond
``MAX_REWARD`` scores the sample ``failure_reward`` and counts the reason.
"""

from __future__ import annotations

import functools
import time

from rlsync.bucket import Bucket
from rlsync.spaces.demand import newest_version
from rlsync.spaces.exchange import MAX_REWARD, MAX_TASKS, SampleLimits

from .bounded import BoundedResult, FailureCounts, ScoringFailure, finite_reward
from .config import EnvConfig
from .environments import Environment, Scoring, Task
from .isolation import Confinement, modules_of, run_confined, start_scoring_server


def _score(environment: Environment, pair: tuple[Task, str]) -> float:
    """``environment.score(task, completion)``: module level, pickled to a confined child with the environment."""
    return environment.score(*pair)


class Scorer:
    """Scores ``(task, completion)`` pairs with an environment, within the configured bounds.

    Args:
        config: The simulator's settings (``score_*``, ``failure_reward``, the sample limits).
        bucket: The role's bucket (the newest published version bounds a sample's).
        environment: Regenerates tasks and scores completions.
        failures: Where failed scores are counted.
    """

    def __init__(self, config: EnvConfig, bucket: Bucket, environment: Environment, failures: FailureCounts) -> None:
        self.config = config
        self.bucket = bucket
        self.environment = environment
        self.failures = failures
        if environment.scoring is Scoring.CONFINED:  # the helper its scoring children come from, warm
            start_scoring_server(modules_of(functools.partial(_score, environment)))

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

    def sample_limits(self) -> SampleLimits:
        """What a rollout may hold: token ids below ``vocab_size`` (when set), versions no newer
        than the newest published one (the adapter chain's in a LoRA run; none published yet: only version 0)."""
        return SampleLimits(
            vocab_size=self.config.vocab_size or None,
            max_version=newest_version(self.bucket),
            max_completion_tokens=self.config.max_completion_tokens,
        )

    def score_samples(self, pairs: list[tuple[Task, str]]) -> list[float]:
        """Score ``(task, completion)`` pairs (one rollouts object), each bounded by ``score_timeout_s`` and
        all by ``score_budget_s``; a failure scores ``failure_reward`` and is counted.

        Returns:
            One reward per pair.
        """
        config = self.config
        if self.environment.scoring is Scoring.CONFINED:
            confinement = Confinement(config.score_timeout_s, config.score_budget_s, config.score_memory_mb)
            results = run_confined(functools.partial(_score, self.environment), pairs, confinement)
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
