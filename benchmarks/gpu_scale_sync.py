"""Sync at Qwen3-0.6B size on one GPU, torch and rlsync only (no vLLM, no TRL): one short call.

The weights are fp32 masters of the real 0.6B shapes (``--params N``: the smaller Qwen3 of
:mod:`benchmarks.scale_sync`) on the device, moved by AdamW-sized steps (``lr`` times a random sign,
the size of Adam's first steps). Per step it measures, in the same run: the bare cast of the weights
to bf16 against the trainer's stall (a :class:`~rlsync.protocol.background.BackgroundPublisher`
stage: the same cast into its staging buffer) and the background publish (detection and the class
order on the device, encode, upload to a local bucket), and, on the same two bf16 states, each stage of
that publish alone: the device path of change detection (:mod:`rlsync.device_changes`: compare, extract
positions, copy to host, chunk by chunk as :class:`~rlsync.detect.ChangeDetector` runs it; only the changed
elements cross to the host), encode (the codec, its class order on the device) and write (the delta file
to a local bucket); then a replica, a
:class:`~rlsync.protocol.Subscriber` whose state is bf16 weights on the device (``weights=``, as a
serving engine's), fetches the delta (download, decode against its device weights, hash check:
off the pause) and applies it (the pause), against the bare scatter of the same patch into the same
weights and a whole-state copy; and the device memory the replica's fetch and apply add above its
weights (the decoded patch, staged on the device). The replica's weights must hash as published
after every step.

    python -m benchmarks.gpu_scale_sync                 # on a machine with a CUDA GPU (~1 min on an H200)
    python -m benchmarks.gpu_scale_sync --lr 3e-6 --steps 4
    python -m benchmarks.gpu_scale_sync --device cpu --params 5e6   # the logic, on CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.qwen3 import MODELS, model_config, qwen3_shapes
from rlsync.bucket import Bucket


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def allocated(device: torch.device) -> int:
    """Device memory allocated by torch now (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_since_reset(device: torch.device) -> int:
    """Device memory allocated at most since the last reset (0 off CUDA)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def main(argv: list[str] | None = None) -> None:
    from rlsync.bucket import LocalBucket

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b", help="a real model's dimensions")
    size.add_argument("--params", type=float, help="a smaller Qwen3 of about this many parameters")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--codec", default="classrice")
    parser.add_argument("--device", default="cuda", help="'cpu' with a small --params checks the logic")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = model_config(None if args.params else args.model, args.params)
    with tempfile.TemporaryDirectory(prefix="rlsync-gpu-scale-") as work:
        bucket, scratch = LocalBucket(Path(work) / "bucket"), LocalBucket(Path(work) / "scratch")
        rows, weights = measure(args, device, config, bucket, scratch)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    total = sum(t.numel() for t in weights.values())
    model_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    print(f"{total / 1e6:.0f}M parameters ({model_mb:.0f} MB in bf16) on {name}; codec {args.codec}, lr {args.lr:g}")
    print(
        "| step | changed | bytes | stall / bf16 cast | background publish | decode "
        "| pause / bare scatter / whole copy | replica memory above its weights |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['step']} | {r['changed_pct']:.2f}% | {r['nbytes'] / 1e6:.1f} MB | {r['stall_s'] * 1e3:.1f} / {r['cast_s'] * 1e3:.1f} ms "
            f"| {r['publish_s']:.2f} s | {r['decode_s']:.3f} s | {r['pause_s'] * 1e3:.1f} / {r['scatter_s'] * 1e3:.1f} / {r['copy_s'] * 1e3:.1f} ms "
            f"| {r['replica_mem'] / 1e6:.0f} MB |"
        )
    print("\nThe publish's stages, each alone on the same two bf16 states:\n")
    print("| step | compare | extract positions | copy to host | to host | encode | write | sum / background publish |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = r["stages"]
        total = sum(st[k] for k in STAGES)
        print(
            f"| {r['step']} | " + " | ".join(f"{st[k] * 1e3:.1f} ms" for k in STAGES[:3])
            + f" | {st['host_bytes'] / 1e6:.1f} MB | " + " | ".join(f"{st[k] * 1e3:.1f} ms" for k in STAGES[3:])
            + f" | {total:.2f} / {r['publish_s']:.2f} s |"
        )


#: The stages of a delta publish :func:`publish_stages` times, in order.
STAGES = ("compare_s", "positions_s", "to_host_s", "encode_s", "write_s")


def publish_stages(
    published: dict[str, torch.Tensor], current: dict[str, torch.Tensor], device: torch.device, codec: str,
    scratch: Bucket,
) -> dict[str, float]:
    """Each stage of publishing ``current`` as a delta against ``published`` (bf16 states on ``device``), timed
    alone: the three device stages of change detection over every chunk, then encode and write.

    Returns:
        Seconds per stage (:data:`STAGES`) and ``host_bytes``, the bytes that crossed to the host.
    """
    from rlsync.detect import DEFAULT_CHUNK_ELEMENTS
    from rlsync.device_changes import compare, copy_to_host, extract_positions
    from rlsync.dtypes import int_view
    from rlsync.delta_format import Change, encode_delta

    times = dict.fromkeys(STAGES, 0.0)
    changes, host_bytes = {}, 0
    for name, base in published.items():
        old_all, new_all = int_view(base), int_view(current[name])
        parts = []
        for start in range(0, old_all.numel(), DEFAULT_CHUNK_ELEMENTS):
            old, new = old_all[start : start + DEFAULT_CHUNK_ELEMENTS], new_all[start : start + DEFAULT_CHUNK_ELEMENTS]
            out: dict[str, tuple] = {}
            times["compare_s"] += timed(lambda: out.update(mask=compare(old, new)), device)
            times["positions_s"] += timed(lambda: out.update(found=extract_positions(out["mask"], old, new)), device)
            times["to_host_s"] += timed(lambda: out.update(host=copy_to_host(*out["found"])), device)
            host_bytes += sum(t.numel() * t.element_size() for t in out["found"])
            idx, old_bits, new_bits = out["host"]
            parts.append((idx + start, old_bits, new_bits))
        if sum(p[0].size for p in parts):
            index, old_bits, new_bits = (np.concatenate([p[i] for p in parts]) for i in range(3))
            changes[name] = Change(index, old_bits, new_bits, base.dtype, tuple(base.shape), base=base)
    total = sum(t.numel() for t in published.values())
    t0 = time.perf_counter()
    data = encode_delta(changes, step=1, base_step=0, base_hash="0" * 32, state_hash="0" * 32, total=total, codec=codec)
    times["encode_s"] = time.perf_counter() - t0
    times["write_s"] = timed(lambda: scratch.put("stages/delta.safetensors", data), device)
    return {**times, "host_bytes": host_bytes}


def measure(
    args: argparse.Namespace, device: torch.device, config: dict, bucket: Bucket, scratch: Bucket
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Publish ``args.steps`` steps to ``bucket`` and follow them with a device replica, timing each stage of
    a publish alone into ``scratch``; the figures per step and the replica's weights."""
    from rlsync.hashing import state_hash
    from rlsync.protocol import FixedInterval, Publisher, Subscriber
    from rlsync.protocol.background import BackgroundPublisher

    g = torch.Generator(device=device).manual_seed(0)
    master = {
        n: (torch.randn(s, generator=g, device=device) * 0.02 if len(s) > 1 else torch.ones(s, device=device))
        for n, s in qwen3_shapes(config).items()
    }  # fmt: skip
    total = sum(t.numel() for t in master.values())
    publisher = BackgroundPublisher(Publisher(bucket, codec=args.codec, policy=FixedInterval(1000)))
    cast_buffer = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in master.items()}
    publisher.stage(master.items())
    publisher.flush()
    weights = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in master.items()}  # a serving engine's, on the device
    replica = Subscriber(bucket, device=device, weights=weights)
    replica.apply(replica.fetch())  # version 0, the anchor
    rows = []
    for step in range(1, args.steps + 1):
        for t in master.values():
            t.add_(torch.randint(0, 2, t.shape, generator=g, device=device).mul_(2).sub_(1), alpha=args.lr)
        cast_s = timed(lambda: [cast_buffer[n].copy_(t) for n, t in master.items()], device)
        stages = publish_stages(publisher.publisher.detector.published, cast_buffer, device, args.codec, scratch)
        stall_s = timed(lambda: publisher.stage(master.items()), device)
        publish_s = timed(publisher.flush, device) + stall_s
        base = allocated(device)
        reset_peak(device)
        update = replica.fetch()  # download, decode against the device weights, hash check: off the pause
        assert update is not None and update.kind == "delta", f"step {step}: expected a delta"
        pause_s = timed(lambda: replica.apply(update), device)
        replica_mem = peak_since_reset(device) - base
        scatter_s = timed(lambda: [p.apply_(weights[n]) for n, p in update.patches.items()], device)  # the same values again
        published = publisher.publisher.manifest.state_hash
        assert state_hash(weights) == replica.state_hash == published, f"step {step}: not bit-exact"
        copy_s = timed(lambda: [weights[n].copy_(cast_buffer[n]) for n in weights], device)  # the same bits: stays exact
        rows.append({
            "step": step, "changed_pct": 100 * update.changed / total, "nbytes": update.nbytes, "cast_s": cast_s,
            "stall_s": stall_s, "publish_s": publish_s, "decode_s": update.decode_s, "pause_s": pause_s,
            "scatter_s": scatter_s, "copy_s": copy_s, "replica_mem": replica_mem, "stages": stages,
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    publisher.close()
    return rows, weights


if __name__ == "__main__":
    main()
