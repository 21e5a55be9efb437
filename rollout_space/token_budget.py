"""Bounding what one task batch makes a replica compute, in tokens.

A task object is untrusted: one within the parser's limits (1,024 prompts of up to
64 Ki characters, 16 MiB) once made a replica allocate 8.6 GB, and every replica
takes the oldest unanswered batch, so the fleet fell in turn. Before generating, a
replica tokenizes the prompts and :func:`plan_batch` decides:

- a prompt longer than ``max_prompt_tokens`` (default: the model's context less
  ``max_new_tokens``) is dropped, and counted;
- a batch whose work (``n`` x (prompt + ``max_new_tokens``) summed over its prompts)
  exceeds ``max_batch_tokens`` is refused whole;
- the rest is generated in chunks of prompts whose padded size (rows x longest row)
  stays within ``chunk_tokens``, which bounds the engine's memory per call.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = ["BatchPlan", "TokenBudget", "context_length", "plan_batch"]


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """Token bounds of one task batch.

    Args:
        max_prompt_tokens: Longest prompt kept.
        max_new_tokens: Completion length limit.
        n: Completions per prompt.
        max_batch_tokens: Most tokens (prompts and completions, all samples) one batch may cost.
        chunk_tokens: Most padded tokens (rows x longest row) in one engine call.
    """

    max_prompt_tokens: int
    max_new_tokens: int
    n: int
    max_batch_tokens: int
    chunk_tokens: int


@dataclasses.dataclass
class BatchPlan:
    """What to generate: ``chunks`` of prompt indices, the ``dropped`` indices, or ``refused`` (a reason)."""

    chunks: list[list[int]]
    dropped: list[int]
    refused: str | None = None


def context_length(model_path: str | Path, default: int = 2048) -> int:
    """The model's context (``max_position_embeddings`` of its ``config.json``), else ``default``."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return default
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key) if isinstance(config, dict) else None
        if type(value) is int and value > 0:
            return value
    return default


def plan_batch(prompt_lengths: list[int], budget: TokenBudget) -> BatchPlan:
    """Decide what of a batch to generate (see the module docstring).

    Args:
        prompt_lengths: Tokens of each prompt.
        budget: The bounds.

    Returns:
        The plan; chunks keep the prompts' order.
    """
    dropped = [i for i, length in enumerate(prompt_lengths) if length > budget.max_prompt_tokens]
    kept = [i for i, length in enumerate(prompt_lengths) if length <= budget.max_prompt_tokens]
    work = sum(budget.n * (prompt_lengths[i] + budget.max_new_tokens) for i in kept)
    if work > budget.max_batch_tokens:
        return BatchPlan([], dropped, f"{work} tokens of work, more than {budget.max_batch_tokens}")
    chunks: list[list[int]] = []
    longest = 0
    for i in kept:
        row = prompt_lengths[i] + budget.max_new_tokens
        if chunks and budget.n * (len(chunks[-1]) + 1) * max(longest, row) <= budget.chunk_tokens:
            chunks[-1].append(i)
            longest = max(longest, row)
        else:
            chunks.append([i])
            longest = row
    return BatchPlan(chunks, dropped)
