"""Sync benchmark: bytes and speed of each way to ship one RL step's weights.

Synthetic RL-like updates: weights drawn like an LLM's (matrices ~N(0, 0.02),
norm weights near 1), fp32 master weights, AdamW steps at several learning
rates, published as bf16. For each codec it prints % changed, bytes per changed
element, ratio to the full snapshot, encode and decode+apply throughput (GB of
bf16 model per second), the time of a bare bit comparison of the same two states
(the memory-bound reference for encoding) and of a plain scatter of the changed
elements into a copy (the reference for decoding), all measured in this run.

    python -m benchmarks.sync                      # ~100M parameters
    python -m benchmarks.sync --params 20e6 --lrs 1e-6 1e-5
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np
import safetensors.torch
import torch
import zstandard

from benchmarks.entropy import delta_entropy
from rlsync.detect import ChangeDetector
from rlsync.dtypes import int_view
from rlsync.delta_format import decode_delta, encode_delta
from rlsync.hashing import state_hash

logger = logging.getLogger("benchmarks.sync")


def model_shapes(params: float, *, hidden: int = 1024) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a decoder-only LLM with about ``params`` parameters (1-D tensors are norm weights)."""
    inter = 3 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    vocab = 32000
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })  # fmt: skip
    return shapes


def init_weights(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 weights drawn like an LLM's: matrices ~N(0, 0.02), norm weights near 1."""
    return torch.randn(*shape, generator=gen) * 0.02 + (1.0 if len(shape) == 1 else 0.0)


def make_model(params: float, *, hidden: int = 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights shaped like a decoder-only LLM with about ``params`` parameters."""
    gen = torch.Generator().manual_seed(seed)
    return {name: init_weights(shape, gen) for name, shape in model_shapes(params, hidden=hidden).items()}


def adamw_steps(master: dict[str, torch.Tensor], lr: float, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Run AdamW with random gradients; return the bf16 state after each step."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in master.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        out.append({n: p.detach().to(torch.bfloat16) for n, p in params.items()})
    return out


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def plain_scatter(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]):
    """The decode reference: writing the changed elements' new bits (already in memory) into a copy of ``old``."""
    pairs = {}
    for n in old:
        o, w = int_view(old[n]).numpy(), int_view(new[n]).numpy()
        index = np.flatnonzero(o != w)
        pairs[n] = (index, w[index])
    work = {n: t.clone() for n, t in old.items()}

    def scatter() -> None:
        for n, (index, values) in pairs.items():
            int_view(work[n]).numpy()[index] = values

    return scatter


def bare_compare(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """The physical reference: one memory-bound pass comparing the bits of two states."""
    return sum(int(np.count_nonzero(int_view(old[n]).numpy() != int_view(new[n]).numpy())) for n in old)


def measure(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], codecs: list[str], repeat: int) -> list[dict]:
    """Bytes and times of every method on one pair of states.

    Timings are interleaved: each round times the bare comparison and every
    method's encode once, and the best of ``repeat`` rounds is kept for each,
    so that a noisy machine affects the reference and the methods alike.
    """
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    total = sum(t.numel() for t in new.values())
    changed = bare_compare(old, new)
    cctx, dctx = zstandard.ZstdCompressor(level=3, threads=-1), zstandard.ZstdDecompressor()

    def delta_encoder(codec: str):
        detector = ChangeDetector(dtype=None)
        detector.published = old
        return lambda: encode_delta(detector.diff(new), step=1, base_step=0, base_hash="", state_hash="", total=total, codec=codec)

    encoders = {
        "full safetensors": lambda: safetensors.torch.save(new),
        "full safetensors + zstd": lambda: cctx.compress(safetensors.torch.save(new)),
        **{f"delta {codec}": delta_encoder(codec) for codec in codecs},
    }
    best = {name: float("inf") for name in ["compare", *encoders]}
    outputs: dict[str, bytes] = {}
    for _ in range(repeat):
        for name, fn in [("compare", lambda: bare_compare(old, new)), *encoders.items()]:
            seconds, out = best_of(fn, 1)
            best[name] = min(best[name], seconds)
            outputs[name] = out
    scatter = plain_scatter(old, new)
    scatter_s, _ = best_of(scatter, repeat)
    target = state_hash(new)
    rows = []
    for name in encoders:
        data = outputs[name]
        if name == "full safetensors":
            dec_s, _ = best_of(lambda: safetensors.torch.load(data), repeat)
        elif name == "full safetensors + zstd":
            dec_s, _ = best_of(lambda: safetensors.torch.load(dctx.decompress(data)), 1)
        else:
            work = {n: t.clone() for n, t in old.items()}

            def decode_apply():
                for tensor_name, patch in decode_delta(data, work).patches.items():
                    patch.apply_(work[tensor_name])

            dec_s = float("inf")
            for _ in range(repeat):  # a fresh copy each round, timed from the file to the applied state
                work = {n: t.clone() for n, t in old.items()}
                seconds, _ = best_of(decode_apply, 1)
                dec_s = min(dec_s, seconds)
            if state_hash(work) != target:
                raise AssertionError(f"{name}: decode+apply is not bit-exact")
        rows.append({
            "method": name, "changed_pct": 100 * changed / total,
            "bytes_per_changed": len(data) / max(changed, 1), "bytes": len(data),
            "ratio_to_full": len(data) / model_bytes,
            "encode_gbps": model_bytes / best[name] / 1e9, "decode_apply_gbps": model_bytes / dec_s / 1e9,
            "encode_s": best[name], "decode_apply_s": dec_s, "compare_s": best["compare"],
            "encode_vs_compare": best[name] / best["compare"], "scatter_s": scatter_s,
            "decode_vs_scatter": dec_s / scatter_s,
        })  # fmt: skip
    return rows


def print_table(lr: float, rows: list[dict], bounds: dict[str, float] | None = None) -> None:
    """Print one learning rate's rows, the entropy bounds (if given) and each codec's ratio to the TRL layout."""
    print(
        f"\nlr={lr:g}: {rows[0]['changed_pct']:.3f}% of elements changed; bare comparison {rows[0]['compare_s'] * 1e3:.1f} ms, "
        f"plain scatter {rows[0]['scatter_s'] * 1e3:.1f} ms"
    )
    print(
        f"{'method':26s} {'bytes':>12s} {'B/changed':>10s} {'vs full':>9s} {'enc GB/s':>9s} {'enc/cmp':>8s} "
        f"{'dec+apply GB/s':>15s} {'dec/scatter':>12s}"
    )
    for r in rows:
        print(
            f"{r['method']:26s} {r['bytes']:12,d} {r['bytes_per_changed']:10.3f} {r['ratio_to_full']:9.5f} "
            f"{r['encode_gbps']:9.2f} {r['encode_vs_compare']:8.2f} {r['decode_apply_gbps']:15.2f} {r['decode_vs_scatter']:12.2f}"
        )
    if bounds:
        print(
            f"{'entropy bound, context-free':26s} {'':12s} {bounds['bound_free']:10.3f}   "
            f"(positions {bounds['positions_free']:.3f} + values {bounds['values_free']:.3f})"
        )
        print(
            f"{'entropy bound, old exponent':26s} {'':12s} {bounds['bound_exponent']:10.3f}   "
            f"(positions {bounds['positions_exponent']:.3f} + values {bounds['values_exponent']:.3f})"
        )
    by = {r["method"]: r for r in rows}
    for name in by:
        if name.startswith("delta ") and name != "delta trl" and "delta trl" in by:
            print(f"{name[6:]} is {by['delta trl']['bytes'] / by[name]['bytes']:.2f}x smaller than the TRL layout")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="model size in parameters (default 100e6)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--warmup-steps", type=int, default=10, help="AdamW steps before the measured one (later steps change fewer elements)")
    ap.add_argument("--codecs", nargs="+", default=["trl", "gapzz", "classgap", "classrice"])
    ap.add_argument("--repeat", type=int, default=5, help="interleaved timing rounds (best of)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    master = make_model(args.params, hidden=args.hidden)
    n = sum(t.numel() for t in master.values())
    print(f"model: {n / 1e6:.1f}M parameters, {len(master)} tensors, bf16 snapshot {2 * n / 1e6:.0f} MB; torch threads {torch.get_num_threads()}")
    results = {}
    for lr in args.lrs:
        states = adamw_steps(master, lr, args.warmup_steps + 1, seed=1)
        old = states[-2] if len(states) > 1 else {k: v.to(torch.bfloat16) for k, v in master.items()}
        rows = measure(old, states[-1], args.codecs, args.repeat)
        print_table(lr, rows, delta_entropy(old, states[-1]))
        results[str(lr)] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
