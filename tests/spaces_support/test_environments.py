"""Environments: seeded tasks, bounded rewards with partial credit, a registry users can extend."""

from __future__ import annotations

import random
import re

import pytest

from env_space import environments
from env_space.environments import (
    ArithmeticEnvironment,
    Environment,
    ReverseEnvironment,
    Task,
    get_environment,
    last_integer,
    list_environments,
)
from rlsync.errors import ConfigurationError

BUILTIN = ["reverse", "arithmetic"]


@pytest.fixture
def registry(scratch_registry):
    """A private copy of the registry, so tests can register environments freely."""
    return scratch_registry


@pytest.mark.parametrize("name", BUILTIN)
def test_tasks_are_reproducible_per_seed(name):
    env = get_environment(name)
    a, b, c = env.tasks(50, seed=3), env.tasks(50, seed=3), env.tasks(50, seed=4)
    assert a == b
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.task_id for t in a}) == 50
    state = random.getstate()
    env.tasks(5, seed=1)
    assert random.getstate() == state  # the global generator is left alone


@pytest.mark.parametrize("name", BUILTIN)
def test_scores_are_bounded_and_reference_scores_one(name):
    env = get_environment(name)
    rng = random.Random(0)
    alphabet = "0123456789 -abc?=\n"
    for task in env.tasks(100, seed=0):
        assert env.score(task, task.answer) == 1.0
        assert env.score(task, f" {task.answer}\n") == 1.0
        for _ in range(10):
            junk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            assert 0.0 <= env.score(task, junk) <= 1.0


def test_reverse_tasks_reverse_the_prompt_digits():
    for task in ReverseEnvironment(min_len=2, max_len=6).tasks(100, seed=1):
        digits = re.fullmatch(r"reverse (\d+) =", task.prompt).group(1)
        assert 2 <= len(digits) <= 6 and task.answer == digits[::-1]


def test_reverse_partial_credit_orders_by_closeness():
    env = get_environment("reverse")
    task = Task("t", "reverse 1234 =", "4321")
    exact = env.score(task, "4321")
    one_wrong = env.score(task, "4391")
    two_wrong = env.score(task, "4091")
    all_wrong = env.score(task, "5555")
    assert exact == 1.0 > one_wrong == 0.75 > two_wrong == 0.5 > all_wrong == 0.0
    # a wrong length costs reward even if every written digit is right
    assert env.score(task, "43210") == pytest.approx(0.8)
    assert env.score(task, "432") == pytest.approx(0.75)
    assert env.score(task, "4321 and more") < env.score(task, "43210") < exact
    assert env.score(task, "") == 0.0


def test_last_integer_reads_free_text():
    assert last_integer("the answer is 42") == 42
    assert last_integer("3 apples and 4 pears make 7.") == 7
    assert last_integer("it is -5") == -5
    assert last_integer("no number here") is None


def test_arithmetic_answers_and_free_text_scoring():
    env = ArithmeticEnvironment(max_operand=9)
    tasks = env.tasks(200, seed=5)
    assert {t.meta["op"] for t in tasks} == {"+", "*"}
    assert any(not t.prompt.startswith("what is") for t in tasks)  # word problems, not only equations
    for t in tasks:
        a, b, op = t.meta["a"], t.meta["b"], t.meta["op"]
        assert t.answer == str(a + b if op == "+" else a * b)
        assert str(a) in t.prompt and str(b) in t.prompt
    task = Task("t", "what is 6 * 7? answer:", "42")
    assert env.score(task, "the answer is 42") == 1.0
    assert env.score(task, "first 41, then 42") == 1.0
    assert env.score(task, "42, or maybe 41") == env.FORMAT_CREDIT  # the last number counts
    assert env.score(task, "41") == env.FORMAT_CREDIT
    assert env.score(task, "forty two") == 0.0
    assert 0.0 < env.FORMAT_CREDIT < 1.0


def test_registry_lists_gets_and_rejects(registry):
    assert set(BUILTIN) <= set(list_environments())
    assert isinstance(get_environment("reverse", min_len=2, max_len=2), ReverseEnvironment)
    with pytest.raises(KeyError, match="unknown environment"):
        get_environment("nope")

    class Copy(Environment):
        name = "copy"

        def tasks(self, n, *, seed):
            return [Task(f"copy-{seed}-{i}", f"copy {i} =", str(i)) for i in range(n)]

        def score(self, task, completion):
            return float(completion.strip() == task.answer)

    entry = registry.register(registry.Kind.ENVIRONMENT, "copy", Copy)
    assert "copy" in list_environments() and isinstance(get_environment("copy"), Copy)
    assert registry.register(registry.Kind.ENVIRONMENT, "copy", Copy) == entry  # re-registering the same is harmless

    class Clash(Copy):
        name = "copy"

    with pytest.raises(ConfigurationError, match="taken"):
        registry.register(registry.Kind.ENVIRONMENT, "copy", Clash)

    class Nameless(Copy):
        name = ""

    with pytest.raises(ConfigurationError, match="name"):
        registry.register(registry.Kind.ENVIRONMENT, "", Nameless)
    registry.register(registry.Kind.ENVIRONMENT, "nameless", Nameless)
    with pytest.raises(ConfigurationError, match="whose name is ''"):
        get_environment("nameless")


def test_module_docstring_example_runs(registry):
    """The one-class example in the module docstring is real, working code."""
    doc = environments.__doc__
    code = "\n".join(line[4:] for line in doc.split("::", 1)[1].strip("\n").splitlines())
    namespace: dict = {}
    exec(compile(code, "<environments docstring>", "exec"), namespace)  # noqa: S102 - our own docstring
    assert "echo" in list_environments()
    tasks = get_environment("echo").tasks(4, seed=0)
    assert len(tasks) == 4 and all(get_environment("echo").score(t, t.answer) == 1.0 for t in tasks)
