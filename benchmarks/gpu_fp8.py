"""The FP8 chain on a GPU: same bits as on CPU, and what it costs the trainer there (torch only).

For a lent device; nothing here needs vLLM. On weights shaped like the scale benchmark's 0.6B model
(bf16, on the GPU), it checks and measures:

* the GPU quantization (:func:`rlsync.fp8.quantize_block`) gives the CPU's bits for every tensor:
  the FP8 chain's state hash does not depend on where the trainer quantized;
* the quantization time of the whole model on the GPU, and its peak extra GPU memory;
* an FP8 version's change detection against the previous one (``ChangeDetector`` on the GPU), as
  the trainer's second chain does every publish;
* where ``torch._scaled_mm`` has block scales, nothing: vLLM's own kernels serve the chain, and this
  script prints the device name and capability for the record.

    python -m benchmarks.gpu_fp8 [--params 0.6e9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.sync import model_shapes
from rlsync.detect import ChangeDetector
from rlsync.fp8 import quantize_block, quantize_state
from rlsync.hashing import state_hash

UPDATE_SCALE = 4e-7  # the scale benchmark's per-step update


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=0.6e9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script is for a lent GPU (the CPU figures are benchmarks.fp8's)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    state = {
        n: (torch.randn(s, generator=gen, device=dev) * 0.02 + (1.0 if len(s) == 1 else 0.0)).to(torch.bfloat16)
        for n, s in model_shapes(args.params).items()
    }
    mismatched = []
    for name, w in state.items():  # GPU bits == CPU bits, tensor by tensor
        if w.dim() != 2 or not name.endswith("_proj.weight"):
            continue
        gq, gs = quantize_block(w)
        cq, cs = quantize_block(w.cpu())
        if not (torch.equal(gq.cpu().view(torch.uint8), cq.view(torch.uint8)) and torch.equal(gs.cpu(), cs)):
            mismatched.append(name)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    first = quantize_state(state)
    torch.cuda.synchronize()
    quantize_s = time.perf_counter() - t0
    peak_extra = torch.cuda.max_memory_allocated() - base
    detector = ChangeDetector(dtype=None)
    detector.reset(first)
    for t in state.values():
        t.add_((torch.randn(t.shape, generator=gen, device=dev) * UPDATE_SCALE).to(t.dtype))
    t1 = time.perf_counter()
    second = quantize_state(state)
    changes = detector.diff(second)
    torch.cuda.synchronize()
    detect_s = time.perf_counter() - t1
    changed = sum(c.index.size for c in changes.values())
    total = sum(t.numel() for t in second.values())
    result = {
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "params": sum(t.numel() for t in state.values()),
        "gpu_bits_equal_cpu": not mismatched, "mismatched": mismatched[:5],
        "quantize_s": quantize_s, "quantize_peak_extra_mb": peak_extra / 2**20,
        "fp8_state_mb": sum(t.numel() * t.element_size() for t in first.values()) / 2**20,
        "next_version_quantize_and_detect_s": detect_s, "fp8_changed_pct": 100 * changed / total,
        "hash_gpu": state_hash(second)[:16],
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
