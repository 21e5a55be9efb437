"""Environments: seeded task generators with a scoring rule.

An environment hands out :class:`Task` objects (a plain-text prompt plus the
reference answer) and scores a completion in ``[0, 1]``. Prompts use only
characters the tiny model's tokenizer knows (see ``rlsync.spaces.tiny_model.CHARACTERS``).

Adding an environment takes one class and its entry in :mod:`rlsync.registry` (``Kind.ENVIRONMENT``; the registry
reads the ``register(...)`` lines of every module of ``env_space``, so a new file here needs no other edit)::

    from env_space.environments import Environment, Task, get_environment
    from rlsync.registry import Kind, register

    class Echo(Environment):
        name = "echo"

        def tasks(self, n, *, seed):
            rng = self.rng(seed)
            words = ["ab", "cd", "ef"]
            picks = [rng.choice(words) for _ in range(n)]
            return [Task(f"echo-{seed}-{i}", f"echo {w} =", w) for i, w in enumerate(picks)]

        def score(self, task, completion):
            return float(completion.strip() == task.answer)

    register(Kind.ENVIRONMENT, "echo", Echo)  # in a module of env_space: "env_space.my_module:Echo"
    get_environment("echo").tasks(4, seed=0)
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import random
import re
from typing import Any, ClassVar

from rlsync.errors import ConfigurationError
from rlsync.registry import Kind, get, names, register

__all__ = [
    "ArithmeticEnvironment",
    "Environment",
    "ReverseEnvironment",
    "Scoring",
    "Task",
    "get_environment",
    "last_integer",
    "list_environments",
]


@dataclasses.dataclass(frozen=True)
class Task:
    """One prompt to complete.

    Attributes:
        task_id: Unique, reproducible id (same environment, seed and position -> same id).
        prompt: Plain-text prompt; the completion continues it directly.
        answer: Reference completion (a completion equal to it scores ``1.0``).
        meta: Environment-specific details (e.g. operands), JSON-serialisable.
    """

    task_id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class Scoring(enum.Enum):
    """Where the simulator runs an environment's :meth:`Environment.score` (it reads untrusted completions)."""

    #: In a forked child bounded in time, memory and network (:mod:`env_space.isolation`); the default.
    CONFINED = "confined"
    #: In the env's process: the environment bounds and confines its own calls (a remote server,
    #: or reward functions in their own worker process).
    SELF_BOUNDED = "self_bounded"


class Environment(abc.ABC):
    """A task generator and scorer.

    Subclasses set :attr:`name` and implement :meth:`tasks` and :meth:`score`.
    """

    #: Registry name.
    name: str
    #: How the simulator runs :meth:`score`.
    scoring: ClassVar[Scoring] = Scoring.CONFINED

    @abc.abstractmethod
    def tasks(self, n: int, *, seed: int) -> list[Task]:
        """Generate ``n`` tasks; the same ``seed`` must give the same tasks.

        Args:
            n: Number of tasks.
            seed: Seed of the generator.

        Returns:
            The tasks, with ids unique within the call.
        """

    @abc.abstractmethod
    def score(self, task: Task, completion: str) -> float:
        """Score ``completion`` (the text after the prompt) for ``task``.

        Returns:
            A reward in ``[0, 1]``; ``1.0`` for a correct answer.
        """

    @staticmethod
    def rng(seed: int) -> random.Random:
        """A private random generator for ``seed`` (leaves the global ``random`` alone)."""
        return random.Random(seed)


def get_environment(name: str, **kwargs: Any) -> Environment:
    """Instantiate the environment registered as ``name``.

    Args:
        name: Registry name.
        **kwargs: Passed to the environment's constructor.

    Raises:
        UnknownNameError: No environment has that name (a ``KeyError``).
        ConfigurationError: It is registered to a class of another ``name``.
    """
    cls = get(Kind.ENVIRONMENT, name).load()
    if getattr(cls, "name", None) != name:
        named = getattr(cls, "name", None)
        raise ConfigurationError(f"environment {name!r} is registered to {cls!r}, whose name is {named!r}")
    return cls(**kwargs)


def list_environments() -> list[str]:
    """Names of the registered environments, sorted."""
    return names(Kind.ENVIRONMENT)


class ReverseEnvironment(Environment):
    """Reverse a short digit string: ``"reverse 3817 ="`` -> ``"7183"``.

    Partial credit: the number of positions where the stripped completion matches
    the reference, divided by the longer of the two lengths, so both wrong digits
    and a wrong length cost reward.

    Args:
        min_len: Shortest digit string.
        max_len: Longest digit string.
    """

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 5) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len = min_len
        self.max_len = max_len

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        rng = self.rng(seed)
        out = []
        for i in range(n):
            digits = "".join(str(rng.randrange(10)) for _ in range(rng.randint(self.min_len, self.max_len)))
            out.append(Task(f"{self.name}-{seed}-{i}", f"reverse {digits} =", digits[::-1], {"digits": digits}))
        return out

    def score(self, task: Task, completion: str) -> float:
        pred, ref = completion.strip(), task.answer
        if not pred:
            return 0.0
        matches = sum(p == r for p, r in zip(pred, ref))
        return matches / max(len(pred), len(ref))


_INT_RE = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """Return the last integer written in ``text`` (``"-12"`` counts as ``-12``), or ``None``."""
    found = _INT_RE.findall(text)
    return int(found[-1]) if found else None


class ArithmeticEnvironment(Environment):
    """Small addition and multiplication word problems.

    The answer is the last integer in the completion, so free text such as
    ``"she has 12 apples"`` is fine. Reward: ``1.0`` if it equals the result,
    :attr:`FORMAT_CREDIT` if the completion contains an integer at all, else ``0``.

    Args:
        max_operand: Largest operand (operands are drawn from ``1..max_operand``).
        ops: Which operations to use, a subset of ``("+", "*")``.
    """

    name = "arithmetic"
    FORMAT_CREDIT = 0.1

    _TEMPLATES: ClassVar[dict[str, tuple[str, ...]]] = {
        "+": (
            "what is {a} + {b}? answer:",
            "{name} has {a} apples and gets {b} more. how many apples does {name} have? answer:",
            "there are {a} birds on a tree and {b} more land. how many birds are there? answer:",
        ),
        "*": (
            "what is {a} * {b}? answer:",
            "a box holds {a} eggs. how many eggs are in {b} boxes? answer:",
            "{name} reads {a} pages a day for {b} days. how many pages is that? answer:",
        ),
    }
    _NAMES: ClassVar[tuple[str, ...]] = ("tom", "ana", "li", "sam", "mia", "ravi")

    def __init__(self, max_operand: int = 12, ops: tuple[str, ...] = ("+", "*")) -> None:
        if max_operand < 1:
            raise ValueError("max_operand must be >= 1")
        unknown = set(ops) - set(self._TEMPLATES)
        if not ops or unknown:
            raise ValueError(f"ops must be a non-empty subset of {tuple(self._TEMPLATES)}, got {ops}")
        self.max_operand = max_operand
        self.ops = tuple(ops)

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        rng = self.rng(seed)
        out = []
        for i in range(n):
            op = rng.choice(self.ops)
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            template = rng.choice(self._TEMPLATES[op])
            prompt = template.format(a=a, b=b, name=rng.choice(self._NAMES))
            result = a + b if op == "+" else a * b
            out.append(Task(f"{self.name}-{seed}-{i}", prompt, str(result), {"a": a, "b": b, "op": op}))
        return out

    def score(self, task: Task, completion: str) -> float:
        value = last_integer(completion)
        if value is None:
            return 0.0
        return 1.0 if value == int(task.answer) else self.FORMAT_CREDIT


register(Kind.ENVIRONMENT, "reverse", "env_space.environments:ReverseEnvironment", summary="reverse a digit string")
register(Kind.ENVIRONMENT, "arithmetic", "env_space.environments:ArithmeticEnvironment", summary="small word problems")
