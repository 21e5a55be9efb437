"""Publish, decode and apply per version at Qwen3-1.7B and Qwen3-4B shapes, in one process within 24 GB.

No model and no optimizer state: the state is the checkpoint's tensors in bf16 (``benchmarks.qwen3``
shapes, tied head once; matrices ~N(0, 0.02), norm weights near 1). Each version is a sparse
AdamW-like update of it: an element changes with a chance proportional to its unit in the last place's
inverse (a step of about the learning rate flips a bf16 weight about that often, so small weights
change most), by one unit in the last place up or down, the chance scaled so that the given share of
all elements changes (``--changed``, percent). The publisher (:class:`~rlsync.protocol.Publisher`,
classrice, a local bucket) holds the only full copy: each version is published with
:meth:`~rlsync.protocol.Publisher.publish_stream`, fed the tensors one at a time as they are updated
(a copy of one tensor at a time), so the memory is one bf16 state plus the changes.

Per version it gives, measured in this run:

- **publish**: the publish (change detection, classrice encode, state hash, write of the delta and the
  pointer to the local bucket), without the update's own work (the time spent in the generator);
- **compare**: the bare compare of the same two bf16 states, numpy ``count_nonzero(a != b)`` over int16
  views, tensor by tensor (as :mod:`benchmarks.sync`): the memory-bound floor of change detection;
- **decode**: the delta read back from the bucket and decoded against the old state
  (:func:`~rlsync.delta_format.decode_delta`, every check of a replica) plus its state-hash update;
- **apply**: the scatter of the decoded values into the state (:func:`rlsync.patch.scatter_`, tensors over the
  worker threads: a CPU replica's pause);
- **bytes** per changed element. Every decoded patch is checked equal to the update, element for element.

The old state the decode reads is the publisher's own copy with the update undone (the update's old
bits written back), and the apply redoes it, so no second copy of the model is needed.

    python -m benchmarks.publish_scale --model qwen3-1.7b
    python -m benchmarks.publish_scale --model qwen3-4b --repeat 1
    RLSYNC_THREADS=1 python -m benchmarks.publish_scale --model qwen3-0.6b   # one thread
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from benchmarks.qwen3 import MODELS, qwen3_shapes
from rlsync.bucket import LocalBucket
from rlsync.dtypes import int_view
from rlsync.delta_format import decode_delta
from rlsync.hashing import changes_lanes
from rlsync.patch import scatter_
from rlsync.protocol import FixedInterval, Publisher
from rlsync.workers import worker_pool

CHUNK = 1 << 22  # elements generated at once
EXPONENT_SHIFT, EXPONENT_MASK = 7, 0xFF  # bf16


class DeltaOnlyBucket(LocalBucket):
    """A local bucket that drops the anchor's files (a sharded copy of the whole state, never read here)."""

    def put_file(self, key: str, path: str | Path) -> None:
        pass


def initial_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The bf16 tensors, one at a time: matrices ~N(0, 0.02), 1-D (norm) weights ~1 + N(0, 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        out = torch.empty(math.prod(shape), dtype=torch.bfloat16)
        scale, shift = (0.05, 1.0) if len(shape) == 1 else (0.02, 0.0)
        for s in range(0, out.numel(), CHUNK):
            part = out[s : s + CHUNK]
            part.copy_(torch.randn(part.numel(), generator=gen).mul_(scale).add_(shift))
        yield name, out.view(shape)


def exponent_histogram(state: dict[str, torch.Tensor]) -> np.ndarray:
    """Elements per bf16 exponent over the whole state."""
    hist = np.zeros(EXPONENT_MASK + 1, np.int64)
    for t in state.values():
        bits = int_view(t).numpy()
        for s in range(0, bits.size, CHUNK):
            hist += np.bincount((bits[s : s + CHUNK] >> EXPONENT_SHIFT) & EXPONENT_MASK, minlength=EXPONENT_MASK + 1)
    return hist


def change_chances(hist: np.ndarray, share: float) -> torch.Tensor:
    """Per exponent, the chance that an element changes: ``min(1, c / 2^exponent)`` with ``c`` such that
    ``share`` of all elements change (bisection on ``log2 c``)."""
    exponents = np.arange(hist.size, dtype=np.float64)
    lo, hi = -300.0, 300.0
    for _ in range(200):
        mid = (lo + hi) / 2
        chance = np.minimum(1.0, np.exp2(mid - exponents))
        lo, hi = (mid, hi) if (hist * chance).sum() / hist.sum() < share else (lo, mid)
    return torch.from_numpy(np.minimum(1.0, np.exp2(lo - exponents))).float()


def update_tensor(tensor: torch.Tensor, chances: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, np.ndarray, ...]:
    """A copy of ``tensor`` with a sparse AdamW-like update; and the changed positions, their old and new bits."""
    bits = int_view(tensor).clone()
    positions, olds, news = [], [], []
    for s in range(0, bits.numel(), CHUNK):
        part = bits[s : s + CHUNK]
        chance = chances[((part >> EXPONENT_SHIFT) & EXPONENT_MASK).long()]
        hit = torch.nonzero(torch.rand(part.numel(), generator=gen) < chance).squeeze(1)
        step = torch.randint(0, 2, (hit.numel(),), generator=gen, dtype=torch.int16) * 2 - 1
        old = part[hit]
        olds.append(old.numpy().copy())
        step[(old & 0x7FFF) == 0] = 1  # a zero goes to the smallest subnormal (one below it is a NaN pattern)
        part[hit] = old + step  # one unit in the last place, up or down (the weights here are far from the largest)
        news.append(part[hit].numpy().copy())
        positions.append(hit.numpy() + s)
    return bits.view(torch.bfloat16).view(tensor.shape), *(np.concatenate(x) for x in (positions, olds, news))


class Clock:
    """Wall and CPU seconds (of every thread of the process) since it started, added up over several spans."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "Clock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def version(publisher: Publisher, step: int, share: float, chances: torch.Tensor, gen: torch.Generator) -> dict:
    """Publish one update of ``share`` of the elements, then decode it against the old state and apply it."""
    state = publisher.detector.published
    assert state is not None
    update: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    aside, compare = Clock(), Clock()

    def updated() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in state.items():
            with aside:
                new, *update[name] = update_tensor(tensor, chances, gen)
                with compare:  # one thread: numpy's comparison
                    np.count_nonzero(int_view(tensor).numpy() != int_view(new).numpy())
            yield name, new

    with Clock() as publish:
        record = publisher.publish_stream(step, updated())
    for name, (positions, olds, _) in update.items():  # back to the old state (not timed): what a replica holds
        int_view(state[name])[torch.from_numpy(positions)] = torch.from_numpy(olds.view(np.int16))
    data = publisher.bucket.get(record.keys[-1])
    with Clock() as decode:
        delta = decode_delta(data, state)
        changes_lanes({
            n: (2, state[n].numel(), p.index.numpy(), delta.old_bits[n], int_view(p.values).numpy().view(np.uint16))
            for n, p in delta.patches.items()
        })  # fmt: skip
    with Clock() as apply:
        list(worker_pool().map(lambda n: scatter_(state[n], delta.patches[n].index, delta.patches[n].values), list(delta.patches)))
    for name, (positions, _, news) in update.items():  # the decoded patch is the update, element for element
        patch = delta.patches.get(name)
        index = patch.index.numpy() if patch is not None else np.empty(0, np.int64)
        values = int_view(patch.values).numpy().view(np.uint16) if patch is not None else np.empty(0, np.uint16)
        if not (np.array_equal(index, positions) and np.array_equal(values, news.view(np.uint16))):
            raise SystemExit(f"{name}: the decoded patch differs from the update")
    return {
        "step": step, "share": share, "changed": record.changed, "total": record.total, "nbytes": record.nbytes,
        "publish_s": publish.wall - aside.wall, "publish_cpu_s": publish.cpu - aside.cpu,
        "compare_s": compare.wall, "compare_cpu_s": compare.cpu, "decode_s": decode.wall, "decode_cpu_s": decode.cpu,
        "apply_s": apply.wall, "apply_cpu_s": apply.cpu,
    }  # fmt: skip


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel of a publish and a decode, on a small state."""
    with tempfile.TemporaryDirectory(prefix="rlsync-publish-scale-") as tmp:
        publisher = Publisher(DeltaOnlyBucket(tmp), codec="classrice", policy=FixedInterval(1000))
        publisher.publish_stream(0, initial_state({"w": (256, 1024), "n": (1024,)}))
        chances = change_chances(exponent_histogram(publisher.detector.published), 0.01)
        version(publisher, 1, 1.0, chances, torch.Generator().manual_seed(1))


def run_model(model: str, shares: list[float], repeat: int) -> list[dict]:
    """An anchor, then ``repeat`` rounds of one version per share; every version's figures."""
    shapes = qwen3_shapes(MODELS[model])
    with tempfile.TemporaryDirectory(prefix="rlsync-publish-scale-") as tmp:
        publisher = Publisher(DeltaOnlyBucket(tmp), codec="classrice", policy=FixedInterval(1000))
        t0 = time.perf_counter()
        publisher.publish_stream(0, initial_state(shapes))
        print(f"{model}: anchor in {time.perf_counter() - t0:.1f} s", flush=True)
        hist = exponent_histogram(publisher.detector.published)
        chances = {share: change_chances(hist, share / 100) for share in shares}
        gen = torch.Generator().manual_seed(1)
        rows = []
        for _ in range(repeat):
            for share in shares:
                rows.append({"model": model, **version(publisher, publisher.next_step, share, chances[share], gen)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per model and share, the best version's figures (the machine is shared: the least disturbed), and the
    ratios of CPU seconds (every thread's), which another job's load changes less than it changes wall time."""
    out = []
    for key in dict.fromkeys((r["model"], r["share"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["share"]) == key]
        best = min(mine, key=lambda r: r["publish_s"] / r["compare_s"])
        out.append({
            "model": key[0], "share": key[1], "params": best["total"], "changed_pct": 100 * best["changed"] / best["total"],
            "bytes_per_changed": statistics.mean(r["nbytes"] / r["changed"] for r in mine),
            **{k: best[k] for k in ("publish_s", "compare_s", "publish_cpu_s", "compare_cpu_s")},
            "ratio": best["publish_s"] / best["compare_s"], "cpu_ratio": min(r["publish_cpu_s"] / r["compare_cpu_s"] for r in mine),
            **{k: min(r[k] for r in mine) for k in ("decode_s", "decode_cpu_s", "apply_s", "apply_cpu_s")},
        })  # fmt: skip
    return out


def print_table(rows: list[dict]) -> None:
    threads = worker_pool()._max_workers
    print(f"\n{threads} thread(s) (RLSYNC_THREADS), {os.cpu_count()} cores; wall seconds (CPU seconds of every thread)")
    print("| model (params) | changed | B/changed | publish / bare compare | decode | apply | publish, decode, apply per 1B params (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per = 1e9 / r["params"]
        print(
            f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['changed_pct']:.2f}% | {r['bytes_per_changed']:.2f} "
            f"| {r['publish_s']:.2f} s / {r['compare_s']:.2f} s ({r['ratio']:.2f}x); CPU {r['publish_cpu_s']:.2f} s / "
            f"{r['compare_cpu_s']:.2f} s ({r['cpu_ratio']:.2f}x) | {r['decode_s']:.2f} s ({r['decode_cpu_s']:.2f} s) "
            f"| {r['apply_s']:.3f} s ({r['apply_cpu_s']:.3f} s) "
            f"| {r['publish_cpu_s'] * per:.2f} s, {r['decode_cpu_s'] * per:.2f} s, {r['apply_cpu_s'] * per:.3f} s |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--changed", default="1,3", help="percent of the elements each version changes, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="versions per share (the best is reported)")
    parser.add_argument("--json", type=Path, help="write every version's figures here")
    args = parser.parse_args(argv)
    shares = [float(x) for x in args.changed.split(",")]
    warm_up()
    rows = [row for model in args.model.split(",") for row in run_model(model, shares, args.repeat)]
    print_table(summary(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
