"""FP8 chain beside the bf16 chain: change rate, bytes per version, scale changes, the trainer's extra cost.

Two states, each published every step to a bf16 chain and to an FP8 chain (:mod:`rlsync.fp8`) in
one local bucket:

* ``tiny``: the tiny offline model trained with RL-like policy-gradient steps (AdamW, sampled
  completions, random group-normalised rewards), as ``benchmarks.adapter_sparsity`` does;
* ``0.6B``: fp32 master weights shaped like the scale benchmark's LLM (``benchmarks.sync.make_model``,
  about 0.6e9 parameters) with the scale benchmark's small random updates.

Per version: changed elements and bytes of each chain, the fraction of 128x128 blocks whose scale
changed, and the FP8 chain's time (quantize + publish) against the bf16 publish. Memory: the peak
RSS added by the FP8 chain (its shadow plus one quantized version), measured in the same process.

    python -m benchmarks.fp8 --model tiny --steps 20
    python -m benchmarks.fp8 --model 0.6B --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlsync.bucket import LocalBucket
from rlsync.fp8 import SCALE_SUFFIX, fp8_publisher, quantize_state
from rlsync.protocol import FixedInterval, Publisher

UPDATE_SCALE = 4e-7  # the scale benchmark's per-step fp32 update (about 1-2% of bf16 weights flip)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def tiny_steps(steps: int, lr: float, seed: int = 0):
    """The tiny model's fp32 state after each of ``steps`` RL-like steps (a generator; the first is the start)."""
    from benchmarks.adapter_sparsity import policy_gradient_step
    from env_space.environments import get_environment
    from rlsync.spaces.tiny_model import tiny_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    path = tiny_model_path(environments=get_environment)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-8, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    yield dict(model.state_dict())
    for _ in range(steps):
        policy_gradient_step(model, tokenizer, optimizer, generator)
        yield dict(model.state_dict())


def synthetic_steps(steps: int, params: float, seed: int = 0):
    """The scale benchmark's LLM-shaped fp32 state and its small random updates."""
    from benchmarks.sync import make_model

    master = make_model(params, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    yield master
    for _ in range(steps):
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=gen) * UPDATE_SCALE)
        yield master


def run(states, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlsync-fp8-bench-") as tmp:
        bucket = LocalBucket(tmp)
        bf16 = Publisher(bucket, policy=FixedInterval(1000))
        fp8 = None
        rows = []
        prev_scales: dict[str, torch.Tensor] = {}
        for step, state in enumerate(states):
            t0 = time.perf_counter()
            rec = bf16.publish(step, state)
            t1 = time.perf_counter()
            _reset_peak()
            base = _rss_kb("VmRSS:")
            quantized = quantize_state(state)
            t2 = time.perf_counter()
            if fp8 is None:
                fp8 = fp8_publisher(bucket, policy=FixedInterval(1000))
            frec = fp8.publish(step, quantized)
            t3 = time.perf_counter()
            peak = _rss_kb("VmHWM:") - base
            scales = {n: t for n, t in quantized.items() if n.endswith(SCALE_SUFFIX)}
            blocks = sum(t.numel() for t in scales.values())
            changed_blocks = sum(int((t != prev_scales[n]).sum()) for n, t in scales.items()) if prev_scales else blocks
            prev_scales = {n: t.clone() for n, t in scales.items()}
            del quantized
            rows.append({
                "step": step, "kind": rec.kind, "bf16_bytes": rec.nbytes, "bf16_changed": rec.changed, "bf16_total": rec.total,
                "fp8_bytes": frec.nbytes, "fp8_changed": frec.changed, "fp8_total": frec.total,
                "blocks": blocks, "blocks_rescaled": changed_blocks,
                "bf16_publish_s": t1 - t0, "quantize_s": t2 - t1, "fp8_publish_s": t3 - t2, "fp8_peak_added_mb": peak / 1024,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        shadow_mb = sum(t.numel() * t.element_size() for t in fp8.detector.published.values()) / 2**20
        bf16_shadow_mb = sum(t.numel() * t.element_size() for t in bf16.detector.published.values()) / 2**20
    deltas = rows[1:]
    med = lambda f: statistics.median(f(r) for r in deltas)  # noqa: E731
    return {
        "versions": len(rows), "anchor_bf16_bytes": rows[0]["bf16_bytes"], "anchor_fp8_bytes": rows[0]["fp8_bytes"],
        "bf16_changed_pct": med(lambda r: 100 * r["bf16_changed"] / r["bf16_total"]),
        "fp8_changed_pct": med(lambda r: 100 * r["fp8_changed"] / r["fp8_total"]),
        "bf16_delta_bytes": med(lambda r: r["bf16_bytes"]), "fp8_delta_bytes": med(lambda r: r["fp8_bytes"]),
        "blocks": rows[0]["blocks"], "blocks_rescaled_pct": med(lambda r: 100 * r["blocks_rescaled"] / r["blocks"]),
        "bf16_publish_s": med(lambda r: r["bf16_publish_s"]), "quantize_s": med(lambda r: r["quantize_s"]),
        "fp8_publish_s": med(lambda r: r["fp8_publish_s"]), "fp8_peak_added_mb": max(r["fp8_peak_added_mb"] for r in rows),
        "fp8_shadow_mb": shadow_mb, "bf16_shadow_mb": bf16_shadow_mb, "load_avg": os.getloadavg()[0], "rows": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "0.6B"), default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the tiny model's steps")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    states = tiny_steps(args.steps, args.lr) if args.model == "tiny" else synthetic_steps(args.steps, 0.6e9)
    result = {"model": args.model, "steps": args.steps, **run(states, args.steps)}
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
