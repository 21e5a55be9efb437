"""A fleet on the rate-limited Hub stand-in: requests per event, lag and versions per minute.

    python -m benchmarks.hub_budget --replicas 16 --tier pro --seconds 300 [--no-governor]

One process runs, on the stand-in (:mod:`testing.hub.server`, the tier's real limits per token
in fixed 5-minute windows), all sharing one token as a deployment does:

- a trainer stand-in that nudges the tiny model's fp32 weights and publishes them every
  ``--step-s`` seconds through the real :class:`~rlsync.protocol.Publisher` (anchors and sparse bf16
  deltas); with the governor it publishes every k-th step while its budget is short, as
  :class:`~rlsync.trl.coalesce.PublishCoalescing` does in the TRL trainer;
- the real environment role (:class:`env_space.simulator.EnvSimulator`, reverse task);
- ``--replicas`` real replicas (:class:`rollout_space.replica.Replica`, transformers engine on the
  tiny offline model), each following the bucket through its own watched bucket.

``--no-governor`` turns pacing off (``HUB_PACING=0``) and the trainer publishes every step. It
prints one JSON object: versions per minute, the highest share of each limit used in any window,
429s, the largest replica lag seen, and requests per published version, per replica per rollout
batch (as each role's client counts them: hf_xet's own Xet token requests are not seen there; the
``by_kind`` totals are the stand-in's, which sees them), and per idle minute (the trainer then
stopped and no new task batches for ``--idle-s`` seconds); and the seconds from each publish to each
replica's apply of that version (``apply_delay_s``: median, 90th percentile, largest). The run fails
(exit status 1) on any update a replica refused, or when a replica lagged more than ``--max-lag`` versions
(sampled every 2 s; a replica still loading counts from version 0; ``max_lag_by_minute`` shows when).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import sys
import threading
import time
from pathlib import Path

TOKEN = "hf_budget_bench"
BUCKET = "bench/fleet"


def _max_window(times: list[float], window: float) -> int:
    if not times:
        return 0
    counts: dict[int, int] = {}
    for t in times:
        counts[int((t - times[0]) // window)] = counts.get(int((t - times[0]) // window), 0) + 1
    return max(counts.values())


def _spread(values: list[float]) -> dict[str, float | None]:
    """Median, 90th percentile and largest of ``values`` (``None`` for none)."""
    ordered = sorted(values)
    quantiles = {"median": 0.5, "p90": 0.9, "max": 1.0}
    return {name: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None for name, q in quantiles.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--tier", default="pro")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--step-s", type=float, default=2.0, help="seconds between trainer steps")
    parser.add_argument("--no-governor", action="store_true")
    parser.add_argument("--max-lag", type=int, default=3, help="the largest lag (versions) a passing run may show")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")

    from rlsync.bucket.settings import role_weight
    from rlsync.roles import Role

    os.environ.update({
        "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HUB_TIER": args.tier,
        "HUB_SHARE": str(args.replicas + 1 + math.ceil(role_weight(Role.TRAINER))),
        "HUB_PACING": "0" if args.no_governor else "1",
    })  # fmt: skip
    from huggingface_hub import constants
    from safetensors.torch import load_file

    from env_space.simulator import EnvConfig, EnvSimulator
    from rlsync.bucket import BucketSettings, open_bucket
    from rlsync.bucket.budget import RequestClass, Tier, scaled_limit
    from rlsync.bucket.watch import meter_of, watch
    from rlsync.protocol import FixedInterval, Publisher
    from rlsync.spaces.tiny_model import build_tiny_model
    from rollout_space.replica import Replica, ReplicaConfig
    from testing.hub.server import HubServer

    root = Path(tempfile.mkdtemp(prefix="hub-budget-"))
    server = HubServer(root)
    server.add_token(TOKEN)
    server.create_bucket(BUCKET)
    server.limit(Tier(args.tier))
    os.environ["HF_ENDPOINT"] = server.url
    constants.ENDPOINT, constants.HF_HUB_OFFLINE = server.url, False
    url = f"hf://buckets/{BUCKET}"
    model = build_tiny_model(root / "tiny", seed=0)
    master = {n: t.float() for n, t in load_file(model / "model.safetensors").items()}

    settings = BucketSettings.from_env(Role.TRAINER)  # the HUB_* variables set above
    bucket = watch(open_bucket(url, settings=settings), settings.watch)
    meter = meter_of(bucket)
    publisher = Publisher(bucket, policy=FixedInterval(10))
    env = EnvSimulator(EnvConfig(bucket=url, queue_depth=max(2, args.replicas // 2)))
    replicas = [
        Replica(ReplicaConfig(bucket=url, replica_id=f"r{i}", engine="transformers", model=str(model), device="cpu", seed=i))
        for i in range(args.replicas)
    ]  # fmt: skip
    stop, idle = threading.Event(), threading.Event()
    published: list[float] = []
    coalesced = [0]
    lag = [0]

    def train() -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        step, since_publish = 0, 0
        while not stop.wait(args.step_s) and not idle.is_set():
            for t in master.values():
                t += torch.randn(t.shape, generator=g) * t.abs().mean() * 0.02
            since_publish += 1
            if not args.no_governor and meter.short and since_publish < 8:
                coalesced[0] += 1
                continue
            publisher.publish(step, master)
            published.append(time.time())
            step, since_publish = step + 1, 0

    lag_by_minute: dict[int, int] = {}

    def watch_lag() -> None:
        while not stop.wait(2.0):
            if publisher.step is not None and not idle.is_set():
                now = max(publisher.step - (r.subscriber.step or 0) for r in replicas)
                lag[0] = max(lag[0], now)
                minute = int((time.time() - started) // 60)
                lag_by_minute[minute] = max(lag_by_minute.get(minute, 0), now)

    started = time.time()
    threads = [threading.Thread(target=f, daemon=True) for f in (train, watch_lag)]
    for role in (env, *replicas):
        role.start()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    busy_end = time.time()
    idle.set()
    env.config.queue_depth = 0  # nothing asked for while the trainer is stopped (no new task batches)
    trainer_api = meter.class_totals[RequestClass.API]
    replica_api = sum(r.meter.class_totals[RequestClass.API] for r in replicas)
    batches = sum(len(r.batches.done) for r in replicas)
    time.sleep(10)  # the last version reaches the replicas
    idle_from = time.time()
    time.sleep(args.idle_s)
    idle_to = time.time()
    stop.set()
    for role in (env, *replicas):
        role.stop()

    def api(since: float, until: float) -> int:
        return sum(1 for r in server.usage(RequestClass.API, TOKEN, since) if r.time < until)

    import collections

    from rlsync.bucket.budget import classify

    by_kind = collections.Counter(
        classify(r.method, r.path)[1] for cls in RequestClass for r in server.usage(cls, TOKEN, started) if r.time < busy_end
    )
    busy_api = sum(1 for r in server.usage(RequestClass.API, TOKEN, started) if r.time < busy_end)
    result = {
        "governor": not args.no_governor, "tier": args.tier, "replicas": args.replicas, "seconds": args.seconds,
        "versions": len(published), "versions_per_min": round(60 * len(published) / (busy_end - started), 2),
        "coalesced_steps": coalesced[0], "max_lag": lag[0], "max_lag_allowed": args.max_lag,
        "max_lag_by_minute": [lag_by_minute.get(m, 0) for m in range(int(args.seconds // 60) + 1)],
        "max_api_share_of_limit": round(_max_window([r.time for r in server.usage("api", TOKEN)], 300) / scaled_limit(Tier(args.tier), RequestClass.API, 300), 3),
        "max_resolver_share_of_limit": round(_max_window([r.time for r in server.usage("resolver", TOKEN)], 300) / scaled_limit(Tier(args.tier), RequestClass.RESOLVER, 300), 3),
        "throttled_429": server.throttled(TOKEN),
        "fleet_api_per_min": round(60 * busy_api / (busy_end - started), 1),
        "trainer_api_per_version": round(trainer_api / max(1, len(published)), 2),
        "replica_batches": batches,
        "replica_api_per_batch": round(replica_api / max(1, batches), 2),
        "fleet_api_per_idle_min": round(60 * api(idle_from, idle_to) / (idle_to - idle_from), 2),
        "by_kind": dict(by_kind.most_common()),
        "apply_delay_s": _spread([s.time - published[s.step] for r in replicas for s in r.syncs if s.time and s.step < len(published)]),
        "refused": sum(r.subscriber.stats.refused for r in replicas),
        "refusals": sorted({r.subscriber.stats.last_error for r in replicas if r.subscriber.stats.refused}),
    }  # fmt: skip
    print(json.dumps(result))
    server.close()
    return result


def failures(result: dict) -> list[str]:
    """Why a run failed: any refused update, or a replica lagging more than ``--max-lag`` versions."""
    found = [f"{result['refused']} updates refused: {result['refusals']}"] if result["refused"] else []
    if result["max_lag"] > result["max_lag_allowed"]:
        found.append(f"a replica lagged {result['max_lag']} versions (at most {result['max_lag_allowed']})")
    return found


if __name__ == "__main__":
    failed = failures(main())
    sys.exit("FAILED: " + "; ".join(failed) if failed else 0)
