"""Trial ``hostile_replicas``: the real trainer and env, honest replicas, and hostile ones writing
random malformed objects among the good ones.

Honest replicas answer task batches with valid rollouts made from the pointer's version.
Hostile replicas write, at random, one malformed rollouts object per class in
:data:`HOSTILE_ROLLOUTS` (non-finite log-probs, in-range log-prob lies, token ids out of vocabulary, negative or
float, empty or overlong sequences, versions from the future, deep or huge-integer JSON,
bytes that are not JSON, an object too large), scores objects straight into ``scores/``
(bypassing the env), malformed status objects and control objects with a NaN ratio.
A follower replica applies every version and checks each is bit-exact and finite.

Checks: 0 states lost (ledger, verify), 0 non-finite publishes, the trainer reaches its
step count and the env is still running, every hostile rollouts object is refused by the
env and every hostile scores object by the trainer (counted), and the panel's summary
shows the refusals.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.bucket import LocalBucket
from rlsync.errors import BucketError, SyncError
from rlsync.layout import CONTROL_KEY, ROLLOUTS_PREFIX, SCORES_PREFIX, TASKS_PREFIX, rollout_key, score_key, status_key
from rlsync.protocol import Subscriber, read_manifest
from rlsync.spaces.exchange import list_batches, parse_tasks, put_json
from rlsync.spaces.frames import env_summary, trainer_summary
from rlsync.spaces.snapshots import read_snapshot
from trainer_space.trainer import Trainer, TrainerConfig

from ..invariants import Ledger, TrialResult, check_verified

logger = logging.getLogger(__name__)

DEFAULT_TRIALS = 3
TRAINER_STEPS = 20
TIMEOUT_S = 240.0

Sample = dict[str, Any]


def _override(**fields: Any) -> Callable[[Sample, int], Sample]:
    return lambda s, vocab: {**s, **fields}


#: One malformed sample per class; each yields the JSON object a hostile replica writes.
HOSTILE_SAMPLES: dict[str, Callable[[Sample, int], Sample]] = {
    "nan_logprobs": lambda s, v: {**s, "logprobs": [float("nan")] * len(s["token_ids"])},
    "inf_logprob": lambda s, v: {**s, "logprobs": [float("-inf")] + s["logprobs"][1:]},
    "positive_logprob": lambda s, v: {**s, "logprobs": [5.0] * len(s["token_ids"])},
    # finite and once in range (>= -1e4), but no sampler reports it: TRL's importance ratio would overflow
    "logprob_lie_in_range": lambda s, v: {**s, "logprobs": [-200.0] * len(s["token_ids"])},
    "token_out_of_vocab": lambda s, v: {**s, "token_ids": [v] + s["token_ids"][1:]},
    "token_negative": lambda s, v: {**s, "token_ids": [-1] + s["token_ids"][1:]},
    "token_float": lambda s, v: {**s, "token_ids": [1.5] + s["token_ids"][1:]},
    "prompt_out_of_vocab": lambda s, v: {**s, "prompt_ids": [v + 7]},
    "empty_completion": _override(token_ids=[], logprobs=[]),
    "empty_prompt": _override(prompt_ids=[]),
    "overlong_completion": lambda s, v: {**s, "token_ids": [1] * 5000, "logprobs": [-1.0] * 5000},
    "version_from_future": _override(version=10**12),
    "version_float": lambda s, v: {**s, "version": float(s["version"])},
    "logprobs_length_mismatch": lambda s, v: {**s, "logprobs": s["logprobs"][:1]},
    "sample_not_object": lambda s, v: [s],  # type: ignore[return-value,dict-item]
}
#: Whole-object defects.
HOSTILE_RAW: dict[str, Callable[[], bytes]] = {
    "deep_json": lambda: b'{"samples": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "5000_digit_int": lambda: b'{"samples": [], "batch": ' + b"9" * 5000 + b"}",
    "not_json": lambda: b"\xff\xfe\x00 definitely not json",
    "too_large": lambda: b'{"samples": [], "pad": "' + b"x" * (17 << 20) + b'"}',
}


def _good_samples(rng: random.Random, tasks: list[dict[str, str]], version: int, vocab: int) -> list[Sample]:
    out = []
    for task in tasks:
        for _ in range(2):
            n = rng.randint(2, 6)
            completion = "".join(rng.choice("abcdefgh") for _ in range(n))
            out.append({
                "task_id": task["task_id"], "prompt": task["prompt"], "completion": completion,
                "prompt_ids": [rng.randrange(4, vocab) for _ in range(8)], "token_ids": [rng.randrange(4, vocab) for _ in range(n)],
                "logprobs": [-rng.uniform(0.1, 3.0) for _ in range(n)], "version": version, "reward": None,
            })  # fmt: skip
    return out


class Fleet(threading.Thread):
    """Honest and hostile replicas, in one thread: answers each waiting task batch."""

    def __init__(self, bucket: LocalBucket, rng: random.Random, vocab: int, result: TrialResult) -> None:
        super().__init__(daemon=True)
        self.bucket, self.rng, self.vocab, self.result = bucket, rng, vocab, result
        self.stop = threading.Event()
        self.hostile_rollouts = 0
        self.hostile_scores = 0
        self.answered: set[int] = set()

    def _write_hostile(self, key: str, good: list[Sample]) -> None:
        kind = self.rng.choice(sorted(HOSTILE_SAMPLES) + sorted(HOSTILE_RAW))
        if kind in HOSTILE_RAW:
            self.bucket.put(key, HOSTILE_RAW[kind]())
        else:
            put_json(self.bucket, key, {"samples": good[:1] + [HOSTILE_SAMPLES[kind](dict(good[-1]), self.vocab)]})
        self.result.faults[f"hostile {key.split('/')[0]}: {kind}"] += 1

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._round()
            except (BucketError, SyncError) as exc:  # e.g. the pointer not yet written
                self.result.notes[f"fleet round skipped: {type(exc).__name__}"] += 1
            self.stop.wait(0.05)

    def _round(self) -> None:
        manifest = read_manifest(self.bucket)
        if manifest is None:
            return
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        for batch in sorted(set(list_batches(self.bucket, TASKS_PREFIX)) - answered - self.answered):
            doc = json.loads(self.bucket.get(f"{TASKS_PREFIX}{batch:010d}.json"))
            good = _good_samples(self.rng, parse_tasks(doc), manifest.step, self.vocab)
            for i in range(self.rng.randint(0, 2)):  # hostile objects first: the env meets them among good ones
                self._write_hostile(rollout_key(batch, f"evil{i}"), good)
                self.hostile_rollouts += 1
            put_json(self.bucket, rollout_key(batch, "honest"), {"samples": good})
            self.answered.add(batch)
            if self.rng.random() < 0.3:  # straight into scores/: only the trainer's check stands in the way
                scored = [{**s, "reward": 1.0} for s in good]
                self._write_hostile(score_key(batch, "evil-scorer"), scored)
                self.hostile_scores += 1
        if self.rng.random() < 0.2:
            put_json(self.bucket, status_key("evil"), {"replica_id": "../../x", "lag": "NaN", "recent_syncs": 5})
            self.result.faults["hostile status"] += 1
        if self.rng.random() < 0.1:
            self.bucket.put(CONTROL_KEY, b'{"policy": "adaptive", "max_catchup_ratio": NaN}')
            self.result.faults["hostile control (NaN ratio)"] += 1


def _follow(bucket: LocalBucket, ledger: Ledger, stop: threading.Event, result: TrialResult, seen: list[int]) -> None:
    """A replica applying every version: bit-exact (ledger) and finite."""
    sub = Subscriber(bucket)
    while not stop.is_set():
        try:
            update = sub.fetch()
            if update is not None:
                sub.apply(update)
                ledger.check_state(sub.step, sub.state, sub.state_hash, "follower")
                finite = all(bool(torch.isfinite(t).all()) for t in sub.state.values() if t.is_floating_point())
                if not result.check(finite, f"version {sub.step} holds NaN or Inf"):
                    result.notes["non-finite publishes"] += 1
                seen.append(sub.step)  # type: ignore[arg-type]
                continue
        except (SyncError, BucketError) as exc:
            result.notes[f"follower: {type(exc).__name__}"] += 1
        stop.wait(0.05)


def trial_hostile_replicas(rng: random.Random, workdir: Path) -> TrialResult:
    """The trainer, the env and a fleet with hostile replicas: nothing poisoned, nothing lost, every role alive."""
    result = TrialResult("hostile_replicas")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    trainer = Trainer(TrainerConfig(
        bucket=str(bucket.root), device="cpu", batch_size=4, max_steps=TRAINER_STEPS, poll_s=0.05,
        anchor_interval=4, keep_anchors=2, seed=rng.randrange(1000), trainer_id="soak-trainer", max_staleness=8,
    ), bucket)  # fmt: skip
    def recorded(publish):
        def recorded_publish(step: int, tensors, **kwargs):
            """Record every version, and observe the bucket between publishes (retention may run within one)."""
            rec = publish(step, tensors, **kwargs)
            ledger.record(rec.step, rec.state_hash, "trainer")
            ledger.observe(bucket)
            return rec

        return recorded_publish

    # the background publisher (the default) publishes a staged state; a publish within the send streams
    trainer.publisher.publish = recorded(trainer.publisher.publish)  # type: ignore[method-assign]
    trainer.publisher.publish_stream = recorded(trainer.publisher.publish_stream)  # type: ignore[method-assign]
    vocab = trainer.trl.model.get_input_embeddings().num_embeddings
    env = EnvSimulator(EnvConfig(bucket=str(bucket.root), tasks_per_batch=2, queue_depth=2, poll_s=0.05, vocab_size=vocab), bucket)
    fleet = Fleet(bucket, rng, vocab, result)
    stop = threading.Event()
    seen: list[int] = []
    follower = threading.Thread(target=_follow, args=(bucket, ledger, stop, result, seen), daemon=True)
    deadline = time.time() + TIMEOUT_S
    try:
        trainer.start()
        env.start()
        fleet.start()
        follower.start()
        while time.time() < deadline and trainer.running:
            time.sleep(0.1)
        if not result.check(trainer.finished, f"trainer stopped at {trainer.opt_steps} of {TRAINER_STEPS} steps (died or timed out)"):
            _log_threads()  # where every thread of the process waits
            return result
        _settle(result, bucket, ledger, trainer, env, fleet, seen, deadline)
    finally:  # a failed trial leaves nothing running into the next one
        fleet.stop.set()
        fleet.join(30)
        stop.set()
        follower.join(30)
        trainer.close()
        env.close()
    return result


def _settle(result: TrialResult, bucket: LocalBucket, ledger: Ledger, trainer: Trainer, env: EnvSimulator,
            fleet: Fleet, seen: list[int], deadline: float) -> None:  # fmt: skip
    """After the trainer's last step: the follower reaches the last version; nothing lost, refusals counted and shown."""
    result.check(env.running, "the env thread died")
    fleet.stop.set()
    fleet.join(30)
    env.stop()
    env.score_rollouts()  # what the fleet wrote last
    trainer.worker.poll()
    manifest = read_manifest(bucket)
    final = manifest.step if manifest else None
    while time.time() < deadline and (not seen or seen[-1] != final):
        time.sleep(0.05)
    result.check(bool(seen) and seen[-1] == final, f"the follower ended at {seen[-1] if seen else None}, not {final}")
    result.check(final == trainer.version, f"pointer at {final}, the trainer at {trainer.version}")
    ledger.settle()
    ledger.observe(bucket)
    check_verified(bucket, result, "after the hostile run")
    result.check(env.refusals.total == fleet.hostile_rollouts,
                 f"env refused {env.refusals.total} objects, the fleet wrote {fleet.hostile_rollouts} hostile ones")  # fmt: skip
    result.check(trainer.refusals.total == fleet.hostile_scores,
                 f"trainer refused {trainer.refusals.total} objects, the fleet wrote {fleet.hostile_scores} hostile scores")  # fmt: skip
    result.check(trainer.transfer.non_finite_refused == 0, "the trainer produced non-finite weights")
    snap = read_snapshot(bucket)
    shown = "bucket objects refused" in env_summary(snap) if fleet.hostile_rollouts else True
    result.check(shown, "the env panel does not show the refusals")
    result.check(all(s.replica_id != "../../x" for s in snap.statuses), "a hostile status object reached the panel")
    result.notes["refused by the env"] += env.refusals.total
    result.notes["refused by the trainer"] += trainer.refusals.total
    result.notes["trainer summary shows refusals"] += int("refused" in trainer_summary(snap))


def _log_threads() -> None:
    """Log every thread's stack and the library worker pool's queue (a stalled trial's diagnosis)."""
    import traceback

    from rlsync.workers import worker_pool

    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = [f"--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}" for ident, frame in sys._current_frames().items()]
    queued = worker_pool()._work_queue.qsize()  # noqa: SLF001 (diagnosis only)
    logger.error("stalled trial: %d threads, %d tasks queued in the rlsync worker pool\n%s", len(stacks), queued, "\n".join(stacks))
