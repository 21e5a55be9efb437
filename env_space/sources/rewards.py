"""Reward functions in TRL's form, and loading them by name.

A reward function has TRL's signature ``reward(prompts, completions, **columns) -> list[float | None]``
and is called by keyword, as TRL's ``GRPOTrainer`` calls it: one value per completion, ``None``
where it does not apply. ``columns`` holds every dataset column by name (except ``prompt`` and
``completion``), one value per completion; TRL's trainer-only arguments (``completion_ids``,
``trainer_state``, ``log_extra``, ``log_metric``) are not passed. Completions are strings, or,
for conversational datasets (a prompt column of chat messages), TRL's
``[{"role": "assistant", "content": ...}]``. So a function written for TRL's
``GRPOTrainer(reward_funcs=...)`` works here unchanged.

Built-ins (see :data:`BUILTIN_REWARDS`):

- ``exact_match``: 1.0 when the answer (inside ``<answer>...</answer>`` when the tag is
  present, else the whole completion), stripped, equals the reference, else 0.0;
- ``math_verify``: 1.0 when Hugging Face's math-verify finds the completion equivalent to the
  reference (``verify(parse(reference), parse(completion))``), 0.0 if not, ``None`` when the
  reference itself does not parse;
- ``format``: 1.0 when the completion ends with one ``<answer>...</answer>`` block, else 0.0.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from math_verify import parse, verify
from rlsync.config import from_env

from .evaluators import guard_evaluators

guard_evaluators()  # math-verify parses completions with sympy's parse_expr

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "completion_text",
    "exact_match",
    "format_reward",
    "load_reward",
    "math_verify_reward",
]

RewardFunction = Callable[..., list[Any]]


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or TRL's conversational ``[{"role": ..., "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _tagged(text: str, tag: str) -> str | None:
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def exact_match(
    prompts: list[Any],
    completions: list[Any],
    *,
    answer_column: str = "answer",
    answer_tag: str = "answer",
    **columns: Any,
) -> list[float]:
    """1.0 where the (tagged, else whole) stripped answer equals the reference column, else 0.0."""
    out = []
    for completion, reference in zip(completions, columns[answer_column]):
        text = completion_text(completion)
        answer = _tagged(text, answer_tag)
        out.append(float((answer if answer is not None else text.strip()) == str(reference).strip()))
    return out


def math_verify_reward(
    prompts: list[Any], completions: list[Any], *, answer_column: str = "answer", **columns: Any
) -> list[float | None]:
    """math-verify equivalence of each completion with the reference (``None`` if the reference does not parse).

    Timeouts of math-verify itself (``signal.alarm``, main thread only) are off; the
    caller bounds the call in time instead.
    """
    out: list[float | None] = []
    for completion, reference in zip(completions, columns[answer_column]):
        gold = parse(str(reference), parsing_timeout=None)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion_text(completion), parsing_timeout=None)
        out.append(float(verify(gold, pred, timeout_seconds=None)))
    return out


def format_reward(
    prompts: list[Any], completions: list[Any], *, answer_tag: str = "answer", **columns: Any
) -> list[float]:
    """1.0 where the completion ends with one ``<answer>...</answer>`` block, else 0.0."""
    tag = re.escape(answer_tag)
    pattern = re.compile(rf"(?:(?!<{tag}>).)*<{tag}>(?:(?!<{tag}>).)+?</{tag}>\s*", flags=re.DOTALL)
    return [float(pattern.fullmatch(completion_text(c)) is not None) for c in completions]


#: Built-in reward functions by name.
BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
    "format": format_reward,
}


#: Operator-set variable: dotted reward functions allowed beside the built-ins and the Space's own code.
ALLOW_ENV = "ENV_REWARD_ALLOW"
#: The operator's own reward setting; the dotted paths it names are allowed too.
REWARDS_ENV = "ENV_DATASET_REWARDS"


@dataclasses.dataclass(frozen=True)
class _AllowedRewards:
    """The two variables (prefix ``ENV``) that name the dotted reward functions the operator allows."""

    reward_allow: str = ""  #: ``ALLOW_ENV``
    dataset_rewards: str = ""  #: ``REWARDS_ENV``


#: The Space's repo: modules found here (outside the project's packages and any installed ones) are its own code.
SPACE_REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = frozenset(
    {"env_space", "rollout_space", "trainer_space", "rlsync", "app", "tests", "benchmarks", "testing", "scripts", "shared"}
)


def allowed_reward_paths(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The dotted reward paths the operator allowed: ``ENV_REWARD_ALLOW`` (comma-separated) and the
    dotted names in ``ENV_DATASET_REWARDS`` (environment variables, never a panel's form)."""
    allowed = from_env(_AllowedRewards, "ENV", environ)
    names = allowed.reward_allow.split(",") + [n.split("=")[0] for n in allowed.dataset_rewards.split(",")]
    return frozenset(n.strip() for n in names if "." in n.strip())


def is_space_code(module_name: str) -> bool:
    """Whether the top-level package of ``module_name`` is a file of the Space's own repo (found without
    importing it), not one of the project's packages, the standard library or an installed package."""
    top = module_name.split(".")[0]
    if top in PROJECT_PACKAGES:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    if not origin or origin in ("built-in", "frozen"):
        return False
    path = Path(origin).resolve()
    return path.is_relative_to(SPACE_REPO) and not {"site-packages", "dist-packages", ".venv"} & set(path.parts)


def check_reward_name(name: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a reward that is neither a built-in, nor allowed by the operator, nor the Space's own code.

    Raises:
        ValueError: naming the ways to allow it.
    """
    if name in BUILTIN_REWARDS or name in allowed_reward_paths(environ):
        return
    module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {name!r}: not one of {sorted(BUILTIN_REWARDS)} nor a dotted path module.function")
    if not is_space_code(module_name):
        raise ValueError(
            f"reward {name!r} is not allowed: use a built-in ({', '.join(sorted(BUILTIN_REWARDS))}), a module of this "
            f"Space's repo, or a path the operator lists in {ALLOW_ENV} (or sets in {REWARDS_ENV})"
        )


def load_reward(name: str, *, answer_column: str = "answer", answer_tag: str = "answer") -> RewardFunction:
    """A built-in reward (bound to the answer column and tag) or an allowed user function by dotted path.

    Args:
        name: ``exact_match``, ``math_verify``, ``format``, or ``package.module.function`` that
            :func:`check_reward_name` allows (the operator's allow-list or the Space's own code).
        answer_column: Column holding the reference answer (built-ins only).
        answer_tag: Tag holding the final answer (built-ins only).

    Raises:
        ValueError: Not a built-in, not allowed, or not an importable callable.
    """
    check_reward_name(name)
    if name in BUILTIN_REWARDS:
        return functools.partial(BUILTIN_REWARDS[name], answer_column=answer_column, answer_tag=answer_tag)
    module_name, _, attr = name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {name!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn
