"""How sparse are bf16 LoRA adapter updates between RL steps, and what do their deltas cost?

Trains a peft LoRA adapter on the tiny offline model with AdamW and a policy-gradient loss
(sampled completions, group-normalised random rewards: the gradient statistics of an RL step)
at several learning rates, publishes every step to an adapter chain (:mod:`rlsync.adapters`)
and reports per learning rate:

- the % of adapter elements whose bf16 value changed per step, for ``lora_A`` and ``lora_B``
  (B starts at zero, so its small values change in bf16 at any learning rate);
- the delta's bytes per changed element and against the whole adapter (the anchor);
- whether the delta pays: the publisher writes an anchor's companion delta only when it is
  smaller than the anchor, else replicas keeping up download the whole adapter.

    python -m benchmarks.adapter_sparsity                      # lr 1e-6, 1e-5, 1e-4, 1e-3; 20 steps each
    python -m benchmarks.adapter_sparsity --lr 1e-5 --steps 50 --rank 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from env_space.environments import get_environment
from rlsync.adapters import AdapterChain, LoraSpec, adapter_publisher
from rlsync.lora import adapter_tensors, peft_config
from rlsync.bucket import LocalBucket
from rlsync.protocol import FixedInterval
from rlsync.spaces.tiny_model import tiny_model_path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def policy_gradient_step(
    model, tokenizer, optimizer, generator: torch.Generator, group: int = 8, prompt: str = "reverse 1234 ="
) -> None:
    """One RL-like step: sample ``group`` completions of ``prompt``, reward them at random, normalise, and
    follow ``-advantage * log p(completion)``."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].repeat(group, 1)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=True, pad_token_id=tokenizer.pad_token_id or 0)
    rewards = torch.rand(group, generator=generator)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    logits = model(out).logits[:, ids.shape[1] - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, out[:, ids.shape[1] :, None]).squeeze(-1).sum(-1)
    loss = -(advantages * logp).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def measure(lr: float, steps: int, rank: int, seed: int = 0) -> dict:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    path = tiny_model_path(environments=get_environment)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lora = LoraSpec(rank, 2.0 * rank, TARGETS)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft_config(lora))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, eps=1e-8, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="rlsync-adapter-sparsity-") as tmp:
        publisher = adapter_publisher(LocalBucket(tmp), AdapterChain("tiny", "0" * 64, lora), policy=FixedInterval(10**6))
        anchor = publisher.publish(0, adapter_tensors(model))
        previous = {n: t.to(torch.bfloat16) for n, t in adapter_tensors(model).items()}
        rows = []
        for step in range(1, steps + 1):
            policy_gradient_step(model, tokenizer, optimizer, generator)
            tensors = adapter_tensors(model)
            record = publisher.publish(step, tensors)
            now = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
            changed = {kind: [0, 0] for kind in ("lora_A", "lora_B")}
            for name, tensor in now.items():
                kind = "lora_A" if ".lora_A." in name else "lora_B"
                changed[kind][0] += int((tensor.view(torch.int16) != previous[name].view(torch.int16)).sum())
                changed[kind][1] += tensor.numel()
            previous = now
            rows.append({
                "step": step, "nbytes": record.nbytes, "changed": record.changed, "total": record.total,
                **{f"{k}_changed_pct": 100 * c / n for k, (c, n) in changed.items()},
            })  # fmt: skip
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "lr": lr, "rank": rank, "steps": steps, "adapter_elements": anchor.total, "anchor_bytes": anchor.nbytes,
        "median_changed_pct": statistics.median(100 * r["changed"] / r["total"] for r in rows),
        "median_lora_A_changed_pct": med("lora_A_changed_pct"), "median_lora_B_changed_pct": med("lora_B_changed_pct"),
        "median_delta_bytes": med("nbytes"),
        "median_delta_vs_anchor": statistics.median(r["nbytes"] / anchor.nbytes for r in rows),
        "median_bytes_per_changed_element": statistics.median(r["nbytes"] / r["changed"] for r in rows if r["changed"]),
        "deltas_that_pay": sum(r["nbytes"] < anchor.nbytes for r in rows), "load_avg": os.getloadavg()[0],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, action="append", help="learning rate (repeatable; default 1e-6 1e-5 1e-4 1e-3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [measure(lr, args.steps, args.rank) for lr in args.lr or (1e-6, 1e-5, 1e-4, 1e-3)]
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
