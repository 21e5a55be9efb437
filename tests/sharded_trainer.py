"""A tiny FSDP2 trainer on gloo (CPU) that publishes sharded, for tests/library/test_sharded.py.

Runs in processes started by :func:`spawn_ranks`; rank 0 writes a JSON
report (per step: kind, hash, the single-process reference's hash; per rank:
shadow bytes and peak RSS) into the results folder.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlsync.bucket import LocalBucket
from rlsync.errors import BucketError, SyncError
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher
from rlsync.protocol.sharded import ShardedPublisher
from rlsync.protocol.sharded_background import ShardedBackgroundPublisher, publish_group
from rlsync.protocol import read_manifest
from testing.soak.processes import mp_context

#: What every rank imports before it runs: preloaded once in the forkserver instead of once per rank.
RANK_IMPORTS = ("transformers.models.qwen3.modeling_qwen3", __name__)


def spawn_ranks(world: int, *args) -> None:
    """Run :func:`run` on ``world`` ranks (``run(rank, world, *args)``) and wait for them.

    The ranks are forked from the session's forkserver (:func:`testing.soak.processes.mp_context`),
    which has imported torch and the library, and this module and transformers' Qwen3 too when it is
    started here: a rank starts without importing them again (a spawned one took about 4 s of CPU).

    Raises:
        torch.multiprocessing.ProcessExitedException: A rank died (exit code or signal).
        torch.multiprocessing.ProcessRaisedException: A rank raised.
    """
    mp_context(RANK_IMPORTS)
    torch.multiprocessing.start_processes(run, args=(world, *args), nprocs=world, start_method="forkserver")


class DyingBucket(LocalBucket):
    """A local bucket whose process dies (as if killed) when it is about to upload ``die_on``,
    whose first upload of a key containing each of ``fail_once_on`` fails, and whose uploads
    each take ``delay_s`` longer."""

    def __init__(self, root, die_on: str = "", fail_once_on: tuple[str, ...] = (), delay_s: float = 0.0) -> None:
        super().__init__(root)
        self.die_on, self.fail_once_on, self.delay_s = die_on, list(fail_once_on), delay_s

    def _maybe_die(self, key: str) -> None:
        time.sleep(self.delay_s)
        if self.die_on and self.die_on in key:
            os._exit(9)
        for part in self.fail_once_on:
            if part in key:
                self.fail_once_on.remove(part)
                raise BucketError(f"injected upload failure of {key}")

    def put(self, key, data):
        self._maybe_die(key)
        return super().put(key, data)

    def put_file(self, key, path):
        self._maybe_die(key)
        return super().put_file(key, path)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def build_sharded_model(world: int):
    """The tiny Qwen3 model, seeded, every layer and the root wrapped with ``fully_shard`` on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    from rlsync.spaces.tiny_model import tiny_model_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_model_config()).to(torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(rank: int, world: int, port: int, bucket_dir: str, results: str, steps: list[int], options: dict) -> None:
    """One trainer rank: train, publish every step sharded, and (if asked) the gathered state single-process."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    model = build_sharded_model(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    faulty = rank == options.get("fault_rank", -1)
    bucket = DyingBucket(bucket_dir, options.get("die_on", "") if faulty else "", tuple(options.get("fail_once_on", ())) if faulty else (),
                         options.get("delay_s", 0.0) if faulty else 0.0)  # fmt: skip
    group = publish_group(options.get("group_timeout_s", 60)) if options.get("background") else None
    publisher = ShardedPublisher(bucket, policy=FixedInterval(options.get("anchor_every", 3)), owner="trainer", group=group)
    if options.get("resume"):
        publisher.resume()
    if options.get("background"):
        if faulty and options.get("worker_raises_at"):  # this rank's worker fails alone, joining no round
            publisher.publish = _raising_at(publisher.publish, options["worker_raises_at"])
        return run_background(rank, world, model, optimizer, publisher, len(steps), results, options)
    reference = Publisher(LocalBucket(options["reference"]), policy=FixedInterval(options.get("anchor_every", 3))) if options.get("reference") and rank == 0 else None
    report = {"steps": []}
    for step in steps:
        train_step(model, optimizer)
        poisoned = step == options.get("poison_step") and rank == options.get("fault_rank", -1)
        if poisoned:  # one rank's weights turn NaN: every rank must refuse to publish
            with torch.no_grad():
                next(iter(model.parameters())).to_local().view(-1)[:8] = float("nan")
        try:
            record = publisher.publish(step, model.state_dict())
        except (SyncError, BucketError) as exc:  # every rank gets the error of a failed publish; retry once
            report["steps"].append({"step": step, "failed": type(exc).__name__, "message": str(exc)})
            if step == options.get("poison_step"):
                break
            record = publisher.publish(step, model.state_dict())
        full = {n: t.full_tensor() for n, t in model.state_dict().items()}  # test only: the reference needs the whole state
        entry = {"step": step, "kind": record.kind, "hash": record.state_hash, "files": len(record.keys),
                 "full_hash": state_hash({n: t.to(torch.bfloat16) for n, t in full.items()})}  # fmt: skip
        if reference is not None:
            ref = reference.publish(step, full)
            entry.update(reference_kind=ref.kind, reference_hash=ref.state_hash)
        report["steps"].append(entry)
    shadow = sum(t.numel() * t.element_size() for t in (publisher.detector.published or {}).values())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"shadow_bytes": shadow, "peak_rss": peak_rss_bytes()})
    report["ranks"] = per_rank
    report["model_bytes"] = sum(t.numel() * 2 for t in model.state_dict().values())
    if rank == 0:
        Path(results).write_text(json.dumps(report))
    dist.destroy_process_group()


def train_step(model, optimizer) -> None:
    """One AdamW step of the tiny model on its fixed batch."""
    batch = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _raising_at(publish, call: int):
    """``publish``, raising (before any collective) at its ``call``-th call (from 1)."""
    calls = []

    def wrapped(step, state):
        calls.append(step)
        if len(calls) == call:
            raise SyncError(f"injected worker failure at version {step}")
        return publish(step, state)

    return wrapped


def run_background(rank, world, model, optimizer, publisher, stages, results, options) -> None:
    """Train ``stages`` steps, staging each into a :class:`ShardedBackgroundPublisher`, then flush
    (``pause_at``: ``[stage, seconds]``, a step that long before that stage; ``stop_on_failure``).

    Rank 0's report: per stage, the version (or the failure, with the bucket's version then) and the
    hash of the gathered bf16 state staged; per rank, the records, ``coalesced``, ``errors`` and failures.
    """
    background = ShardedBackgroundPublisher(publisher, timeout_s=60)
    stages_report, records, failures = [], [], []
    pause_at, pause_s = options.get("pause_at", (-1, 0))
    for index in range(stages):
        train_step(model, optimizer)
        if index == pause_at:  # a long step: the workers are idle by the sync
            time.sleep(pause_s)
        full = {n: t.full_tensor().to(torch.bfloat16) for n, t in model.state_dict().items()}  # test only
        try:
            version, done = background.stage(model.state_dict())
        except (SyncError, BucketError) as exc:  # on every rank alike
            failures.append([index, type(exc).__name__])
            stages_report.append({"failed": type(exc).__name__, "bucket_step": read_manifest(publisher.bucket).step})
            if options.get("stop_on_failure"):
                break
            continue
        records += done
        stages_report.append({"version": version, "hash": state_hash(full), "stall_s": background.stall_s})
    try:
        records += background.close()
    except (SyncError, BucketError) as exc:
        failures.append([stages, type(exc).__name__])
    per_rank = [None] * world
    mine = {"records": [[r.step, r.kind, r.state_hash] for r in records], "coalesced": background.coalesced,
            "errors": background.errors, "failures": failures}  # fmt: skip
    dist.all_gather_object(per_rank, mine)
    final = {n: t.full_tensor().to(torch.bfloat16) for n, t in model.state_dict().items()}
    if rank == 0:
        Path(results).write_text(json.dumps({"stages": stages_report, "ranks": per_rank, "final_hash": state_hash(final)}))
    dist.destroy_process_group()
