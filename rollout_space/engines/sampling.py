"""Sampling completions token by token with a KV cache, for :class:`~rollout_space.engines.transformers_engine.TransformersEngine`.

The reported log-probabilities are those of the distribution actually sampled from:
``log_softmax(logits.float() / temperature)``, renormalised over the top-p nucleus when ``top_p < 1``.
``temperature <= GREEDY_TEMPERATURE`` means greedy decoding; its log-probabilities are then those of the
unscaled logits.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_space.engine import Completion, SamplingSettings

__all__ = ["GREEDY_TEMPERATURE", "generate_completions", "sample_tokens"]

#: Temperatures at or below this decode greedily.
GREEDY_TEMPERATURE = 1e-5


def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    sampling: SamplingSettings,
    *,
    eos_ids: set[int],
    pad_id: int,
    device: torch.device,
) -> list[list[Completion]]:
    """Sample ``sampling.n`` completions per prompt with ``model`` (see
    :meth:`TransformersEngine.generate <rollout_space.engines.transformers_engine.TransformersEngine.generate>`).

    Args:
        model: A causal LM in eval mode.
        tokenizer: Its tokenizer.
        prompts: Plain-text prompts.
        sampling: Sampling settings.
        eos_ids: Token ids that end a completion (kept in its tokens).
        pad_id: Token id padding the prompts on the left and finished rows.
        device: Where the model runs.

    Returns:
        For each prompt, ``sampling.n`` completions.

    Raises:
        ValueError: ``n`` or ``max_new_tokens`` is below 1, or ``top_p`` is not in ``(0, 1]``.
    """
    if sampling.n < 1 or sampling.max_new_tokens < 1:
        raise ValueError("sampling.n and sampling.max_new_tokens must be >= 1")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if not prompts:
        return []
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    rows = [ids for ids in encoded for _ in range(sampling.n)]
    input_ids, attention = _left_pad(rows, pad_id, device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)

    batch = len(rows)
    eos = torch.tensor(sorted(eos_ids), device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]

    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    for step in range(sampling.max_new_tokens):
        next_ids, next_lp = sample_tokens(out.logits[:, -1, :], sampling, generator)
        active = (~finished).tolist()
        for i, (tok, lp) in enumerate(zip(next_ids.tolist(), next_lp.tolist())):
            if active[i]:
                tokens[i].append(tok)
                logprobs[i].append(lp)
        finished |= torch.isin(next_ids, eos)
        if bool(finished.all()) or step == sampling.max_new_tokens - 1:
            break
        next_ids = torch.where(finished, torch.full_like(next_ids, pad_id), next_ids)
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_ids[:, None],
            attention_mask=attention,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
        )

    completions = [
        Completion(
            text=tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=ids,
            logprobs=lps,
        )
        for ids, lps in zip(tokens, logprobs)
    ]
    n = sampling.n
    return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return it with its log-probability.

    Args:
        logits: ``(batch, vocab)`` next-token logits, any float dtype.
        sampling: Temperature and top-p.
        generator: Random generator on the logits' device.

    Returns:
        ``(token_ids, logprobs)``, both ``(batch,)``; log-probabilities are float32
        and taken from the distribution that was sampled from.
    """
    logits = logits.float()
    if sampling.temperature <= GREEDY_TEMPERATURE:
        logp = torch.log_softmax(logits, dim=-1)
        ids = logits.argmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        if sampling.top_p < 1.0:
            scaled = _top_p_mask(scaled, sampling.top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def _top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the smallest set whose probability reaches ``top_p`` to ``-inf``."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)
