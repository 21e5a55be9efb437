"""Decode speed of a delta at Qwen3-0.6B's shapes, in wall and CPU time (issue 29: a 1% delta in <= 0.5 s).

A bf16 state with the tensor shapes of Qwen3-0.6B (``transformers.Qwen3Config``'s 0.6B dimensions, the
tied head once: 596M elements, 1.19 GB; weights N(0, 0.02), norms 1) takes one AdamW-like step: every
element moves by ``lr * |g|`` (g ~ N(0, 1)) stochastically rounded to whole ulps of its own bf16 value,
so, as with AdamW on a bf16 copy, small weights change far more often than large ones and the tiniest
by several ulps. ``--lr`` sets the share that changes (3e-7: 1.21%, 6.4 MB with classrice). The delta
is encoded once with the codec (``delta_format.encode_delta``, as the publisher does), then
``delta_format.decode_delta`` (the replica's decode, on the library's worker threads) runs ``--repeat``
times against the state; each run prints its wall time and the CPU time of all the process's
threads (``RLSYNC_THREADS`` sets how many decode tensors at once). ``--threads 1 2`` instead times
the encode (``delta_format.encode_delta`` of the decoded changes, as the publisher calls it) and the decode
with thread pools of each size in turn, ``--repeat`` rounds alternating them, and prints each one's
best wall time and its speedup over one thread (the outputs are checked equal, bit for bit).
``--profile`` adds one single-threaded run under cProfile, timed in CPU time.

The state and the delta are cached in ``--cache`` (1.2 GB), so that several library versions can be
timed against the same files, alternating, on a shared machine (``PYTHONPATH`` picking the version;
building them takes a few minutes and 3.3 GB, a decode run 1.8 GB):

    python -m benchmarks.decode_speed --codec classrice --repeat 3
    python -m benchmarks.decode_speed --lr 5e-7 --threads 1 2 --repeat 5
    python -m benchmarks.decode_speed --profile --repeat 0
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import pstats
import resource
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.qwen3 import MODELS, qwen3_shapes
from rlsync.dtypes import bits_to_numpy, int_view

CHUNK = 1 << 22  # elements generated at a time
INIT_STD = 0.02


def ulp_step(old: torch.Tensor, lr: float, g: torch.Generator) -> torch.Tensor:
    """New bits of one chunk of bf16 bits (int16) after an AdamW-like step of size ``lr``."""
    magnitude = (old & 0x7FFF).to(torch.int32)
    exponent = (magnitude >> 7).clamp(min=1).to(torch.float32)
    ulp = torch.exp2(exponent - 127 - 7)
    move = lr * torch.randn(old.shape, generator=g).abs() / ulp
    ulps = torch.floor(move + torch.rand(old.shape, generator=g)).clamp(max=64).to(torch.int32)
    up = torch.rand(old.shape, generator=g) < 0.5
    new_magnitude = torch.where(up, magnitude + ulps, (magnitude - ulps).clamp(min=0)).clamp(max=0x7F7F)
    return ((old.to(torch.int32) & 0x8000) | new_magnitude).to(torch.int16)


def build(cache: Path, lr: float, codec: str, seed: int) -> None:
    """Write the state and the delta of one step into ``cache``."""
    import safetensors.torch

    from rlsync.delta_format import Change, encode_delta

    g = torch.Generator().manual_seed(seed)
    state, changes = {}, {}
    for name, shape in qwen3_shapes(MODELS["qwen3-0.6b"]).items():
        numel = int(np.prod(shape))
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16)
            flat = tensor.view(-1)
            for s in range(0, numel, CHUNK):
                flat[s : s + CHUNK] = torch.randn(min(CHUNK, numel - s), generator=g) * INIT_STD
        state[name] = tensor
        old = tensor.view(-1).view(torch.int16)
        parts = []
        for s in range(0, numel, CHUNK):
            new = ulp_step(old[s : s + CHUNK], lr, g)
            at = torch.nonzero(new != old[s : s + CHUNK]).squeeze(1)
            parts.append((at + s, new[at]))
        index = torch.cat([p[0] for p in parts])
        if index.numel():
            changes[name] = Change(
                index=index.numpy(), old_bits=bits_to_numpy(old[index]),
                new_bits=bits_to_numpy(torch.cat([p[1] for p in parts])),
                dtype=tensor.dtype, shape=tuple(shape), base=tensor,
            )  # fmt: skip
    changed, total = sum(c.index.size for c in changes.values()), sum(t.numel() for t in state.values())
    t0 = time.perf_counter()
    data = encode_delta(changes, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=total, codec=codec)
    print(f"encoded {changed} changed of {total} ({changed / total:.2%}) with {codec}: {len(data) / 1e6:.1f} MB "
          f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(cache / "state.safetensors"))
    (cache / f"delta-{codec}.safetensors").write_bytes(data)


def cpu_seconds() -> float:
    """CPU time of every thread of this process, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def same_delta(a: bytes, b: bytes) -> bool:
    """Whether two delta files hold the same header, metadata and entries (bit for bit; the metadata's key
    order aside)."""
    import safetensors.torch

    from rlsync.format import parse_header

    if parse_header(a) != parse_header(b):
        return False
    entries_a, entries_b = safetensors.torch.load(a), safetensors.torch.load(b)
    return entries_a.keys() == entries_b.keys() and all(torch.equal(entries_a[k], entries_b[k]) for k in entries_a)


def thread_scaling(data: bytes, state: dict[str, torch.Tensor], threads: list[int], repeat: int) -> None:
    """Print the best wall time of encode and decode with pools of each of ``threads`` workers, and the speedup."""
    import rlsync.delta_format as fmt

    delta = fmt.decode_delta(data, state)
    changes = {
        name: fmt.Change(
            index=patch.index.numpy(), old_bits=delta.old_bits[name], new_bits=bits_to_numpy(int_view(patch.values)),
            dtype=state[name].dtype, shape=tuple(state[name].shape), base=state[name],
        )  # fmt: skip
        for name, patch in delta.patches.items()
    }
    meta = dict(step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=delta.total, codec=delta.codec)
    best: dict[tuple[str, int], float] = {}
    for _ in range(max(repeat, 1)):
        for n in threads:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                fmt.worker_pool = lambda pool=pool: pool
                for stage, run in (("encode", lambda: fmt.encode_delta(changes, **meta)), ("decode", lambda: fmt.decode_delta(data, state))):
                    t0 = time.perf_counter()
                    out = run()
                    best[stage, n] = min(best.get((stage, n), float("inf")), time.perf_counter() - t0)
                    if stage == "encode" and not same_delta(out, data):
                        raise AssertionError(f"the encode with {n} threads differs from the file")
    print(f"{delta.changed} changed of {delta.total} ({delta.changed / delta.total:.2%}), best of {max(repeat, 1)}:")
    for stage in ("encode", "decode"):
        one = best[stage, threads[0]]
        print(f"  {stage}: " + ", ".join(f"{n} threads {best[stage, n]:.3f} s ({one / best[stage, n]:.2f}x)" for n in threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/rlsync-decode-speed"))
    parser.add_argument("--codec", default="classrice")
    parser.add_argument("--lr", type=float, default=3e-7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rebuild", action="store_true", help="build the state and the delta again")
    parser.add_argument("--profile", action="store_true", help="one more run, single-threaded, under cProfile")
    parser.add_argument("--threads", type=int, nargs="*", help="time encode and decode with pools of these sizes")
    args = parser.parse_args()

    import safetensors.torch

    import rlsync.delta_format as fmt

    delta_file = args.cache / f"delta-{args.codec}.safetensors"
    if args.rebuild or not delta_file.exists():
        build(args.cache, args.lr, args.codec, args.seed)
    state = safetensors.torch.load_file(str(args.cache / "state.safetensors"))
    data = delta_file.read_bytes()
    fmt.decode_delta(data, state)  # compiles (or loads) the kernels
    if args.threads:
        thread_scaling(data, state, args.threads, args.repeat)
    for _ in range(0 if args.threads else args.repeat):
        wall, cpu = time.perf_counter(), cpu_seconds()
        delta = fmt.decode_delta(data, state)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        size = f"{len(data) / 1e6:.1f} MB, {args.codec}"
        threads = fmt.worker_pool()._max_workers
        print(f"decode {delta.changed} changed ({size}), thread pool of {threads}: {wall:.3f} s wall, {cpu:.3f} s CPU")
    if args.profile:
        serial = type("Serial", (), {"map": staticmethod(lambda f, xs: list(map(f, xs)))})
        fmt.worker_pool = lambda: serial  # noqa: PLW0108 - one thread, so cProfile sees every call
        profile = cProfile.Profile(time.thread_time)  # CPU time: the machine may be shared
        profile.runcall(fmt.decode_delta, data, state)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
