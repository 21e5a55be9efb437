"""GPU check, torch-only half: the sync library on a CUDA GPU, without vLLM.

For machines that have CUDA torch but no vLLM (the GPU machines sometimes lent have no vLLM and
no room to install it; the vLLM half is ``benchmarks.gpu_check``). Builds a model state with
Qwen3-0.6B's configuration and random weights on the GPU (nothing is downloaded), publishes an
anchor and ``--deltas`` AdamW deltas to a local bucket, and follows it with a
:class:`~rlsync.protocol.Subscriber` whose state lives on the GPU: each verified delta is scattered
into the GPU tensors in place and hashed there. Per delta it prints bytes, share of changed
elements, fetch time (download, decode, validate) and apply time (scatter + hash verification on
the GPU), next to the time of copying the whole bf16 state host-to-device (the floor of any full
refit), measured in the same run. It checks after every delta, through ``rlsync.hashing``, that the
GPU state hashes equal to the publisher's.

    python -m benchmarks.gpu_check_torch                 # 5 deltas at lr 1e-6
    python -m benchmarks.gpu_check_torch --deltas 3 --lr 3e-6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.vllm_apply import QWEN3_0_6B, adamw_deltas, random_qwen3_state


def _full_copy_seconds(state: dict[str, torch.Tensor], repeat: int) -> float:
    """Best time of copying the whole state from pinned host memory to the GPU."""
    host = {n: t.to("cpu").pin_memory() for n, t in state.items()}
    dest = {n: torch.empty_like(t, device="cuda") for n, t in host.items()}
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for name, tensor in host.items():
            dest[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deltas", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats of the full copy (best kept)")
    ap.add_argument("--workdir", default=None, help="folder for the bucket (default: a temp folder on disk)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check_torch needs a CUDA GPU")

    from rlsync.bucket import LocalBucket
    from rlsync.hashing import state_hash
    from rlsync.protocol import FixedInterval, Publisher, Subscriber

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-torch-"))
    master = random_qwen3_state(dict(QWEN3_0_6B), seed=0, device="cuda")
    n_params = sum(t.numel() for t in master.values())
    bucket = LocalBucket(work / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(args.deltas + 1))
    records = [pub.publish(0, {n: t.cpu() for n, t in master.items()})]
    for step, state in enumerate(adamw_deltas(master, args.lr, args.deltas, seed=1), start=1):
        records.append(pub.publish(step, state))
    print(f"{torch.cuda.get_device_name()}: Qwen3-0.6B config, {n_params / 1e6:.0f}M parameters; "
          f"built and published in {time.perf_counter() - t_start:.0f} s")  # fmt: skip

    sub = Subscriber(bucket, device="cuda")
    rows = []
    for rec in records:
        t0 = time.perf_counter()
        update = sub.fetch()
        fetch_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sub.apply(update)
        torch.cuda.synchronize()
        apply_s = time.perf_counter() - t0
        on_gpu = all(t.is_cuda for t in sub.state.values())
        ok = on_gpu and state_hash(sub.state) == rec.state_hash
        rows.append((rec.step, update.kind, update.nbytes, 100.0 * update.changed / n_params, fetch_s, apply_s, ok))
    full_copy_s = _full_copy_seconds(sub.state, args.repeat)

    print(f"\n{'step':>4s} {'kind':>6s} {'bytes':>14s} {'changed':>8s} {'fetch s':>8s} {'apply s':>8s} {'hash ok':>7s}")
    for step, kind, nbytes, changed, fetch_s, apply_s, ok in rows:
        print(f"{step:>4d} {kind:>6s} {nbytes:>14,d} {changed:>7.2f}% {fetch_s:>8.3f} {apply_s:>8.3f} {str(ok):>7s}")
    deltas = [r for r in rows if r[1] == "delta"]
    mean_apply = sum(r[5] for r in deltas) / max(1, len(deltas))
    print(f"\nmean delta apply on the GPU (scatter + hash check) {mean_apply:.3f} s; "
          f"whole-state host-to-device copy {full_copy_s:.3f} s -> {mean_apply / full_copy_s:.2f}x of it")  # fmt: skip
    print(f"hashes equal after every update: {all(r[6] for r in rows)}; total {time.perf_counter() - t_start:.0f} s")
    if not all(r[6] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
