"""Scoring completions: user code (reward functions, verifiers, remote environments) on untrusted text.

It runs confined (:class:`~env_space.environments.Scoring`), each sample bounded by ``score_timeout_s``
and each rollouts object by ``score_budget_s``, so one object cannot hold up the others' scores. An
exception, a timeout, a non-finite reward or one beyond ``MAX_REWARD`` scores the sample
``failure_reward`` and counts the reason.
"""

from __future__ import annotations

import time

from rlsync.spaces.exchange import MAX_REWARD

from .bounded import BoundedResult, FailureCounts, ScoringFailure, finite_reward
from .config import EnvConfig
from .environments import Environment, Scoring, Task
from .isolation import Confinement, run_confined


class Scorer:
    """Scores ``(task, completion)`` pairs with an environment, within the simulator's bounds.

    Args:
        environment: What scores.
        config: ``score_timeout_s``, ``score_budget_s``, ``score_memory_mb``, ``failure_reward``.
        failures: Where failures are counted, by reason.
    """

    def __init__(self, environment: Environment, config: EnvConfig, failures: FailureCounts) -> None:
        self.environment, self.config, self.failures = environment, config, failures

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
