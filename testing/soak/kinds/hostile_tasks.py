"""Trial ``hostile_tasks``: the real env (reasoning-gym verifiers that evaluate answers) and a real replica
(tiny model, CPU), with a writer planting hostile task keys, task objects and code-execution completions.

The writer, at random, each round: plants task keys beyond the env's numbering (``tasks/9999999999.json``
even with the seed the env would use, 11-digit and non-canonical names), task objects asking for
millions of tasks, task objects of 1,024 prompts beyond the model's context (8 MB), and rollouts
objects for genuine batches whose completions are code (``__import__('os').system('touch CANARY')``
and variants) or expressions that hold the GIL (``9**9**9**9``), among honest completions.

Checks: no canary file exists and no file outside the bucket changed (files touched outside the run's
prefixes: 0); the env and the replica are alive at the end and the env's batch numbers stayed its own
(no planted number followed, no endless step); every genuine batch the env published is still there
or was pruned by age only; every rollouts object (hostile or honest) for a genuine batch got its
scores object (0 lost); the replica's peak memory grew by less than 1 GiB.
"""

from __future__ import annotations

import random
import resource
import threading
import time
from pathlib import Path

from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.bucket import LocalBucket
from rlsync.errors import BucketError
from rlsync.layout import MAX_BATCH, SCORES_PREFIX, rollout_key, task_key
from rlsync.protocol import FixedInterval, Publisher
from rlsync.spaces.exchange import Sample, get_json, list_batches, put_json, write_samples
from rlsync.spaces.tiny_model import build_tiny_model
from rollout_space.replica import Replica, ReplicaConfig

from ..invariants import TrialResult

DEFAULT_TRIALS = 2
TRIAL_S = 45.0
SPEC = "reasoning_gym:countdown,polynomial_multiplication,simple_integration,string_insertion,n_queens"


def _payloads(canary: Path) -> list[str]:
    touch = f"__import__('os').system('touch {canary}')"
    return [
        f"<answer>{touch}</answer>",
        f"<answer>[{touch}]</answer>",
        f"<answer>S('{touch}')</answer>",
        "<answer>eval(chr(95)+chr(95)+'import'+chr(95)+chr(95))</answer>",
        "<answer>().__class__.__bases__[0].__subclasses__()</answer>",
        f"<answer>f'{{{touch}}}'</answer>",
    ]


#: An answer that holds the GIL for good (in a rollouts object of its own now and then: each costs the timeout).
GIL_HOLDER = "<answer>9**9**9**9</answer>"


def _files_outside(workdir: Path, bucket_root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in workdir.rglob("*")
        if p.is_file() and bucket_root not in p.parents
    }


class Planter(threading.Thread):
    """Writes hostile task keys, task objects and code-execution rollouts while the roles run."""

    def __init__(self, bucket: LocalBucket, env: EnvSimulator, rng: random.Random, canary: Path, result: TrialResult) -> None:
        super().__init__(daemon=True)
        self.bucket, self.env, self.rng, self.result = bucket, env, rng, result
        self.payloads = _payloads(canary)
        self.stop = threading.Event()
        self.rollouts: set[tuple[int, str]] = set()  # (genuine batch, replica) objects written
        self.huge_prompts = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._round()
            except BucketError as exc:
                self.result.notes[f"planter round skipped: {type(exc).__name__}"] += 1
            self.stop.wait(0.25)

    def _plant(self, key: str, doc: object, fault: str) -> None:
        put_json(self.bucket, key, doc)
        self.result.faults[fault] += 1

    def _round(self) -> None:
        own = self.env.issuer.next_batch
        genuine = [b for b in list_batches(self.bucket, "tasks/") if own is not None and b < own]
        choice = self.rng.random()
        doc = get_json(self.bucket, task_key(genuine[-1])) if genuine else None
        if choice < 0.2 and isinstance(doc, dict):
            seed = self.env.config.seed * 1_000_003 + MAX_BATCH
            self._plant(task_key(MAX_BATCH), {**doc, "batch": MAX_BATCH, "seed": seed}, "task key 9999999999")
        elif choice < 0.3 and isinstance(doc, dict):
            self._plant(f"tasks/{self.rng.randrange(10**10, 10**11)}.json", doc, "task key with 11 digits")
            self._plant(f"tasks/{self.rng.randrange(100)}.json", doc, "task key not zero-padded")
        elif choice < 0.4 and own is not None:
            batch = own + self.rng.randrange(1, 50)
            n = self.rng.choice([8_300_000 // 8, 5000])
            self._plant(task_key(batch), {"batch": batch, "env": self.env.environment.name, "seed": 1, "n": n,
                                           "tasks": [0] * n}, "task object with huge n")  # fmt: skip
            write_samples(self.bucket, rollout_key(batch, "evil-n"), [Sample("x", "p", "c", [1], [2], [-0.5], 0)])
            self.result.faults["rollouts naming a huge-n task object"] += 1
        elif choice < 0.45 and own is not None and self.huge_prompts < 1:
            batch = own + self.rng.randrange(1, 50)
            tasks = [{"task_id": f"big-{i}", "prompt": "reverse " + "1" * 8150 + " ="} for i in range(1024)]
            self._plant(task_key(batch), {"batch": batch, "tasks": tasks}, "task object of 8 MB prompts")
            self.huge_prompts += 1
        elif genuine:
            self._code_rollouts(self.rng.choice(genuine[-4:]))

    def _code_rollouts(self, batch: int) -> None:
        doc = get_json(self.bucket, task_key(batch))
        if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list):
            return
        replica = f"evil-code-{len(self.rollouts)}"
        payloads = [GIL_HOLDER] if self.rng.random() < 0.05 else self.payloads
        samples = [
            Sample(t["task_id"], t["prompt"], self.rng.choice(payloads), [1, 2], [3], [-0.5], 0) for t in doc["tasks"]
        ]
        write_samples(self.bucket, rollout_key(batch, replica), samples, batch=batch)
        self.rollouts.add((batch, replica))
        self.result.faults["code-execution completions"] += len(samples)
        self.result.faults["rollouts objects with code"] += 1


def trial_hostile_tasks(rng: random.Random, workdir: Path, trial_s: float = TRIAL_S) -> TrialResult:
    """The env and a replica against planted task keys and sizes and code-execution completions, for ``trial_s``."""
    result = TrialResult("hostile_tasks")
    bucket = LocalBucket(workdir / "bucket")
    model_dir = build_tiny_model(workdir / "model", seed=rng.randrange(1000))
    canary = workdir / "CANARY"
    Publisher(bucket, policy=FixedInterval(100)).publish(0, _state(model_dir))
    env = EnvSimulator(EnvConfig(
        bucket=str(bucket.root), environment=SPEC, tasks_per_batch=4, queue_depth=2, poll_s=0.1, keep_batches=10_000,
        score_timeout_s=1.0, score_budget_s=4.0, seed=rng.randrange(1000),
        source_settings='{"system_prompt": "Answer inside <answer></answer>."}',  # some prompts fit the tiny context
    ), bucket)  # fmt: skip
    replica = Replica(ReplicaConfig(bucket=str(bucket.root), replica_id="honest", engine="transformers",
                                    model=str(model_dir), device="cpu", poll_s=0.1, max_new_tokens=8), bucket)  # fmt: skip
    before = _files_outside(workdir, bucket.root)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    planter = Planter(bucket, env, rng, canary, result)
    env.start()
    replica.start()
    planter.start()
    time.sleep(trial_s)
    planter.stop.set()
    planter.join(30)
    result.check(env.running, "the env thread died")
    result.check(replica.running, "the replica died")
    replica.stop()
    env.stop()
    env.score_rollouts()  # what was written last
    env.prune()  # the planter's last round may follow the env's last step: a task key wakes no one
    own = env.issuer.next_batch or 0
    result.check(own < 1000, f"the env numbered {own} batches in {trial_s:g}s (followed a planted key or looped)")
    tasks = set(list_batches(bucket, "tasks/"))
    result.check(set(range(own)) <= tasks, f"genuine batches missing: {sorted(set(range(own)) - tasks)[:10]}")
    result.check(not [b for b in tasks if b >= own], "task keys beyond the env's numbering survived its prune")
    scored = {k for keys in list_batches(bucket, SCORES_PREFIX).values() for k in keys}
    missing = [(b, r) for b, r in planter.rollouts if f"{SCORES_PREFIX}{b:010d}/{r}.json" not in scored]
    result.lost += len(missing)
    result.check(not missing, f"{len(missing)} code-execution rollouts objects got no scores object")
    result.check(not canary.exists(), "a completion ran code in the env (the canary file exists)")
    after = _files_outside(workdir, bucket.root)
    touched = [p for p in set(before) | set(after) if before.get(p) != after.get(p)]
    result.notes["files touched outside the run's prefixes"] += len(touched)
    result.check(not touched, f"files touched outside the bucket: {touched[:5]}")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    result.check(grown_mib < 1024, f"peak memory grew by {grown_mib:.0f} MiB")
    result.notes["env refusals"] += env.refusals.total
    result.notes["env scoring failures"] += env.failures.total()
    result.notes["replica refusals"] += replica.refusals.total
    result.notes["replica completions"] += replica.completions
    replica.close()
    return result


def _state(model_dir: Path):
    from safetensors.torch import load_file

    return {name: t.float() for name, t in load_file(model_dir / "model.safetensors").items()}
