"""Sync at Qwen3-0.6B size on one GPU, torch and rlsync only (no vLLM, no TRL): one short call.

The weights are fp32 masters of the real 0.6B shapes on the GPU, moved by AdamW-sized steps
(``lr`` times a random sign, the size of Adam's first steps). Per step it measures, in the same run:
the bare cast of the weights to bf16 against the trainer's stall (a
:class:`~rlsync.protocol.background.BackgroundPublisher` stage: the same cast into its staging
buffer) and the background publish (detection on the GPU, the class order on the GPU, encode,
upload to a local bucket); then a GPU replica's decode of each delta (against its GPU weights)
against the bare scatter of the decoded patch into them, and a whole-state copy.

    python -m benchmarks.gpu_scale_sync            # on a machine with a CUDA GPU
    python -m benchmarks.gpu_scale_sync --lr 3e-6 --steps 4
    python -m benchmarks.gpu_scale_sync --device cpu --layers 1 --vocab 4096   # the logic, on CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

SHAPES = dict(vocab=151936, hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128)


def qwen3_shapes(s: dict = SHAPES) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's tensors (the head is tied to the embedding, so listed once)."""
    h, hd = s["hidden"], s["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s["vocab"], h), "model.norm.weight": (h,)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (s["heads"] * hd, h), p + "self_attn.k_proj.weight": (s["kv"] * hd, h),
            p + "self_attn.v_proj.weight": (s["kv"] * hd, h), p + "self_attn.o_proj.weight": (h, s["heads"] * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (s["inter"], h), p + "mlp.up_proj.weight": (s["inter"], h),
            p + "mlp.down_proj.weight": (h, s["inter"]),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
    return shapes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    from rlsync.bucket import LocalBucket
    from rlsync.format import decode_delta
    from rlsync.protocol import FixedInterval, Publisher, read_manifest
    from rlsync.protocol.background import BackgroundPublisher

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--codec", default="classrice")
    parser.add_argument("--device", default="cuda", help="'cpu' with --layers 1 --vocab 4096 checks the logic")
    parser.add_argument("--layers", type=int, default=SHAPES["layers"])
    parser.add_argument("--vocab", type=int, default=SHAPES["vocab"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    master = {
        n: (torch.randn(s, generator=g, device=device) * 0.02 if len(s) > 1 else torch.ones(s, device=device))
        for n, s in qwen3_shapes({**SHAPES, "layers": args.layers, "vocab": args.vocab}).items()
    }  # fmt: skip
    total = sum(t.numel() for t in master.values())
    bucket = LocalBucket(tempfile.mkdtemp(prefix="rlsync-gpu-scale-"))
    publisher = BackgroundPublisher(Publisher(bucket, codec=args.codec, policy=FixedInterval(1000)))
    cast_buffer = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in master.items()}
    publisher.stage(master.items())
    publisher.flush()
    replica = {n: t.clone() for n, t in publisher.publisher.detector.published.items()}  # a GPU replica at version 0
    rows = []
    for step in range(1, args.steps + 1):
        for t in master.values():
            t.add_(torch.randint(0, 2, t.shape, generator=g, device=device).mul_(2).sub_(1), alpha=args.lr)
        cast_s = timed(lambda: [cast_buffer[n].copy_(t) for n, t in master.items()], device)
        stall_s = timed(lambda: publisher.stage(master.items()), device)
        publish_s = timed(publisher.flush, device) + stall_s
        entry = read_manifest(bucket).deltas[-1]
        data = bucket.get(entry.files[0].key)
        t0 = time.perf_counter()
        delta = decode_delta(data, replica)
        synchronize(device)
        decode_s = time.perf_counter() - t0
        scatter_s = timed(lambda: [p.apply_(replica[n]) for n, p in delta.patches.items()], device)
        copy_s = timed(lambda: [replica[n].copy_(cast_buffer[n]) for n in replica], device)
        rows.append({
            "step": step, "changed_pct": 100 * delta.changed / total, "nbytes": len(data), "cast_s": cast_s,
            "stall_s": stall_s, "publish_s": publish_s, "decode_s": decode_s, "scatter_s": scatter_s, "copy_s": copy_s,
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    publisher.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"| step | changed | bytes | stall / bf16 cast | background publish | decode | scatter / whole copy ({name}) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['step']} | {r['changed_pct']:.2f}% | {r['nbytes'] / 1e6:.1f} MB | {r['stall_s'] * 1e3:.1f} / {r['cast_s'] * 1e3:.1f} ms "
            f"| {r['publish_s']:.2f} s | {r['decode_s']:.3f} s | {r['scatter_s'] * 1e3:.1f} / {r['copy_s'] * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()
