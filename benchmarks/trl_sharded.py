"""TRL weight sync under FSDP2: TRL's gathering iterator into BucketWeightTransfer vs ShardedWeightTransfer.

Each of ``world`` gloo ranks (CPU, one core each) holds FSDP2's layout of an
LLM-shaped model (DTensor ``Shard(0)`` parameters of an ``nn.Module``, built from
the rank's own rows, as tests/../benchmarks/scale.py builds them). Every step
both paths sync the same weights, each into its own bucket, exactly as TRL 1.16's
``AsyncGRPOTrainer._sync_weight_merged`` drives a ``weight_transfer``:

- *gathered*: rank 0 calls ``BucketWeightTransfer.send_weights(trainer._streaming_iter())``
  (TRL's own iterator: ``full_tensor()`` per parameter), the other ranks drain the iterator;
- *sharded*: the same calls after :meth:`ShardedWeightTransfer.attach`, so every rank
  publishes its own shards, within the sync (``background=False``);
- *background*: the same, publishing in the background (the default): the sync is each rank's
  stall, the cast of its shards into a staging buffer and one agreement all-reduce, while the
  ranks' workers publish afterwards (here the benchmark waits for them, ``flush``, before the
  next measurement, so the other paths' figures stay their own). Each step also times the bare
  cast of the rank's shards to bf16 (``cast``), the stall's baseline.

Per rank and step it measures the sync's wall time and the resident memory the sync
adds (``VmHWM`` reset before it; glibc's mmap threshold is fixed so freed tensors
leave the resident set). Step 0 is an anchor, the rest deltas (small random
updates, about 1.5% of bf16 weights change per step). It then projects a 1T-parameter
sync from the per-rank rates measured here (:func:`benchmarks.scale.simulate` for the
sharded path, :func:`benchmarks.scale.gathered_sync_s` for the gathered one).

    python -m benchmarks.trl_sharded --params 250e6 --worlds 1 2 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks.scale import (
    SIM,
    UPDATE_SCALE,
    _peak_rss,
    _reset_peak_rss,
    _rss,
    bytes_per_changed,
    finish_rank,
    gathered_sync_s,
    run_world,
    sharded_state,
    simulate,
)  # fmt: skip
from benchmarks.sync import model_shapes

PATHS = ("gathered", "sharded", "background")


class _Params(torch.nn.Module):
    """An ``nn.Module`` holding the sharded parameters (TRL's iterator walks ``named_parameters``)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for i, tensor in enumerate(state.values()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=True))


def rank_main(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank: sync every step through both paths; rank 0 writes every rank's measurements."""
    os.environ["RLSYNC_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    from rlsync.bucket import LocalBucket
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.protocol.sharded import ShardedPublisher
    from rlsync.protocol.sharded_background import publish_group
    from rlsync.trl import BucketWeightTransfer, ShardedWeightTransfer

    mesh = init_device_mesh("cpu", (world,))
    model = _Params(sharded_state(model_shapes(cfg["params"], hidden=cfg["hidden"]), mesh, rank, world))
    policy = FixedInterval(1000)
    trainers = {p: SimpleNamespace(model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)) for p in PATHS}
    trainers["gathered"]._streaming_iter = AsyncGRPOTrainer._streaming_iter.__get__(trainers["gathered"])
    transfers = {
        "gathered": BucketWeightTransfer(publisher=Publisher(LocalBucket(cfg["bucket"] + "-gathered"), policy=policy), background=False),
        "sharded": ShardedWeightTransfer(publisher=ShardedPublisher(LocalBucket(cfg["bucket"] + "-sharded"), policy=policy), background=False),
        "background": ShardedWeightTransfer(publisher=ShardedPublisher(LocalBucket(cfg["bucket"] + "-background"), policy=policy, group=publish_group())),
    }  # fmt: skip
    for path in ("sharded", "background"):
        transfers[path].attach(trainers[path])
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(cfg["deltas"] + 1):
        if step:
            with torch.no_grad():
                for p in model.parameters():
                    local = p.to_local()
                    local += torch.randn(local.shape, generator=gen) * UPDATE_SCALE
        for path in PATHS:
            dist.barrier()
            before = _rss()
            _reset_peak_rss()
            t0 = time.perf_counter()
            if rank == 0:  # as _sync_weight_merged
                transfers[path].send_weights(trainers[path]._streaming_iter())
            else:
                for _ in trainers[path]._streaming_iter():
                    pass
            elapsed = time.perf_counter() - t0
            rows.append({"step": step, "path": path, "sync_s": elapsed, "peak_added": _peak_rss() - before})
        t0 = time.perf_counter()  # the background publish, done before the next step's measurements (and not in them)
        transfers["background"].flush()
        rows.append({"step": step, "path": "flush", "sync_s": time.perf_counter() - t0})
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            cast = [p.to_local().to(torch.bfloat16) for p in model.parameters()]  # the stall's baseline
        rows.append({"step": step, "path": "cast", "sync_s": time.perf_counter() - t0})
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            for target, p in zip(cast, model.parameters()):
                target.copy_(p.to_local())  # the same cast into buffers already there, as the staging buffer is
        rows.append({"step": step, "path": "cast_into", "sync_s": time.perf_counter() - t0})
        del cast
    hashes = {p: {r.step: r.state_hash for r in t.records} for p, t in transfers.items() if t.records}
    local_bytes = sum(p.to_local().numel() * 2 for p in model.parameters())
    mine = {"rank": rank, "rows": rows, "local_bf16_bytes": local_bytes, "hashes": hashes, "peak_rss": _peak_rss()}
    finish_rank(mine, rank, world, cfg["out"])


def summarize(world: int, ranks: list[dict]) -> list[dict]:
    """Per path: anchor and median delta sync time (slowest rank), peak memory added on rank 0 and on the others."""
    out = []
    model_bytes = sum(r["local_bf16_bytes"] for r in ranks)
    steps = sorted({r["step"] for r in ranks[0]["rows"] if r["step"]})
    for path in PATHS:
        def rows(rank, kind):
            return [r for r in rank["rows"] if r["path"] == path and (r["step"] == 0) == (kind == "anchor")]

        delta_s = statistics.median(max(r["sync_s"] for rank in ranks for r in rank["rows"] if r["path"] == path and r["step"] == s) for s in steps)
        out.append({
            "world": world, "path": path, "model_mb": model_bytes / 1e6,
            "anchor_s": max(r["sync_s"] for rank in ranks for r in rows(rank, "anchor")),
            "delta_s": delta_s,
            "rank0_delta_peak_mb": max(r["peak_added"] for r in rows(ranks[0], "delta")) / 1e6,
            "other_delta_peak_mb": max((r["peak_added"] for rank in ranks[1:] for r in rows(rank, "delta")), default=0) / 1e6,
            "rank0_anchor_peak_mb": rows(ranks[0], "anchor")[0]["peak_added"] / 1e6,
            "rank_bytes_per_s": model_bytes / world / delta_s if path == "sharded" else model_bytes / delta_s,
        })  # fmt: skip
    hashes = ranks[0]["hashes"]
    same = hashes["gathered"] == hashes["sharded"]
    # the background chain: each version it published (some coalesce) is the sharded path's, hash for hash
    same_background = all(hashes["sharded"][step] == h for step, h in hashes["background"].items())
    for row in out:
        row["same_chain"] = same and (row["path"] != "background" or same_background)
    for row in out:
        row["cast_s"], row["cast_into_s"], row["flush_s"] = (
            statistics.median(max(r["sync_s"] for rank in ranks for r in rank["rows"] if r["path"] == what and r["step"] == s) for s in steps)
            for what in ("cast", "cast_into", "flush")
        )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=250e6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--deltas", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # a fixed mmap threshold: freed tensors go back to the OS, so resident memory tracks live memory
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    results = [row for w in args.worlds for row in summarize(w, run_world(w, args.params, args.hidden, args.deltas, target=rank_main))]
    print(f"{'ranks':>5} {'path':>8} {'model MB':>8} {'anchor s':>8} {'delta s':>7} {'rank0 +peak MB':>14} "
          f"{'others +peak MB':>15} {'rank0 anchor +peak MB':>21} {'same chain':>10}")  # fmt: skip
    for r in results:
        print(f"{r['world']:>5} {r['path']:>8} {r['model_mb']:>8.0f} {r['anchor_s']:>8.2f} {r['delta_s']:>7.2f} "
              f"{r['rank0_delta_peak_mb']:>14.1f} {r['other_delta_peak_mb']:>15.1f} {r['rank0_anchor_peak_mb']:>21.1f} {str(r['same_chain']):>10}")  # fmt: skip
    for r in results:
        if r["path"] == "background":
            print(f"{r['world']} ranks: background stall per delta sync {r['delta_s']:.3f} s vs the bare bf16 cast of each rank's "
                  f"shards {r['cast_s']:.3f} s ({r['delta_s'] / r['cast_s']:.2f}x), into buffers already there {r['cast_into_s']:.3f} s "
                  f"({r['delta_s'] / r['cast_into_s']:.2f}x) (slowest rank, median); the publish left to the workers: {r['flush_s']:.2f} s")  # fmt: skip
    # 1T projection from the per-rank rates of the one-rank run (the least shared cores)
    base = min(args.worlds)
    rate = {r["path"]: r["rank_bytes_per_s"] / 1e9 for r in results if r["world"] == base}
    model_bytes = SIM["params"] * 2
    print(f"\n1T projection (bf16, 1% changed, gapzz; per-rank rates of the {base}-rank run here, one CPU core per rank):")
    for row in simulate(rate["sharded"], {0.01: bytes_per_changed(0.01)}):
        if row["layout"] == "gapzz":
            print(f"  sharded, {row['ranks']} ranks: {row['publish_s']:.1f} s per delta sync "
                  f"(each rank: {model_bytes / row['ranks'] / 1e9:.1f} GB at {rate['sharded']:.3f} GB/s)")  # fmt: skip
    gathered = gathered_sync_s(rate["gathered"])
    print(f"  gathered, any number of ranks: {gathered['detect_s']:,.0f} s per delta sync (rank 0 processes all 2 TB at "
          f"{rate['gathered']:.3f} GB/s) + {gathered['gather_s']:,.0f} s to gather 2 TB into rank 0 at {SIM['rank_upload_gbs']} GB/s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rates": rate}, indent=1))


if __name__ == "__main__":
    main()
