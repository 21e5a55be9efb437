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

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

from math_verify import parse, verify

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


def load_reward(name: str, *, answer_column: str = "answer", answer_tag: str = "answer") -> RewardFunction:
    """A built-in reward (bound to the answer column and tag) or a user's function by dotted path.

    Args:
        name: ``exact_match``, ``math_verify``, ``format``, or ``package.module.function``.
        answer_column: Column holding the reference answer (built-ins only).
        answer_tag: Tag holding the final answer (built-ins only).

    Raises:
        ValueError: Not a built-in and not an importable callable.
    """
    if name in BUILTIN_REWARDS:
        return functools.partial(BUILTIN_REWARDS[name], answer_column=answer_column, answer_tag=answer_tag)
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ValueError(f"reward {name!r}: not one of {sorted(BUILTIN_REWARDS)} nor a dotted path module.function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {name!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn
