"""Sync on the device the weights live on: detection, encode, decode and in-place apply, Qwen3-0.6B shape.

Needs torch (with CUDA for the real run) and this repository's light dependencies
(numpy, safetensors, zstandard, transformers); no vLLM, no Hub, no download: the
model has Qwen3-0.6B's configuration and seeded random weights (matrices
~N(0, 0.02), norms near 1), and AdamW steps on random gradients at an RL learning
rate make the deltas. Everything runs on ``--device``: fp32 master weights and the
published bf16 shadow stay there, change detection compares on the device, the
``classgap``/``classrice`` class order is sorted there, and only the changed elements (positions,
old and new bits, ranks) cross to the host, where zstd compresses them. The
replica side decodes on the host (its class order again built on the device from
the replica's own weights) and scatters into the device tensors in place. It prints:

* detection + encode time per codec against a bare on-device comparison of the same states;
* decode + in-place apply time into the device state against an ``index_copy_`` of the values;
* inference idle per sync in the transformers engine: generation is paused only
  while ``apply_patches`` writes (decoding overlaps generation), against the same
  engine's full ``load_state``;

and checks that the replica's weights hash equal to the publisher's after every apply.

    python -m benchmarks.gpu_sync                                   # CUDA, Qwen3-0.6B shape, < 5 min
    python -m benchmarks.gpu_sync --device cpu --layers 2 --hidden 256 --vocab 4096   # the same logic, small, on CPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.vllm_apply import QWEN3_0_6B, random_qwen3_state, write_model_folder
from rlsync.detect import ChangeDetector
from rlsync.dtypes import int_view
from rlsync.delta_format import decode_delta, encode_delta
from rlsync.hashing import state_hash


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(
    fn: Callable[[], object], device: torch.device, repeat: int, reset: Callable[[], None] | None = None
) -> tuple[float, object]:
    """Best wall time of ``repeat`` calls (device work included); ``reset`` runs untimed before each."""
    best, out = float("inf"), None
    for _ in range(repeat):
        if reset is not None:
            reset()
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def bare_compare(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """The reference: one on-device pass comparing the bits of two bf16 states."""
    counts = [torch.count_nonzero(int_view(old[n]) != int_view(new[n])) for n in old]
    return int(torch.stack(counts).sum())


def adamw_step(params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen, device=p.device)
    opt.step()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    ap.add_argument("--vocab", type=int, default=QWEN3_0_6B["vocab_size"])
    ap.add_argument("--hidden", type=int, default=QWEN3_0_6B["hidden_size"], help="smaller for CPU checks of the logic")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warmup-steps", type=int, default=3, help="AdamW steps before the measured one")
    ap.add_argument("--codecs", nargs="+", default=["gapzz", "classgap", "classrice"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    config = {**QWEN3_0_6B, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
    if args.hidden != QWEN3_0_6B["hidden_size"]:
        heads = max(1, args.hidden // 64)
        config.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_attention_heads=heads)
        config.update(num_key_value_heads=max(1, heads // 2), head_dim=64)

    master = random_qwen3_state(config, seed=0, device=str(device))
    n = sum(t.numel() for t in master.values())
    params = {name: torch.nn.Parameter(t) for name, t in master.items()}
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(args.warmup_steps):
        adamw_step(params, opt, gen)
    detector = ChangeDetector(torch.bfloat16)
    current = {name: p.detach() for name, p in params.items()}
    detector.reset(current)
    old = {name: t.clone() for name, t in detector.published.items()}
    adamw_step(params, opt, gen)
    new = {name: p.detach().to(torch.bfloat16) for name, p in params.items()}
    target = state_hash(new)
    shape = f"{args.layers} layers, hidden {config['hidden_size']}, vocab {args.vocab}"
    print(f"model: Qwen3-0.6B configuration with {shape}: {n / 1e6:.1f}M parameters on {device}")

    compare_s, changed = best_time(lambda: bare_compare(old, new), device, args.repeat)
    print(f"\nlr={args.lr:g}: {100 * changed / n:.3f}% of elements changed; bare on-device comparison {compare_s * 1e3:.1f} ms")
    header = ["B/changed", "detect+encode ms", "vs compare", "decode ms", "apply ms", "index_copy_ ms"]
    widths = [max(len(h), 9) for h in header]
    print(f"{'codec':10s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, widths)))
    replica = {name: t.clone() for name, t in old.items()}
    restore = lambda: [replica[name].copy_(old[name]) for name in old]  # noqa: E731
    last_patches = None
    for codec in args.codecs:
        encode = lambda: encode_delta(  # noqa: E731
            detector.diff(current), step=1, base_step=0, base_hash="", state_hash=target, total=n, codec=codec
        )
        encode_s, data = best_time(encode, device, args.repeat)
        decode_s, delta = best_time(lambda: decode_delta(data, replica), device, args.repeat, reset=restore)
        on_device = {name: (p.index.to(device), p.values.to(device)) for name, p in delta.patches.items()}

        def apply() -> None:
            for name, patch in delta.patches.items():
                patch.apply_(replica[name])

        def index_copy() -> None:
            for name, (index, values) in on_device.items():
                replica[name].view(-1).index_copy_(0, index, values)

        apply_s, _ = best_time(apply, device, args.repeat, reset=restore)
        if state_hash(replica) != target:
            raise AssertionError(f"{codec}: decode + apply is not bit-exact")
        copy_s, _ = best_time(index_copy, device, args.repeat, reset=restore)
        figures = [len(data) / changed, encode_s * 1e3, encode_s / compare_s, decode_s * 1e3, apply_s * 1e3, copy_s * 1e3]
        print(f"{codec:10s} " + " ".join(f"{x:{w}.{3 if i == 0 else 2 if i == 2 else 1}f}" for i, (x, w) in enumerate(zip(figures, widths))))
        last_patches = delta.patches
    engine_idle(config, old, new, last_patches, device, args.repeat)


def engine_idle(config: dict, old: dict, new: dict, patches: dict, device: torch.device, repeat: int) -> None:
    """Idle per sync in the transformers engine: the time ``apply_patches`` holds generation, and a full ``load_state``."""
    from rollout_space.engines.transformers_engine import TransformersEngine

    folder = write_model_folder(Path(tempfile.mkdtemp(prefix="gpu-sync-")) / "model", config, old)
    engine = TransformersEngine(folder, device=device)
    prompt = torch.randint(0, config["vocab_size"], (1, 16), device=device)
    generate_s, _ = best_time(lambda: engine.model.generate(prompt, max_new_tokens=16, do_sample=False), device, 1)
    reset = lambda: engine.load_state(old)  # noqa: E731
    idle_s, _ = best_time(lambda: engine.apply_patches(patches), device, repeat, reset=reset)
    if state_hash(engine.state_dict()) != state_hash(new):
        raise AssertionError("engine weights after apply_patches differ from the publisher's")
    full_s, _ = best_time(lambda: engine.load_state(new), device, repeat)
    print(
        f"\ntransformers engine: generation paused {idle_s * 1e3:.1f} ms per sync (apply_patches; decoding overlaps "
        f"generation), full load_state {full_s * 1e3:.1f} ms; 16 greedy tokens take {generate_s * 1e3:.0f} ms"
    )
    engine.close()


if __name__ == "__main__":
    main()
