"""Per-expert change rates of a MoE model over an RL run, and what its deltas cost per expert.

The tiny Qwen3-MoE (:data:`rlsync.spaces.tiny_model.TinyModel.MOE`) is trained with RL-like
policy-gradient steps (AdamW, sampled completions, random group-normalised rewards, as
``benchmarks.adapter_sparsity``, a new ``reverse`` task's prompt each step), and every step is
published to a local bucket in checkpoint names (one tensor per expert and projection,
:class:`rlsync.checkpoint_layout.CheckpointLayout`).
A hook on every router counts the tokens each expert received in the step's training forward.

Per step and expert: tokens routed, changed bf16 elements, and the delta bytes of that expert's
three tensors (the delta encoded for those tensors alone, header excluded). Summary: how often an
expert got no tokens, how much such an untouched expert still changed (AdamW's momentum moves it
on after its last tokens), and what an unchanged expert costs in a delta (nothing: an unchanged
tensor is not in the delta).

    python -m benchmarks.moe --steps 20 --experts 8 --group 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

def main(argv: list[str] | None = None) -> None:
    from benchmarks.adapter_sparsity import policy_gradient_step
    from env_space.environments import get_environment
    from rlsync.bucket import LocalBucket
    from rlsync.checkpoint_layout import CheckpointLayout, expert_of
    from rlsync.delta_format import encode_delta
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.spaces.tiny_model import TinyModel, tiny_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (default: the tiny MoE's)")
    parser.add_argument("--group", type=int, default=2, help="sampled completions per step")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    overrides = {"num_experts": args.experts} if args.experts else None
    path = tiny_model_path(kind=TinyModel.MOE, config_overrides=overrides, environments=get_environment)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layout = CheckpointLayout.of_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    tokens: collections.Counter[str] = collections.Counter()

    def count(layer: int):
        def hook(_module, _inputs, output):
            if torch.is_grad_enabled():  # the training forward, not generation
                for e in output[2].reshape(-1).tolist():
                    tokens[f"{layer}.{e}"] += 1
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(count(i))
    experts = sorted(
        {e for n in layout.checkpoint_state(model.state_dict()) if (e := expert_of(n))}, key=lambda e: tuple(map(int, e.split(".")))
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlsync-moe-bench-") as tmp:
        publisher = Publisher(LocalBucket(tmp), policy=FixedInterval(1000))
        publisher.publish(0, layout.checkpoint_state(model.state_dict()))
        prompts = [t.prompt for t in get_environment("reverse").tasks(args.steps, seed=1)]
        for step in range(1, args.steps + 1):
            tokens.clear()
            policy_gradient_step(model, tokenizer, optimizer, generator, group=args.group, prompt=prompts[step - 1])
            state = layout.checkpoint_state(model.state_dict())
            changes = publisher.detector.diff(state)
            record = publisher.publish(step, state)
            per = {e: {"tokens": tokens[e], "changed": 0, "total": 0, "bytes": 0} for e in experts}
            by_expert: dict[str, dict] = collections.defaultdict(dict)
            for name, tensor in state.items():
                e = expert_of(name)
                if e:
                    per[e]["total"] += tensor.numel()
                    if name in changes:
                        per[e]["changed"] += changes[name].index.size
                        by_expert[e][name] = changes[name]
            empty = len(encode_delta({}, step=step, base_step=step - 1, base_hash="0" * 64, state_hash="0" * 64, total=0))
            for e, ch in by_expert.items():
                data = encode_delta(ch, step=step, base_step=step - 1, base_hash="0" * 64, state_hash="0" * 64, total=0)
                per[e]["bytes"] = len(data) - empty
            rows.append({"step": step, "delta_bytes": record.nbytes, "changed": record.changed, "total": record.total,
                         "experts": per})
            untouched = sum(v["tokens"] == 0 for v in per.values())
            print(json.dumps({"step": step, "delta_bytes": record.nbytes, "untouched": untouched}), flush=True)
    cells = [v for r in rows for v in r["experts"].values()]
    untouched = [v for v in cells if v["tokens"] == 0]
    touched = [v for v in cells if v["tokens"] > 0]
    pct = lambda v: 100 * v["changed"] / v["total"]  # noqa: E731
    summary = {
        "steps": args.steps, "experts": len(experts), "group": args.group, "lr": args.lr,
        "expert_steps": len(cells), "untouched_expert_steps": len(untouched),
        "touched_changed_pct_median": statistics.median(map(pct, touched)) if touched else None,
        "untouched_changed_pct_median": statistics.median(map(pct, untouched)) if untouched else None,
        "unchanged_expert_steps": sum(v["changed"] == 0 for v in cells),
        "untouched_but_changed_expert_steps": sum(v["changed"] > 0 for v in untouched),
        "unchanged_expert_bytes_max": max((v["bytes"] for v in cells if v["changed"] == 0), default=None),
        "touched_bytes_median": statistics.median(v["bytes"] for v in touched) if touched else None,
        "untouched_bytes_median": statistics.median(v["bytes"] for v in untouched) if untouched else None,
        "delta_bytes_median": statistics.median(r["delta_bytes"] for r in rows), "load_avg": os.getloadavg()[0],
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
