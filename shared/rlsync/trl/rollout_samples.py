"""Scored samples as TRL rollout samples (:class:`SampleGroups`): the usable ones (:func:`usable_sample`), not too
stale, grouped by task, each with its group-normalised advantage (:func:`group_advantages`), as TRL
``RolloutSample`` objects (:func:`to_rollout_sample`; the alignment: :mod:`rlsync.trl.rollout_worker`)."""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..sampling import degenerate_group, sampled_logprob_ok
from ..scores import Sample


def group_advantages(rewards: Sequence[float]) -> np.ndarray:
    """Group-normalised advantages: reward minus the group mean, over the group std plus 1e-8."""
    arr = np.asarray(rewards, dtype=np.float64)
    return (arr - arr.mean()) / (arr.std() + 1e-8)


def to_rollout_sample(sample: Sample, advantage: float, group_id: int, model_version: int) -> RolloutSample:
    """One scored sample as a TRL ``RolloutSample`` (see the module docstring for the alignment)."""
    prompt_len, completion_len = len(sample.prompt_ids), len(sample.token_ids)
    return RolloutSample(
        prompt=[{"role": "user", "content": sample.prompt}],
        completion=[{"role": "assistant", "content": sample.completion}],
        input_ids=np.asarray(list(sample.prompt_ids) + list(sample.token_ids), dtype=np.int64),
        completion_mask=np.concatenate([np.zeros(prompt_len, np.int64), np.ones(completion_len, np.int64)]),
        old_log_probs=np.concatenate([np.zeros(prompt_len, np.float32), np.asarray(sample.logprobs, np.float32)]),
        advantage=float(advantage),
        model_version=int(model_version),
        group_id=int(group_id),
        metrics={"reward": float(sample.reward or 0.0)},
        enqueued_at=time.time(),
    )


def usable_sample(sample: Sample, *, newest_version: int, vocab_size: int, max_tokens: int) -> bool:
    """Whether a scored sample may be trained on: published versions (its first, and its last when it spans an
    update), a finite reward, prompt and completion
    ids in the vocabulary and within ``max_tokens`` (0: no limit), one sampled log-probability per token."""
    ids = list(sample.prompt_ids) + list(sample.token_ids)
    return (
        type(sample.version) is int
        and 0 <= sample.version <= newest_version
        and (sample.last_version is None or sample.version <= sample.last_version <= newest_version)
        and sample.reward is not None
        and math.isfinite(sample.reward)
        and len(sample.token_ids) > 0
        and len(sample.prompt_ids) > 0
        and len(sample.logprobs) == len(sample.token_ids)
        and all(0 <= t < vocab_size for t in ids)
        and all(sampled_logprob_ok(x) for x in sample.logprobs)
        and (not max_tokens or len(ids) <= max_tokens)
    )


class SampleGroups:
    """Turns the samples of one scores object into TRL rollout samples, a group per task, counting what it drops.

    Args:
        counts: Where the drops and reads are counted (``invalid``, ``dropped_stale``, ``read``,
            ``degenerate_groups``, ``dropped_degenerate``).
        max_group_size: Largest group kept (larger ones are degenerate: see :mod:`rlsync.sampling`).
    """

    def __init__(self, counts: collections.Counter, max_group_size: int) -> None:
        self.counts = counts
        self.max_group_size = max_group_size
        self._next_group = 0

    def rollouts(
        self,
        samples: Sequence[Sample],
        *,
        usable: Callable[[Sample], bool],
        version: Callable[[int], int],
        stale: Callable[[int], bool],
    ) -> Iterator[RolloutSample]:
        """The rollout samples of ``samples``, made one at a time as they are taken: those ``usable`` and not
        ``stale`` (in the trainer's numbering, ``version``), in groups that are not degenerate."""
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            if not usable(s):
                self.counts["invalid"] += 1
                continue
            if stale(version(s.version)):
                self.counts["dropped_stale"] += 1
                continue
            groups.setdefault(s.task_id, []).append(s)
        self.counts["read"] += len(samples)
        for group in groups.values():
            if degenerate_group(len(group), self.max_group_size):
                self.counts["degenerate_groups"] += 1
                self.counts["dropped_degenerate"] += len(group)
                continue
            advantages = group_advantages([float(s.reward) for s in group])  # type: ignore[arg-type]
            group_id, self._next_group = self._next_group, self._next_group + 1
            for sample, advantage in zip(group, advantages):
                yield to_rollout_sample(sample, advantage, group_id, version(sample.version))
