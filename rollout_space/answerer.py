"""A replica's answers: G completions per task of a batch, at the policy version it serves.

:class:`TaskAnswerer` reads a task batch (an untrusted object: refused and counted when malformed),
bounds its cost in tokens (:mod:`rollout_space.token_budget`), generates with a seed of its own
(racing replicas add new samples, not copies) and writes the samples under ``rollouts/``.

Demand (``control/demand.json``, :mod:`rlsync.spaces.demand`): a replica does not start a batch
whose samples would be too stale by the time the trainer gets them (its version too far behind the
trainer's, given its own measured generation time); it waits for newer weights instead and counts
the skip (:meth:`TaskAnswerer.fresh_enough`).
"""

from __future__ import annotations

import hashlib
import time

from rlsync.bucket import Bucket
from rlsync.layout import rollout_key, task_key
from rlsync.spaces.demand import newest_version, read_demand, would_be_stale
from rlsync.spaces.exchange import Refusals, Sample, get_json, parse_tasks, write_samples
from rlsync.spaces.interval_log import IntervalLog

from .adapters import AdapterFollower
from .claims import BatchClaims
from .config import ReplicaConfig
from .engine import Engine, SamplingSettings
from .token_budget import TokenBudget, context_length, plan_batch
from .weights import Follower

#: Weight of the newest batch in the moving average of a batch's generation time.
GEN_TIME_WEIGHT = 0.3


class TaskAnswerer:
    """Answers a replica's task batches.

    Args:
        bucket: The run's bucket.
        replica_id: The replica's id (its claims, its answers' keys, its sampling seed).
        engine: The engine generating completions.
        model: The model folder the engine serves (its tokenizer and context length).
        config: The replica's settings (samples per task, lengths, temperature, seed).
        weights: The weights' follower (its version is the policy version without LoRA).
        adapters: The adapter follower in a LoRA run (its version is the policy version), else ``None``.
        summary: The replica's interval log, counting batches, samples and skips.
    """

    def __init__(
        self, bucket: Bucket, replica_id: str, engine: Engine, model: str, config: ReplicaConfig, *,
        weights: Follower, adapters: AdapterFollower | None, summary: IntervalLog,
    ) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        self.bucket, self.replica_id, self.config, self.summary = bucket, replica_id, config, summary
        self.engine = engine
        self.weights, self.adapters = weights, adapters  # what the policy version is read from
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.budget = TokenBudget(
            max_prompt_tokens=config.max_prompt_tokens or max(1, context_length(model) - config.max_new_tokens),
            max_new_tokens=config.max_new_tokens, n=config.samples_per_task,
            max_batch_tokens=config.max_batch_tokens, chunk_tokens=config.chunk_tokens,
        )  # fmt: skip
        self.batches = BatchClaims(bucket, replica_id)
        self.refusals = Refusals()
        self.tokens = 0
        self.gen_s = 0.0
        self.completions = 0
        self.batch_gen_s: float | None = None  # moving average of one batch's generation time
        self.skipped_stale = 0

    @property
    def policy_version(self) -> int | None:
        """The version samples are generated with: the served adapter's in a LoRA run, else the weights'."""
        if self.adapters is not None:
            return self.adapters.step
        return self.weights.step

    def answer(self, batch: int) -> int:
        """Generate G completions per task of ``batch`` and write them; returns samples written."""
        doc = get_json(self.bucket, task_key(batch), self.refusals)
        self.batches.taken(batch)
        if doc is None:
            return 0
        try:
            tasks = parse_tasks(doc)
        except ValueError as exc:
            self.refusals.add(task_key(batch), str(exc))
            return 0
        prompt_ids = [self.tokenizer(t["prompt"])["input_ids"] for t in tasks]
        plan = plan_batch([len(ids) for ids in prompt_ids], self.budget)
        if plan.dropped or plan.refused:
            self.refusals.add(task_key(batch), plan.refused or f"{len(plan.dropped)} prompts longer than {self.budget.max_prompt_tokens} tokens")
        with self.weights.slot.holding():  # the weights' updates wait: every sample is of this version
            version = self.policy_version
            assert version is not None
            seed = self.sampling_seed(batch, version)
            t0 = time.perf_counter()
            samples = []
            for chunk_index, chunk in enumerate(plan.chunks):
                sampling = SamplingSettings(
                    n=self.config.samples_per_task, max_new_tokens=self.config.max_new_tokens,
                    temperature=self.config.temperature, seed=seed + chunk_index,
                    adapter=version if self.adapters is not None else None,
                )  # fmt: skip
                groups = self.engine.generate([tasks[i]["prompt"] for i in chunk], sampling)
                samples += self._samples([tasks[i] for i in chunk], [prompt_ids[i] for i in chunk], groups, version)
            elapsed = time.perf_counter() - t0
        self.gen_s += elapsed
        self.batch_gen_s = elapsed if self.batch_gen_s is None else (1 - GEN_TIME_WEIGHT) * self.batch_gen_s + GEN_TIME_WEIGHT * elapsed
        write_samples(self.bucket, rollout_key(batch, self.replica_id), samples, batch=batch, replica=self.replica_id, version=version)
        self.batches.answered()
        self.summary.add(batches=1, samples=len(samples), tokens=sum(len(s.token_ids) for s in samples), gen_s=elapsed)
        self.completions += len(samples)
        return len(samples)

    def _samples(self, tasks: list[dict], prompt_ids: list[list[int]], groups: list, version: int) -> list[Sample]:
        samples = []
        for task, ids, group in zip(tasks, prompt_ids, groups):
            for c in group:
                samples.append(Sample(str(task["task_id"]), task["prompt"], c.text, ids, c.token_ids, c.logprobs, version))
                self.tokens += len(c.token_ids)
        return samples

    def fresh_enough(self) -> bool:
        """Whether a batch started now at this replica's version would still be trained (see
        :func:`~rlsync.spaces.demand.would_be_stale`); ``True`` without a demand object."""
        demand = read_demand(self.bucket, self.refusals, newest_version=newest_version(self.bucket))
        version = self.policy_version
        if demand is None or version is None or not would_be_stale(demand, version, self.batch_gen_s or 0.0):
            return True
        self.skipped_stale += 1
        self.summary.add(skipped_stale=1)
        return False

    def sampling_seed(self, batch: int, version: int) -> int:
        """Seed of one batch: differs between replicas, so racing replicas add new samples, not copies."""
        replica = int.from_bytes(hashlib.sha256(self.replica_id.encode()).digest()[:4], "little")
        return ((self.config.seed * 1_000_003 + batch) * 7919 + version) ^ replica
