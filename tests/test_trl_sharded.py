"""A sharded TRL run: ``AsyncGRPOTrainer`` with FSDP2 (accelerate) on 2 gloo ranks, launched with torchrun.

Every rank publishes its own shards through :class:`rlsync.trl.ShardedWeightTransfer`;
no rank gathers a parameter during a sync; the chain equals, version for version, the
one TRL's gathering iterator into :class:`rlsync.trl.BucketWeightTransfer` writes for the
same weights; a replica ends bit-identical to the trained weights. About 30 s per run
(each rank imports torch, transformers and TRL).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from rlsync.bucket import LocalBucket
from rlsync.protocol import Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, **options) -> dict:
    """Launch tests/trl_sharded_run.py on ``world`` ranks with torchrun; return rank 0's report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1"}  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={_port()}"]
    proc = subprocess.run([*torchrun, str(ROOT / "tests" / "trl_sharded_run.py"), json.dumps(options)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(Path(options["report"]).read_text())


def test_two_rank_fsdp2_trl_run_publishes_sharded_without_gathering_and_a_replica_ends_bit_identical(tmp_path):
    bucket, reference = tmp_path / "bucket", tmp_path / "reference"
    report = run_ranks(
        2, bucket=str(bucket), reference=str(reference), out=str(tmp_path / "out"), report=str(tmp_path / "r.json"),
        max_steps=3, weight_sync_steps=2,
    )  # fmt: skip
    assert report["global_step"] == 3 and report["sharded_params"][0] == report["sharded_params"][1] > 0  # FSDP2: DTensors
    # train begin, step 2, and the final publish of step 3 (off the sync grid): versions 0, 1, 2 on every rank
    records = report["records"]
    assert [r[:2] for r in records] == [[0, "anchor"], [1, "delta"], [2, "delta"]]
    assert all(rank["records"] == records for rank in report["ranks"])
    assert [r[3] for r in records] == [3, 2, 2]  # an anchor: 2 owner files + index; a delta: one part per rank
    # no rank gathered anything while syncing; the counter does count TRL's gathering iterator
    assert all(rank["gathers"] == [0, 0, 0] for rank in report["ranks"])
    assert report["reference_gathers"] and all(n >= 2 * report["sharded_params"][0] for n in report["reference_gathers"])
    # the chain equals the gathered single-process path's for the same weights, kind for kind, hash for hash
    assert [[r[1], r[2]] for r in records] == report["reference"]
    sharded = LocalBucket(bucket)
    manifest = read_manifest(sharded)
    assert manifest.step == 2 and verify_bucket(sharded).ok, verify_bucket(sharded).errors
    assert [d.state_hash for d in manifest.deltas] == [d.state_hash for d in read_manifest(LocalBucket(reference)).deltas]
    a, b = Subscriber(sharded), Subscriber(LocalBucket(reference))
    a.sync(), b.sync()
    assert a.state_hash == b.state_hash == report["final_hash"] == manifest.state_hash
    assert all(torch.equal(a.state[n].view(torch.int16), b.state[n].view(torch.int16)) for n in b.state)
