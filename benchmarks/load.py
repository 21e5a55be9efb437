"""Load benchmark: one publisher, many replicas, one local bucket.

A publisher writes ``--versions`` versions of a toy model (``--params``
parameters, RL-like updates that flip a few percent of the bf16 weights, an
anchor every ``--anchor-every``) at a fixed cadence, while ``--replicas``
subscriber processes (plain :class:`~rlsync.protocol.Subscriber` loops polling
every 50-100 ms, no model or engine) follow the bucket. Each replica writes its
applied step, the time it applied it and the state hash to a results file and
counts its bucket reads (pointer polls apart from data downloads); at the end it
recomputes the whole-state hash of its tensors, which must equal the newest
published hash (bit-exact).

The run is repeated with 0, 4 and ``--replicas`` replicas (``--phases``) to show
that the publisher's cost does not depend on how many replicas follow: the
publisher never reads anything per replica.

Printed: the distribution (p50/p90/p99/max) of time from publish (the pointer
written) to applied, per replica and over all; bucket reads per replica per
version; the publisher's wall and CPU seconds per publish for each phase, and
their ratio to the phase without replicas.

    python -m benchmarks.load                                  # 16 replicas, 100 versions, ~10M parameters
    python -m benchmarks.load --replicas 8 --versions 50 --params 5e6
    python -m benchmarks.load --json load.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.layout import POINTER_KEY
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from testing.soak.processes import CHILD_TIMEOUT_S, Journal, mp_context, read_journal, wait_for

logger = logging.getLogger("benchmarks.load")
warnings.filterwarnings("ignore", message=r"'benchmarks\.\w+' found in sys\.modules", category=RuntimeWarning)


def make_model(params: float, *, hidden: int = 512, vocab: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights shaped like a small decoder with about ``params`` parameters."""
    g = torch.Generator().manual_seed(seed)
    inter = 3 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    state = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
        "lm_head.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
        "model.norm.weight": 1 + torch.randn(hidden, generator=g) * 0.02,
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden, hidden)),
                            ("self_attn.v_proj.weight", (hidden, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter))]:  # fmt: skip
            state[p + name] = torch.randn(*shape, generator=g) * 0.02
        state[p + "input_layernorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.02
        state[p + "post_attention_layernorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.02
    return state


def train_step(master: dict[str, torch.Tensor], step: int, lr: float) -> None:
    """A sign-SGD-like step of size ``lr`` (random directions): bf16 bits flip where fp32 drift crosses half an ulp."""
    g = torch.Generator().manual_seed(step)
    for t in master.values():
        t.add_(torch.randint(0, 2, t.shape, generator=g, dtype=torch.int8).to(t.dtype).mul_(2).sub_(1), alpha=lr)


class CountingBucket(LocalBucket):
    """A local bucket counting reads: pointer polls apart from data (anchor and delta) downloads."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.pointer_reads = 0
        self.data_reads = 0
        self.data_bytes = 0

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        data = super().get_limited(key, max_bytes)
        if key == POINTER_KEY:
            self.pointer_reads += 1
        else:
            self.data_reads += 1
            self.data_bytes += len(data)
        return data

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        super().get_file_limited(key, path, max_bytes)
        self.data_reads += 1
        self.data_bytes += Path(path).stat().st_size


class TimedBucket(LocalBucket):
    """The publisher's bucket: remembers when each pointer write completed, and counts every operation."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.pointer_written: dict[int, float] = {}
        self.ops = 0
        self._step: int | None = None

    def put(self, key: str, data: bytes) -> None:
        self.ops += 1
        super().put(key, data)
        if key == POINTER_KEY and self._step is not None:
            self.pointer_written[self._step] = time.time()

    def put_file(self, key: str, path: str | Path) -> None:
        self.ops += 1
        super().put_file(key, path)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        self.ops += 1
        return super().get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self.ops += 1
        super().get_file_limited(key, path, max_bytes)

    def list(self, prefix: str = ""):
        self.ops += 1
        return super().list(prefix)

    def delete(self, keys) -> None:
        self.ops += 1
        super().delete(keys)


def replica_loop(cfg: dict[str, Any]) -> None:
    """Follow the bucket until ``cfg["final"]``; journal every apply, then the recomputed whole-state hash."""
    torch.set_num_threads(1)
    os.environ["RLSYNC_THREADS"] = "1"
    logging.basicConfig(filename=cfg["log"], level=logging.WARNING)
    journal = Journal(cfg["journal"])
    bucket = CountingBucket(cfg["root"])
    sub = Subscriber(bucket, workdir=cfg["workdir"])
    rng = random.Random(cfg["seed"])
    journal.write(event="ready", t=time.time())
    deadline = time.time() + cfg["timeout"]
    while time.time() < deadline:
        try:
            update = sub.fetch()
        except Exception as exc:  # refused or unavailable: journaled, retried at the next poll
            journal.write(event="refused", step=sub.step, error=str(exc)[:200])
            update = None
        if update is None:
            if sub.step == cfg["final"]:
                break
            time.sleep(rng.uniform(cfg["poll_min_s"], cfg["poll_max_s"]))
            continue
        sub.apply(update)
        journal.write(event="applied", step=sub.step, kind=update.kind, t=time.time(), hash=sub.state_hash,
                      pointer_reads=bucket.pointer_reads, data_reads=bucket.data_reads, data_bytes=bucket.data_bytes)  # fmt: skip
    journal.write(event="end", step=sub.step, hash=state_hash(sub.state) if sub.state else None, claimed=sub.state_hash,
                  pointer_reads=bucket.pointer_reads, data_reads=bucket.data_reads, data_bytes=bucket.data_bytes)  # fmt: skip


def replica_child(cfg: dict[str, Any]) -> None:
    """Process entry point of :func:`replica_loop`."""
    try:
        replica_loop(cfg)
    except BaseException:
        import traceback

        Path(cfg["log"]).write_text(traceback.format_exc())
        os._exit(1)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max (nearest-rank) of ``values``."""
    if not values:
        return {"n": 0, "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}
    v = sorted(values)

    def pick(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return {"n": len(v), "p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "max": v[-1]}


def run_phase(n_replicas: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One run: a fresh bucket, ``n_replicas`` followers, ``args.versions`` publishes."""
    workdir = Path(tempfile.mkdtemp(prefix=f"load-{n_replicas}-", dir=root))
    bucket = TimedBucket(workdir / "bucket")
    final = args.versions - 1
    procs, journals = [], []
    for i in range(n_replicas):
        (workdir / f"scratch-{i}").mkdir()
        cfg = dict(root=str(bucket.root), final=final, journal=str(workdir / f"r{i}.jsonl"), log=str(workdir / f"r{i}.log"),
                   workdir=str(workdir / f"scratch-{i}"), seed=i, poll_min_s=args.poll_ms[0] / 1e3, poll_max_s=args.poll_ms[1] / 1e3,
                   timeout=args.versions * args.interval_s + CHILD_TIMEOUT_S * 4)  # fmt: skip
        procs.append(mp_context(["benchmarks.load"]).Process(target=replica_child, args=(cfg,), daemon=True))
        journals.append(Path(cfg["journal"]))
    for p in procs:
        p.start()
    deadline = time.time() + CHILD_TIMEOUT_S
    while not all(any(e["event"] == "ready" for e in read_journal(j)) for j in journals):
        if time.time() > deadline:
            raise RuntimeError("replicas did not start")
        time.sleep(0.05)
    master = make_model(args.params, seed=args.seed)
    params = sum(t.numel() for t in master.values())
    pub = Publisher(bucket, policy=FixedInterval(args.anchor_every), keep_anchors=2, owner="load")
    publishes = []
    next_at = time.perf_counter()
    for step in range(args.versions):
        if step:
            train_step(master, step, args.lr)
        now = time.perf_counter()
        if now < next_at:
            time.sleep(next_at - now)
        next_at = max(next_at + args.interval_s, time.perf_counter())
        bucket._step = step
        ops0 = bucket.ops
        w0, c0 = time.perf_counter(), time.process_time()
        rec = pub.publish(step, master)
        publishes.append({"step": step, "kind": rec.kind, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                          "nbytes": rec.nbytes, "changed": rec.changed_fraction, "ops": bucket.ops - ops0, "hash": rec.state_hash})  # fmt: skip
    for p in procs:
        wait_for(p, args.versions * args.interval_s + CHILD_TIMEOUT_S * 4)
    final_hash = pub.manifest.state_hash
    latencies: list[float] = []
    per_replica = []
    exact = 0
    for i, journal in enumerate(journals):
        events = read_journal(journal)
        applied = [e for e in events if e["event"] == "applied"]
        lat = [e["t"] - bucket.pointer_written[e["step"]] for e in applied if e["step"] in bucket.pointer_written]
        wrong = [e["step"] for e in applied if e["hash"] != publishes[e["step"]]["hash"]]
        end = next((e for e in events if e["event"] == "end"), None)
        ok = end is not None and end["step"] == final and end["hash"] == end["claimed"] == final_hash and not wrong
        exact += ok
        latencies += lat
        per_replica.append({
            "replica": i, "applied": len(applied), "bit_exact": ok, "latency": percentiles(lat),
            "pointer_reads_per_version": (end or {}).get("pointer_reads", 0) / args.versions,
            "data_reads_per_version": (end or {}).get("data_reads", 0) / args.versions,
            "mb_per_version": (end or {}).get("data_bytes", 0) / args.versions / 1e6,
            "refused": sum(e["event"] == "refused" for e in events), "log": "" if ok else (Path(str(journal).replace(".jsonl", ".log")).read_text()[-500:] if Path(str(journal).replace(".jsonl", ".log")).exists() else ""),
        })  # fmt: skip
    deltas = [p for p in publishes if p["kind"] == "delta"]
    anchors = [p for p in publishes if p["kind"] == "anchor"]
    summary = {
        "replicas": n_replicas,
        "versions": args.versions,
        "params": params,
        "bit_exact": exact,
        "latency": percentiles(latencies),
        "publish_wall_s": {"median": statistics.median(p["wall_s"] for p in publishes), "delta_median": statistics.median(p["wall_s"] for p in deltas) if deltas else None,
                           "anchor_median": statistics.median(p["wall_s"] for p in anchors) if anchors else None},
        "publish_cpu_s": {"median": statistics.median(p["cpu_s"] for p in publishes), "delta_median": statistics.median(p["cpu_s"] for p in deltas) if deltas else None},
        "publish_ops": {"median": statistics.median(p["ops"] for p in publishes), "max": max(p["ops"] for p in publishes)},
        "delta_mb_median": statistics.median(p["nbytes"] for p in deltas) / 1e6 if deltas else None,
        "anchor_mb": anchors[0]["nbytes"] / 1e6 if anchors else None,
        "changed_pct_median": 100 * statistics.median(p["changed"] for p in deltas) if deltas else None,
        "per_replica": per_replica,
    }  # fmt: skip
    if exact == n_replicas:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        summary["kept"] = str(workdir)
    return summary


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{1e3 * x:.0f}"


def report(phases: list[dict[str, Any]]) -> str:
    lines = []
    base = phases[0]
    p0 = phases[0]
    lines.append(f"model: {p0['params'] / 1e6:.1f}M parameters, anchor {p0['anchor_mb']:.1f} MB, median delta {p0['delta_mb_median'] or 0:.2f} MB "
                 f"({p0['changed_pct_median'] or 0:.1f}% of weights changed per version)")  # fmt: skip
    lines.append("")
    lines.append(
        "publisher, per publish (median)          wall ms  (delta / anchor)   cpu ms  bucket ops   wall vs 0 replicas   cpu vs 0 replicas"
    )
    for ph in phases:
        w, c = ph["publish_wall_s"], ph["publish_cpu_s"]
        lines.append(
            f"  {ph['replicas']:>3} replicas, {ph['versions']} versions {'':<10} {_ms(w['median']):>7}  ({_ms(w['delta_median'])} / {_ms(w['anchor_median'])}) "
            f"{_ms(c['median']):>9} {ph['publish_ops']['median']:>9.0f}   "
            f"{w['median'] / base['publish_wall_s']['median']:>14.2f}x {c['median'] / base['publish_cpu_s']['median']:>18.2f}x"
        )
    for ph in phases:
        if not ph["replicas"]:
            continue
        lines.append("")
        lat = ph["latency"]
        lines.append(f"{ph['replicas']} replicas: publish (pointer written) -> applied, ms over {lat['n']} applies: "
                     f"p50 {_ms(lat['p50'])}  p90 {_ms(lat['p90'])}  p99 {_ms(lat['p99'])}  max {_ms(lat['max'])}; "
                     f"bit-exact at the end: {ph['bit_exact']}/{ph['replicas']}")  # fmt: skip
        lines.append(
            f"  {'replica':>7} {'applied':>7} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6}  {'pointer GETs/version':>20} {'data GETs/version':>17} {'MB/version':>10} {'refused':>7} exact"
        )
        for r in ph["per_replica"]:
            lt = r["latency"]
            lines.append(f"  {r['replica']:>7} {r['applied']:>7} {_ms(lt['p50']):>6} {_ms(lt['p90']):>6} {_ms(lt['p99']):>6} {_ms(lt['max']):>6}  "
                         f"{r['pointer_reads_per_version']:>20.1f} {r['data_reads_per_version']:>17.2f} {r['mb_per_version']:>10.2f} {r['refused']:>7} {'yes' if r['bit_exact'] else 'NO'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--anchor-every", type=int, default=10)
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between publishes (the training step)")
    parser.add_argument("--poll-ms", type=float, nargs=2, default=[50, 100], help="replica poll interval range")
    parser.add_argument("--lr", type=float, default=1e-6, help="size of the simulated update")
    parser.add_argument(
        "--phases", type=int, nargs="+", default=None, help="replica counts to run (default: 0 4 REPLICAS)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    phases_n = args.phases or sorted({0, min(4, args.replicas), args.replicas})
    root = Path(tempfile.mkdtemp(prefix="rlsync-load-"))
    phases = []
    for n in phases_n:
        t0 = time.perf_counter()
        phases.append(run_phase(n, args, root))
        print(f"phase with {n} replicas done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    print(report(phases))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "phases": phases}, indent=1, default=str
            )
        )
    ok = all(ph["bit_exact"] == ph["replicas"] for ph in phases)
    if ok:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    from benchmarks.load import main as _main  # children pickle functions of benchmarks.load, not of __main__

    sys.exit(_main())
