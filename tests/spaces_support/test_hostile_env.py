"""Hostile inputs on the env side (issue 26): completions that are code, scorers that hang or hold
the GIL, planted task keys, task objects that ask for millions of tasks, out-of-range rewards."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from env_space.environments import Scoring
from env_space.isolation import Confinement, call_bounded, run_confined
from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources.evaluators import EvaluatorRefused, check_literal, check_sympy_text, guard_evaluators
from rlsync.layout import MAX_BATCH, batch_of, rollout_key, score_key, task_key
from rlsync.spaces.exchange import Sample, get_json, put_json, read_samples, write_samples

#: The verifiers that hand the answer to sympy's parse_expr or to Python's eval.
EVALUATING = [
    "countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "intermediate_integration",
    "string_insertion", "spiral_matrix", "binary_matrix", "n_queens",
]  # fmt: skip


def _rollouts(bucket, batch: int, completions_of, replica: str = "r0") -> None:
    """One rollouts object: for each task of the batch, the completions ``completions_of(task_doc)``."""
    doc = get_json(bucket, task_key(batch))
    samples = [
        Sample(t["task_id"], t["prompt"], c, [1], [2], [-0.5], 0) for t in doc["tasks"] for c in completions_of(t)
    ]
    write_samples(bucket, rollout_key(batch, replica), samples, batch=batch)


def _rewards(bucket, batch: int, replica: str = "r0") -> list[tuple[str, float]]:
    return [(s.completion, s.reward) for s in read_samples(bucket, score_key(batch, replica))[1]]


# -- completions that are code ------------------------------------------------------------


def test_code_in_an_answer_never_runs_in_any_evaluating_verifier(bucket, tmp_path):
    planted = tmp_path / "PWNED"
    payloads = [
        f"<answer>__import__('os').system('touch {planted}')</answer>",
        f"<answer>[__import__('os').system('touch {planted}')]</answer>",
        f"<answer>eval(chr(95)*2+'import'+chr(95)*2+'(\"os\").system(\"touch {planted}\")')</answer>",
        f"<answer>S('__import__(\"os\").system(\"touch {planted}\")')</answer>",
    ]
    spec = "reasoning_gym:" + ",".join(EVALUATING)
    env = EnvSimulator(EnvConfig(environment=spec, tasks_per_batch=60, score_timeout_s=20, score_budget_s=120), bucket)
    batch = env.publish_tasks()
    tasks = env.batch_tasks(batch, get_json(bucket, task_key(batch)))
    assert {t.meta["type"] for t in tasks.values()} == set(EVALUATING)  # every verifier is tried
    answers = {t.task_id: t.answer for t in tasks.values()}
    _rollouts(bucket, batch, lambda t: [*payloads, f"<answer>{answers[t['task_id']]}</answer>"])
    assert env.score_rollouts() == 60 * 5
    assert not planted.exists()
    rewards = _rewards(bucket, batch)
    assert all(r < 0.1 for c, r in rewards if "PWNED" in c)  # at most countdown's 0.01 for a wrong answer
    correct = [r for c, r in rewards if "PWNED" not in c]
    assert len(correct) == 60 and all(r == 1.0 for r in correct)  # genuine answers still score as the library does


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')", "x.__class__", "().__class__.__bases__", "S('x')", "Symbol('x')", "eval(chr(95))",
        "open(0)", "getattr(x, y)", "lambda: 1", "[c for c in x]", "x[0]", "x = 1", "ｅｖａｌ(1)", "f'{x}'",
        "preview(x)", "test()", "var(x)", "_x", "x; y",
    ],
)  # fmt: skip
def test_sympy_text_that_is_not_an_expression_is_refused(text):
    import sympy

    namespace: dict = {}
    exec("from sympy import *", namespace)  # what parse_expr evaluates in
    namespace.update({"open": open, "getattr": getattr, "eval": eval, "chr": chr})
    with pytest.raises(EvaluatorRefused):
        check_sympy_text(text, {}, namespace)
    guard_evaluators()
    with pytest.raises(EvaluatorRefused):
        sympy.parse_expr(text)


@pytest.mark.parametrize("text", ["3*x**2 + sin(x) + C", "exp(-x)/2 - log(x) + sqrt(2)*pi", "(1+2)*3 - 4/5", "3!", "x1*y"])
def test_sympy_expressions_still_parse(text):
    import sympy

    guard_evaluators()
    assert sympy.parse_expr(text, local_dict={"C": sympy.Symbol("C")}) is not None


def test_eval_in_reasoning_gym_takes_literals_only():
    assert check_literal("[['Q', '_'], [1, -2.5]]") is not None and check_literal("(3 << 2) + 0x1f // 2") is not None
    for text in ("__import__('os')", "[x for x in ()]", "().__class__", "print(1)", "f'{1}'", "a"):
        with pytest.raises(EvaluatorRefused):
            check_literal(text)


# -- bounded time, memory, network --------------------------------------------------------


def test_a_call_holding_the_gil_ends_at_its_bound():
    t0 = time.monotonic()
    result = call_bounded(lambda: 9**9**9**9, timeout_s=2)
    assert result.failure == "timeout"
    assert time.monotonic() - t0 < 10  # a thread-based bound never returned (the GIL stayed held)
    assert call_bounded(lambda: 3, timeout_s=5).value == 3


def test_the_scoring_child_has_no_network_descriptors_secrets_or_memory(tmp_path, monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    held = open(tmp_path / "held", "wb")  # noqa: SIM115 - a descriptor the parent holds
    held_fd = held.fileno()

    def connect(_):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return "connected"

    probes = [
        connect,
        lambda _: os.fstat(held_fd) and "descriptor",
        lambda _: os.environ.get("HF_TOKEN", "no token"),
        lambda _: len(bytearray(3 << 30)),
        lambda _: open(tmp_path / "written", "wb", buffering=0).write(b"x" * 10),
    ]
    try:
        assert connect(None) == "connected"  # reachable from here
        results = run_confined(lambda probe: probe(None), probes, Confinement(timeout_s=10, budget_s=30))
    finally:
        held.close()
        server.close()
    assert results[0].failure is not None and results[0].failure.startswith("error:")
    assert results[1].failure == "error:OSError"
    assert results[2].value == "no token"
    assert results[3].failure in ("error:MemoryError", "worker_died")
    assert results[4].failure == "error:OSError"  # RLIMIT_FSIZE: no file writes
    assert (tmp_path / "written").stat().st_size == 0


#: Held by a thread of the test's process while it scores (module level: the scoring child imports its own).
HELD = threading.Lock()


def _take_held(_) -> bool:
    if not HELD.acquire(timeout=1):
        return False
    HELD.release()
    return True


def test_scoring_never_inherits_a_lock_another_thread_holds():
    """Issue 41 item 6: a fork of the env's process would copy a lock one of its threads holds, held for good
    in the child; the scoring child comes from the fork server, a process that runs no thread."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with HELD:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        taken.wait(10)
        results = run_confined(_take_held, [None, None], Confinement(timeout_s=10, budget_s=20))
    finally:
        release.set()
        holder.join()
    assert [r.value for r in results] == [True, True]


def test_a_hanging_object_is_bounded_and_other_objects_are_still_scored(bucket, monkeypatch):
    env = EnvSimulator(EnvConfig(tasks_per_batch=4, score_timeout_s=0.5, score_budget_s=1.6), bucket)
    original = env.environment.score

    def score(task, completion):
        if completion == "hang":
            while True:  # pure Python: a thread could not be stopped either
                pass
        return original(task, completion)

    monkeypatch.setattr(env.environment, "score", score)
    hostile, fine = env.publish_tasks(), env.publish_tasks()
    _rollouts(bucket, hostile, lambda t: ["hang"] * 50, replica="bad")
    answers = {t.task_id: t.answer for t in env.batch_tasks(fine, get_json(bucket, task_key(fine))).values()}
    _rollouts(bucket, fine, lambda t: [answers[t["task_id"]]], replica="good")
    t0 = time.monotonic()
    assert env.score_rollouts() == 4 * 50 + 4
    assert time.monotonic() - t0 < 15  # 200 timeouts at 0.5 s would take 100 s
    failures = env.failures.as_dict()
    assert failures["score: timeout"] <= 4 and failures["score: budget"] >= 196
    assert [r for _, r in _rewards(bucket, fine, "good")] == [1.0] * 4


def test_self_bounded_environments_get_the_object_budget_too(bucket, monkeypatch):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2, score_budget_s=0.5), bucket)
    monkeypatch.setattr(env.environment, "scoring", Scoring.SELF_BOUNDED)
    monkeypatch.setattr(env.environment, "score", lambda task, completion: time.sleep(0.2) or 0.5)
    batch = env.publish_tasks()
    _rollouts(bucket, batch, lambda t: ["x"] * 20)
    assert env.score_rollouts() == 40
    failures = env.failures.as_dict()
    assert 35 <= failures["score: budget"] <= 38
    assert sum(r == 0.5 for _, r in _rewards(bucket, batch)) == 40 - failures["score: budget"]


@pytest.mark.parametrize("reward", [1e300, -1e7, float("nan")])
def test_rewards_beyond_what_the_trainer_accepts_are_refused_by_the_env(bucket, monkeypatch, reward):
    env = EnvSimulator(EnvConfig(tasks_per_batch=1, failure_reward=-1.0), bucket)
    monkeypatch.setattr(env.environment, "score", lambda task, completion: reward)
    batch = env.publish_tasks()
    _rollouts(bucket, batch, lambda t: ["x"])
    env.score_rollouts()
    assert _rewards(bucket, batch) == [("x", -1.0)]
    assert sum(env.failures.as_dict().values()) == 1


# -- task keys and sizes ------------------------------------------------------------------


def test_a_planted_batch_key_neither_loops_the_env_nor_deletes_genuine_batches(bucket):
    config = EnvConfig(tasks_per_batch=2, queue_depth=2, keep_batches=4)
    env = EnvSimulator(config, bucket)
    env.step()
    genuine = sorted(get_json(bucket, k)["batch"] for k in [task_key(0), task_key(1)])
    # a copy that even claims the planted number and the seed this env would use for it
    doc = get_json(bucket, task_key(1))
    put_json(bucket, task_key(MAX_BATCH), {**doc, "batch": MAX_BATCH, "seed": config.seed * 1_000_003 + MAX_BATCH})
    put_json(bucket, "tasks/5.json", doc)  # not a key this module writes
    assert batch_of("tasks/5.json") is None and batch_of("tasks/0000000003.x.json") is None
    restarted = EnvSimulator(config, bucket)  # resumes after its own newest batch, not after the planted one
    t0 = time.monotonic()
    for _ in range(3):
        restarted.step()
    assert time.monotonic() - t0 < 30  # step() returns (it rewrote one object for good before)
    keys = {o.key for o in bucket.list("tasks/")}
    assert {task_key(b) for b in genuine} <= keys  # genuine batches are kept
    assert task_key(MAX_BATCH) not in keys and restarted.refusals.counts["tasks"] == 1
    assert restarted.publish_tasks() == 2  # its own numbering went on from its own batches


def test_an_env_restarted_with_another_environment_goes_on_numbering_and_keeps_old_batches(bucket):
    env = EnvSimulator(EnvConfig(tasks_per_batch=1, keep_batches=3), bucket)
    for _ in range(5):
        env.publish_tasks()
    write_samples(bucket, score_key(4, "r0"), [Sample("reverse-4-0", "p", "c", [1], [2], [-0.5], 0, 1.0)], batch=4)
    other = EnvSimulator(EnvConfig(environment="arithmetic", seed=7, tasks_per_batch=1, keep_batches=3), bucket)
    assert other.publish_tasks() == 5  # not 0: that would overwrite batch 0 and collide with pending scores
    other.prune()
    assert sorted(batch_of(o.key) for o in bucket.list("tasks/")) == [3, 4, 5]  # the newest 3, by rank
    assert [o.key for o in bucket.list("scores/")] == [score_key(4, "r0")]


def test_a_task_object_asking_for_millions_of_tasks_is_refused_without_generating_them(bucket, monkeypatch):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2), bucket)
    batch = env.publish_tasks()
    doc = get_json(bucket, task_key(batch))
    calls = []
    original = env.environment.tasks
    monkeypatch.setattr(env.environment, "tasks", lambda n, *, seed: calls.append(n) or original(n, seed=seed))
    huge = {**doc, "n": 8_300_000, "tasks": [0] * 8_300_000}
    with pytest.raises(ValueError, match="not in"):
        env.batch_tasks(batch, huge)
    assert calls == []
    put_json(bucket, task_key(batch), {**doc, "n": 5000, "tasks": [{}] * 5000})
    write_samples(bucket, rollout_key(batch, "r0"), [Sample("reverse-0-0", "p", "x", [1], [2], [-0.5], 0)], batch=batch)
    assert env.score_rollouts() == 0 and calls == []


@pytest.mark.parametrize(
    "refused, shown",
    [
        ({"total": 3, "by_kind": {"rollouts": 2, "tasks": 1}, "last": "x"}, True),
        ({"total": 10**15, "by_kind": {"rollouts": 2}, "last": "x"}, False),  # a false total
        ({"total": 2, "by_kind": {"rollouts": 2.0}, "last": "x"}, False),
        ({"total": 2, "last": "x"}, False),
        ({"total": True, "by_kind": {"a": 1}}, False),
    ],
)
def test_a_refusal_total_is_shown_only_when_it_is_the_sum_of_its_counts(refused, shown):
    from rlsync.spaces.frames import refused_parts
    from rlsync.spaces.metrics import EnvMetrics

    parts = refused_parts(EnvMetrics.from_json({"refused": refused}).refused)
    assert bool(parts) is shown and (not shown or parts[0].startswith("**3 bucket objects refused**"))


def test_the_env_backs_off_after_failed_steps_in_a_row(bucket, monkeypatch):
    env = EnvSimulator(EnvConfig(poll_s=0.05), bucket)
    calls = []

    def failing(n, *, seed):
        calls.append(time.monotonic())
        raise ConnectionError("source down")

    monkeypatch.setattr(env.environment, "tasks", failing)
    env.start()
    time.sleep(2.0)
    env.stop()
    assert 3 <= len(calls) <= 7  # 0.1 + 0.2 + 0.4 + 0.8 s between tries; at a fixed 0.05 s: about 40
    assert env.failures.as_dict()["step: error:ConnectionError"] == len(calls)


def test_a_batch_replicas_would_refuse_is_never_written_and_its_number_skipped(bucket, monkeypatch):
    env = EnvSimulator(EnvConfig(tasks_per_batch=2), bucket)
    original = env.environment.tasks
    monkeypatch.setattr(env.environment, "tasks", lambda n, *, seed: [t.__class__(t.task_id, "9" * 70_000, t.answer) for t in original(n, seed=seed)])
    with pytest.raises(ValueError, match="refused by replicas"):
        env.publish_tasks()
    assert not list(bucket.list("tasks/")) and env.failures.as_dict() == {"tasks: unreadable batch skipped": 1}
    monkeypatch.setattr(env.environment, "tasks", original)
    assert env.publish_tasks() == 1


def test_soak_trial_hostile_tasks(tmp_path):
    """The soak's hostile-task trial, short: planted keys and sizes and code in completions against the real env
    and a real replica; no code runs, nothing outside the bucket changes, nothing is lost, both roles live."""
    import random

    from testing.soak.kinds.hostile_tasks import trial_hostile_tasks

    result = trial_hostile_tasks(random.Random(5), tmp_path, trial_s=8.0)
    assert not result.violations and result.lost == 0
    assert result.faults["rollouts objects with code"] > 0 and result.notes["files touched outside the run's prefixes"] == 0
