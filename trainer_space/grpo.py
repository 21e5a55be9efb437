"""Async GRPO-style policy-gradient loss on samples from the bucket.

Written by hand rather than with TRL's ``GRPOTrainer``: that trainer owns its
generation loop (generate, score, step, all in one process), while here
generation happens on replicas anywhere, arrives asynchronously through the
bucket with the sampler's log-probabilities and policy version, and may be
stale. What remains is a few lines: group-normalised advantages and the
clipped importance-ratio objective against the generator's log-probabilities.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shared.spaces.exchange import Sample


@dataclasses.dataclass
class LossStats:
    """Figures of one loss computation."""

    loss: float
    mean_reward: float
    samples: int
    groups: int
    zero_variance_groups: int
    clipped_fraction: float
    mean_ratio: float


def group_advantages(rewards: list[float], eps: float = 1e-4) -> list[float]:
    """Advantages of one group: rewards minus the group mean, over the group's std."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def completion_logprobs(model, samples: list[Sample], temperature: float, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each sample's completion tokens under ``model``.

    Returns:
        ``(logprobs, mask)``, both ``[samples, max_completion_len]``.
    """
    rows = [s.prompt_ids + s.token_ids for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # right padding: positions stay 0..len-1
        ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
    ids, attention = ids.to(device), attention.to(device)
    logits = model(input_ids=ids, attention_mask=attention).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    longest = max(len(s.token_ids) for s in samples)
    out = torch.zeros((len(samples), longest), device=device)
    mask = torch.zeros((len(samples), longest), device=device)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        n = len(s.token_ids)
        out[i, :n] = logp[i, start : start + n]
        mask[i, :n] = 1
    return out, mask


def grpo_loss(
    model, groups: list[list[Sample]], *, temperature: float, clip_eps: float, pad_id: int, device
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy-gradient loss over groups of samples of the same task.

    Each sample's advantage is its reward normalised within its group; the ratio
    is the current policy's probability of each sampled token over the
    generator's. The loss averages over tokens of each sample, then over samples.
    """
    samples = [s for g in groups for s in g if s.token_ids]
    advantages = torch.tensor(
        [a for g in groups for a, s in zip(group_advantages([s.reward or 0.0 for s in g]), g) if s.token_ids], device=device
    )
    new_lp, mask = completion_logprobs(model, samples, temperature, pad_id, device)
    old_lp = torch.zeros_like(new_lp)
    for i, s in enumerate(samples):
        old_lp[i, : len(s.logprobs)] = torch.tensor(s.logprobs, device=device)
    ratio = torch.exp(new_lp - old_lp)
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_sample = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    loss = per_sample.mean()
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = LossStats(
            loss=float(loss),
            mean_reward=sum(s.reward or 0.0 for g in groups for s in g) / max(1, sum(len(g) for g in groups)),
            samples=len(samples),
            groups=len(groups),
            zero_variance_groups=sum(1 for g in groups if len({s.reward for s in g}) == 1),
            clipped_fraction=float((clipped * mask).sum() / mask.sum().clamp(min=1)),
            mean_ratio=float((ratio * mask).sum() / mask.sum().clamp(min=1)),
        )
    return loss, stats
