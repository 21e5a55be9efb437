"""Scale benchmark: sharded publish with 1, 2 and 4 ranks, and a 1T-parameter sync simulated.

Real run: ``world`` processes on gloo (CPU), each holding FSDP2's layout of an
LLM-shaped model (every tensor a DTensor ``Shard(0)``, rows split as
``torch.chunk`` splits them, built from the rank's own rows only, so no process
ever holds the whole model), fp32 master weights, small random updates that
change about 1-2% of the bf16 weights per step. Each rank publishes with
:class:`~rlsync.protocol.sharded.ShardedPublisher`: one anchor, then deltas.
Per rank it measures publish time, the shadow's bytes and the peak resident
memory added by publishing (``VmHWM`` reset before each publish).

Simulation: the per-rank rates measured here (detect + hash + encode, bytes per
changed element of gapzz and of the TRL layout at 1-3% changed, measured on a
synthetic tensor in this run) drive a model of a 1T-parameter trainer and a
fleet of replicas; its assumptions are printed with the table.

    python -m benchmarks.scale                         # ~120M parameters, 1, 2, 4 ranks
    python -m benchmarks.scale --params 40e6 --worlds 1 2 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.sync import init_weights, model_shapes
from rlsync.bucket import LocalBucket
from rlsync.delta_format import Change, encode_delta
from rlsync.protocol import FixedInterval, Publisher
from rlsync.protocol.sharded import ShardedPublisher

logger = logging.getLogger("benchmarks.scale")

UPDATE_SCALE = 4e-7  # std of the per-step fp32 update; about 1-2% of bf16 weights flip


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def sharded_state(shapes: dict[str, tuple[int, ...]], mesh, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's FSDP2-layout parameters (``Shard(0)``), drawn from its own rows only."""
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(1000 + rank)
    state = {}
    for name, shape in shapes.items():
        rows = [len(c) for c in torch.arange(shape[0]).chunk(world)] + [0] * world
        local = init_weights((rows[rank], *shape[1:]), gen)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return state


def rank_main(rank: int, world: int, port: int, cfg: dict) -> None:
    """One rank of the real run; rank 0 writes the per-rank measurements to ``cfg['out']``."""
    os.environ["RLSYNC_THREADS"] = "1"  # one core per rank: per-rank rates
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = sharded_state(model_shapes(cfg["params"], hidden=cfg["hidden"]), mesh, rank, world)
    publisher = ShardedPublisher(LocalBucket(cfg["bucket"]), policy=FixedInterval(1000), owner="scale")
    single = None  # baseline with one rank: the single-process Publisher on the same weights
    if world == 1:
        single = Publisher(LocalBucket(cfg["bucket"] + "-single"), policy=FixedInterval(1000))
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(1, cfg["deltas"] + 2):
        if step > 1:
            for t in state.values():
                local = t.to_local()
                local += torch.randn(local.shape, generator=gen) * UPDATE_SCALE
        dist.barrier()
        before = _rss()
        _reset_peak_rss()
        t0 = time.perf_counter()
        record = publisher.publish(step, state)
        elapsed = time.perf_counter() - t0
        peak_added = _peak_rss() - before
        single_s = None
        if single is not None:
            t1 = time.perf_counter()
            single.publish(step, {n: t.to_local() for n, t in state.items()})
            single_s = time.perf_counter() - t1
        rows.append({
            "step": step, "kind": record.kind, "publish_s": elapsed, "detect_hash_s": record.encode_s + record.hash_s,
            "bytes": record.nbytes, "changed": record.changed, "total": record.total,
            "peak_added": peak_added, "single_publish_s": single_s,
        })  # fmt: skip
    local_bytes = sum(t.to_local().numel() * 2 for t in state.values())
    shadow = sum(t.numel() * t.element_size() for t in (publisher.detector.published or {}).values())
    mine = {"rank": rank, "rows": rows, "local_bf16_bytes": local_bytes, "shadow_bytes": shadow, "peak_rss": _peak_rss()}
    finish_rank(mine, rank, world, cfg["out"])


def finish_rank(mine: dict, rank: int, world: int, out: str) -> None:
    """Gather every rank's measurements to rank 0, which writes them to ``out``; leave the group."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_world(world: int, params: float, hidden: int, deltas: int, target=rank_main) -> list[dict]:
    """Run ``target`` (default: the real benchmark's :func:`rank_main`) on ``world`` ranks; return every rank's measurements."""
    with tempfile.TemporaryDirectory(prefix="rlsync-scale-") as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cfg = {"params": params, "hidden": hidden, "deltas": deltas, "bucket": f"{tmp}/bucket", "out": f"{tmp}/out.json"}
        mp.spawn(target, args=(world, port, cfg), nprocs=world)
        return json.loads(Path(cfg["out"]).read_text())


def summarize(world: int, ranks: list[dict]) -> dict:
    """Per-world figures: the slowest rank's median delta publish, memory per rank."""
    deltas = [[r for r in rank["rows"] if r["kind"] == "delta"] for rank in ranks]
    anchor = max(rank["rows"][0]["publish_s"] for rank in ranks)
    delta_s = statistics.median(max(d[i]["publish_s"] for d in deltas) for i in range(len(deltas[0])))
    detect = statistics.median(r["detect_hash_s"] for d in deltas for r in d)
    last = deltas[0][-1]
    single = [r["single_publish_s"] for r in deltas[0] if r["single_publish_s"] is not None]
    return {
        "world": world,
        "anchor_s": anchor,
        "delta_s": delta_s,
        "rank_detect_hash_s": detect,
        "rank_rate_gbs": statistics.median(rank["local_bf16_bytes"] for rank in ranks) / detect / 1e9,
        "changed_pct": 100 * last["changed"] / last["total"],
        "delta_bytes": last["bytes"],
        "shadow_mb": max(rank["shadow_bytes"] for rank in ranks) / 1e6,
        "peak_added_mb": max(r["peak_added"] for rank in ranks for r in rank["rows"][1:]) / 1e6,
        "anchor_peak_added_mb": max(rank["rows"][0]["peak_added"] for rank in ranks) / 1e6,
        "peak_rss_mb": max(rank["peak_rss"] for rank in ranks) / 1e6,
        "single_delta_s": statistics.median(single) if single else None,
        "model_mb": sum(rank["local_bf16_bytes"] for rank in ranks) / 1e6,
    }


def bytes_per_changed(density: float, numel: int = 1 << 24, seed: int = 0) -> dict[str, float]:
    """Bytes per changed element of gapzz and the TRL layout on one bf16 tensor at ``density``.

    Positions uniformly random, values one unit in the last place up or down (an RL step's typical change).
    """
    rng = np.random.default_rng(seed)
    index = np.sort(rng.choice(numel, size=int(numel * density), replace=False)).astype(np.int64)
    old = (rng.standard_normal(index.size).astype(np.float32) * 0.02).view(np.uint32) >> 16
    old = old.astype(np.uint16)
    new = (old + rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=index.size)).astype(np.uint16)
    change = {"w": Change(index=index, old_bits=old, new_bits=new, dtype=torch.bfloat16, shape=(numel,))}
    out = {}
    for codec in ("gapzz", "trl"):
        data = encode_delta(change, step=1, base_step=0, base_hash="0" * 64, state_hash="0" * 64, total=numel, codec=codec)
        out[codec] = len(data) / index.size
    return out


# -- the 1T simulation --------------------------------------------------------

SIM = {
    "params": 1e12,
    "trainer_ranks": (512, 1024),
    "rank_upload_gbs": 1.25,  # 10 Gbit/s per trainer rank to the bucket
    "bucket_ingress_gbs": 200.0,
    "bucket_egress_gbs": 200.0,  # aggregate read bandwidth of the bucket (S3-class, many prefixes)
    "replica_download_gbs": 1.25,  # 10 Gbit/s per replica
    "replicas": (100, 1000),
    "pointer_round_s": 0.5,  # gather of part records + pointer write + fence check
}


def simulate(rate_gbs: float, bpc: dict[float, dict[str, float]], sim: dict = SIM) -> list[dict]:
    """Publish and catch-up times of a 1T-parameter bf16 model from measured per-rank rates."""
    model_bytes = sim["params"] * 2
    rows = []
    for density, sizes in sorted(bpc.items()):
        changed = sim["params"] * density
        for layout in ("trl", "gapzz"):
            delta = changed * sizes[layout]
            for ranks in sim["trainer_ranks"]:
                detect = model_bytes / ranks / (rate_gbs * 1e9)
                upload = max(delta / ranks / (sim["rank_upload_gbs"] * 1e9), delta / (sim["bucket_ingress_gbs"] * 1e9))
                row = {
                    "changed_pct": 100 * density, "layout": layout, "delta_gib": delta / 2**30, "ranks": ranks,
                    "part_mib": delta / ranks / 2**20, "publish_s": detect + upload + sim["pointer_round_s"],
                }  # fmt: skip
                for replicas in sim["replicas"]:
                    per_replica = min(sim["replica_download_gbs"], sim["bucket_egress_gbs"] / replicas)
                    row[f"catchup_{replicas}_s"] = delta / (per_replica * 1e9)
                rows.append(row)
    return rows


def gathered_sync_s(rate_gbs: float, sim: dict = SIM) -> dict[str, float]:
    """A 1T delta sync through TRL's gathering iterator: every parameter is all-gathered and rank 0
    detects, hashes and encodes the whole model at its one-rank rate, whatever the number of ranks.

    Returns:
        ``detect_s`` (rank 0's processing) and ``gather_s`` (the whole model into rank 0 at ``rank_upload_gbs``).
    """
    model_bytes = sim["params"] * 2
    return {"detect_s": model_bytes / (rate_gbs * 1e9), "gather_s": model_bytes / (sim["rank_upload_gbs"] * 1e9)}


def anchor_times(sim: dict = SIM) -> dict[str, float]:
    """Upload of a sharded 1T anchor and one replica's download of it, at the stated bandwidths."""
    model_bytes = sim["params"] * 2
    ranks = max(sim["trainer_ranks"])
    return {
        "ranks": ranks,
        "upload_s": max(model_bytes / ranks / (sim["rank_upload_gbs"] * 1e9), model_bytes / (sim["bucket_ingress_gbs"] * 1e9)),
        "replica_download_s": model_bytes / (sim["replica_download_gbs"] * 1e9),
    }


def print_real(results: list[dict]) -> None:
    print("\nreal run (gloo on CPU, one core per rank; this machine has 2 cores, so 4 ranks share them)")
    print(f"{'ranks':>5} {'model MB':>9} {'% chg':>6} {'delta B':>10} {'anchor s':>9} {'delta s':>8} "
          f"{'rank GB/s':>9} {'shadow MB/rank':>14} {'+peak MB/rank':>13} {'anchor +peak':>12} {'RSS MB/rank':>11}")  # fmt: skip
    for r in results:
        if r["single_delta_s"] is not None:
            print(f"      baseline with 1 rank: the single-process Publisher, same weights, delta publish {r['single_delta_s']:.2f} s")
        print(f"{r['world']:>5} {r['model_mb']:>9.0f} {r['changed_pct']:>6.2f} {r['delta_bytes']:>10,} {r['anchor_s']:>9.2f} "
              f"{r['delta_s']:>8.2f} {r['rank_rate_gbs']:>9.3f} {r['shadow_mb']:>14.1f} {r['peak_added_mb']:>13.1f} "
              f"{r['anchor_peak_added_mb']:>12.1f} {r['peak_rss_mb']:>11.0f}")  # fmt: skip


def print_simulation(rate: float, bpc: dict, rows: list[dict], sim: dict = SIM) -> None:
    print("\n1T-parameter simulation; assumptions:")
    print(f"  model {sim['params']:.0e} parameters, bf16 (2 TB); FSDP2 Shard(0), one delta part per rank per publish")
    print(f"  per-rank detect+hash+encode rate {rate:.3f} GB of bf16 slice per s (measured here, one CPU core; a GPU rank is faster)")
    for d, s in sorted(bpc.items()):
        print(f"  at {100 * d:.0f}% changed: gapzz {s['gapzz']:.3f} B/changed, TRL layout {s['trl']:.3f} B/changed (measured here)")
    print(f"  upload {sim['rank_upload_gbs']} GB/s per rank, bucket ingress {sim['bucket_ingress_gbs']} GB/s and egress "
          f"{sim['bucket_egress_gbs']} GB/s aggregate, {sim['replica_download_gbs']} GB/s per replica, "
          f"pointer round {sim['pointer_round_s']} s; replicas download the whole delta (all parts) concurrently")  # fmt: skip
    reps = sim["replicas"]
    print(f"{'% chg':>5} {'layout':>6} {'delta GiB':>9} {'ranks':>5} {'part MiB/rank':>13} {'publish s':>9} "
          + " ".join(f"{f'catch-up s, {r} repl.':>20}" for r in reps))  # fmt: skip
    for r in rows:
        print(f"{r['changed_pct']:>5.0f} {r['layout']:>6} {r['delta_gib']:>9.1f} {r['ranks']:>5} {r['part_mib']:>13.1f} "
              f"{r['publish_s']:>9.1f} " + " ".join(f"{r[f'catchup_{n}_s']:>20.1f}" for n in reps))  # fmt: skip
    a = anchor_times(sim)
    print(f"files per rank: 1 delta part per delta; at an anchor also one file of the whole tensors it owns (about "
          f"1/ranks of the model, received from the other ranks over the interconnect, not modelled). A sharded anchor "
          f"(2 TB, {a['ranks']} files + index) uploads in {a['upload_s']:.1f} s; one new replica downloads it in "
          f"{a['replica_download_s']:.0f} s at {sim['replica_download_gbs']} GB/s.")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=120e6, help="model size of the real run")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--deltas", type=int, default=3, help="deltas published after the anchor")
    parser.add_argument("--json", type=Path, help="write all figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = [summarize(w, run_world(w, args.params, args.hidden, args.deltas)) for w in args.worlds]
    print_real(results)
    bpc = {d: bytes_per_changed(d) for d in (0.01, 0.02, 0.03)}
    rate = next(r for r in results if r["world"] == min(args.worlds))["rank_rate_gbs"]
    rows = simulate(rate, bpc)
    print_simulation(rate, bpc, rows)
    one = next((r for r in results if r["world"] == 1 and r["single_delta_s"]), None)
    if one is not None:  # TRL's own sync: the whole model gathered into one process (python -m benchmarks.trl_sharded)
        gathered = gathered_sync_s(one["model_mb"] / 1e3 / one["single_delta_s"])
        print(f"gathered path (TRL's iterator: one process detects the whole model at the single-process Publisher's "
              f"rate measured here): {gathered['detect_s']:,.0f} s per 1T delta + {gathered['gather_s']:,.0f} s to gather "
              f"2 TB into rank 0, whatever the number of ranks")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"real": results, "bytes_per_changed": bpc, "simulation": rows, "assumptions": SIM}, indent=1))


if __name__ == "__main__":
    main()
