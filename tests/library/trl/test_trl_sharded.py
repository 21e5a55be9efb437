"""A sharded TRL run: ``AsyncGRPOTrainer`` with FSDP2 (accelerate) on 2 gloo ranks, launched with torchrun.

Every rank publishes its own shards through :class:`rlsync.trl.ShardedWeightTransfer`;
no rank gathers a parameter during a sync; the chain equals, version for version, the
one TRL's gathering iterator into :class:`rlsync.trl.BucketWeightTransfer` writes for the
same weights; a replica ends bit-identical to the trained weights; a restarted run resumes
from its torch.distributed.checkpoint checkpoint in the bucket. About 30-60 s per run
(each rank imports torch, transformers and TRL).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlsync.bucket import LocalBucket
from rlsync.errors import CheckpointError
from rlsync.protocol import Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket
from rlsync.trl import BucketCheckpoints
from rlsync.trl.sharded_checkpoints import read_dcp_metadata, restore_sharded
from testing.soak.kinds.sharded_checkpoints import RunsCode, fallback_to_rank_local, rank_local, save_sharded

ROOT = Path(__file__).resolve().parents[3]


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


def test_two_rank_fsdp2_trl_run_publishes_sharded_without_gathering_and_resumes_from_its_dcp_checkpoint(tmp_path):
    bucket, reference = tmp_path / "bucket", tmp_path / "reference"
    report = run_ranks(
        2, bucket=str(bucket), reference=str(reference), out=str(tmp_path / "out"), report=str(tmp_path / "r.json"),
        max_steps=3, weight_sync_steps=2, save_steps=3,
    )  # fmt: skip
    assert report["global_step"] == 3 and report["sharded_params"][0] == report["sharded_params"][1] > 0  # FSDP2: DTensors
    # train begin, step 2, and the final publish of step 3 (off the sync grid): versions 0, 1, 2 on every rank,
    # published in the background (version 1 may coalesce into 2 while the anchor is in flight)
    records = report["records"]
    assert records[0][:2] == [0, "anchor"] and all(r[1] == "delta" for r in records[1:]) and records[-1][0] == 2
    assert len(records) + report["coalesced"] == 3
    assert all(rank["records"] == records for rank in report["ranks"])
    assert [r[3] for r in records] == [3] + [2] * (len(records) - 1)  # an anchor: 2 owner files + index; a delta: a part per rank
    # no rank gathered anything while syncing; the counter does count TRL's gathering iterator
    assert all(rank["gathers"] == [0, 0, 0] for rank in report["ranks"])
    assert report["reference_gathers"] and all(n >= 2 * report["sharded_params"][0] for n in report["reference_gathers"])
    # each version equals the gathered single-process path's for the same weights, hash for hash
    assert all(report["reference"][step][1] == digest for step, _, digest, _ in records)
    if not report["coalesced"]:  # kind for kind too
        assert [[r[1], r[2]] for r in records] == report["reference"]
    sharded = LocalBucket(bucket)
    manifest = read_manifest(sharded)
    assert manifest.step == 2 and verify_bucket(sharded).ok, verify_bucket(sharded).errors
    reference_deltas = {d.step: d.state_hash for d in read_manifest(LocalBucket(reference)).deltas}
    assert manifest.deltas and all(reference_deltas[d.step] == d.state_hash for d in manifest.deltas)
    a, b = Subscriber(sharded), Subscriber(LocalBucket(reference))
    a.sync(), b.sync()
    assert a.state_hash == b.state_hash == report["final_hash"] == manifest.state_hash
    assert all(torch.equal(a.state[n].view(torch.int16), b.state[n].view(torch.int16)) for n in b.state)
    # the checkpoint of step 3 is torch.distributed.checkpoint's: one shard file per rank, no gathered weights
    names = BucketCheckpoints(sharded).marker(3)["files"]
    assert {"pytorch_model_fsdp_0..__0_0.distcp", "pytorch_model_fsdp_0..__1_0.distcp", "pytorch_model_fsdp_0...metadata",
            "optimizer_0..__0_0.distcp", "optimizer_0..__1_0.distcp", "optimizer_0...metadata"} <= names.keys()  # fmt: skip
    assert not any(n.endswith((".safetensors", ".bin")) for n in names)

    # restarted (a fresh output folder): resumes at step 3 from the bucket with the fp32 weights and the
    # optimizer state bit-equal, and versions continue after the bucket's newest (an anchor first)
    resumed = run_ranks(
        2, bucket=str(bucket), reference=str(tmp_path / "reference2"), out=str(tmp_path / "out2"),
        report=str(tmp_path / "r2.json"), max_steps=5, weight_sync_steps=2, resume=True,
    )  # fmt: skip
    assert resumed["resumed_from"] == 3 and resumed["global_step"] == 5
    assert resumed["fp32_hashes"][0] == report["final_fp32_hash"]
    assert [rank["optimizer_begin"] for rank in resumed["ranks"]] == [rank["optimizer_end"] for rank in report["ranks"]]
    assert resumed["records"][0][:2] == [3, "anchor"] and resumed["records"][-1][0] == 5
    assert len(resumed["records"]) + resumed["coalesced"] == 3
    assert resumed["records"][0][2] == manifest.state_hash and resumed["gathers"] == [0, 0, 0]
    assert all(resumed["reference"][step - 3][1] == digest for step, _, digest, _ in resumed["records"])
    a.sync()
    assert a.step == 5 and a.state_hash == resumed["final_hash"] and verify_bucket(sharded).ok



def test_a_sharded_checkpoint_that_is_planted_edited_or_would_run_code_is_skipped_counted_and_never_runs_it(tmp_path, bucket, caplog):
    import pickle

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rlsync.protocol import Publisher

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        chain = Publisher(bucket)
        chain.publish(0, {"w": torch.zeros(6, dtype=torch.bfloat16)})
        checkpoints = BucketCheckpoints(bucket, keep=8, chain=chain)
        ran = tmp_path / "ran"
        good = save_sharded(checkpoints, tmp_path, 1)
        # written (and so pinned) by the chain's own writer: the checks of what DCP unpickles still hold
        save_sharded(checkpoints, tmp_path, 2, tamper=fallback_to_rank_local(ran))
        save_sharded(checkpoints, tmp_path, 3, extra=RunsCode(ran))  # a non-tensor entry: torch.load(weights_only=False)
        save_sharded(checkpoints, tmp_path, 4, tamper=rank_local(ran))
        save_sharded(checkpoints, tmp_path, 5)
        key = "checkpoints/0000000005/optimizer_0..__0_0.distcp"  # edited after its pin, size unchanged
        data = bytearray(bucket.get(key))
        data[-1] ^= 1
        bucket.put(key, bytes(data))
        save_sharded(BucketCheckpoints(bucket, keep=8), tmp_path, 9999999999, tamper=fallback_to_rank_local(ran))  # planted
        assert checkpoints.steps() == [1, 2, 3, 4, 5, 9999999999]
        restored = BucketCheckpoints(bucket)
        step, folder = restore_sharded(restored, tmp_path / "restore")
        assert step == 1 and not ran.exists() and restored.skipped == 5
        skipped = [r.getMessage() for r in caplog.records if "skipping sharded checkpoint" in r.getMessage()]
        assert len(skipped) == 5
        assert "9999999999 is not pinned" in skipped[0] and not (tmp_path / "restore" / "checkpoint-9999999999").exists()
        assert "do not hash to the hash pinned" in skipped[1]
        assert "files the metadata does not name: ['__0.metadata']" in skipped[2]
        assert "does not load with weights_only" in skipped[3]
        assert "Metadata.storage_meta is str" in skipped[4]
        loaded = {"w": torch.zeros(6), "lr": 0.0}
        dcp.load(loaded, checkpoint_id=str(folder / "optimizer_0"), no_dist=True)  # DCP reads what passed
        assert torch.equal(loaded["w"], good["w"]) and loaded["lr"] == good["lr"]
        assert json.loads((folder / "trainer_state.json").read_text()) == {"global_step": 1}
    finally:
        dist.destroy_process_group()
    path = tmp_path / "m" / ".metadata"
    path.parent.mkdir()
    path.write_bytes(pickle.dumps(RunsCode(ran)))
    with pytest.raises(CheckpointError, match="not a DCP metadata class"):
        read_dcp_metadata(path)
    assert not ran.exists()


def test_send_weights_leaves_the_gathering_iterator_unread_and_a_non_finite_sync_is_refused_on_every_rank(bucket):
    from types import SimpleNamespace

    import torch.distributed as dist

    from rlsync.protocol.sharded import ShardedPublisher
    from rlsync.trl import ShardedWeightTransfer

    def gathering():  # stands for TRL's iterator: reading it would gather
        raise AssertionError("the iterator was read")
        yield

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        refused = []
        transfer = ShardedWeightTransfer(publisher=ShardedPublisher(bucket), on_non_finite=refused.append, background=False)
        with pytest.raises(RuntimeError, match="attach"):
            transfer.send_weights(gathering())
        model = torch.nn.Linear(4, 3)
        trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))
        transfer.attach(trainer)
        transfer.send_weights(gathering())
        assert list(trainer._streaming_iter()) == []  # the other ranks' part: joins the sync, yields nothing
        assert [r.step for r in transfer.records] == [0, 1] and read_manifest(bucket).step == 1
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        transfer.send_weights(gathering())
        assert transfer.non_finite_refused == 1 and len(refused) == 1 and read_manifest(bucket).step == 1
        sub = Subscriber(bucket)
        sub.sync()
        assert torch.isfinite(sub.state["weight"].float()).all()
    finally:
        dist.destroy_process_group()


def test_a_refused_non_finite_sharded_sync_puts_the_published_slices_back_into_the_dtensor_shards(bucket):
    in_own_thread(_refused_sharded_sync_restores_dtensor_shards, bucket)


def in_own_thread(fn, *args) -> None:
    """Run ``fn(*args)`` in a thread that ends with it, and re-raise what it raised.

    DTensor ops cache, per thread, objects that hold the process group. Left in the main thread, that
    cache is destroyed in every child a later test forks from another thread (the env's confined
    scoring): destroying a gloo group there waits for its worker threads, which a forked child does
    not have, and the child hangs.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:  # its thread ends (and its cache goes) at the exit
        pool.submit(fn, *args).result()


def _refused_sharded_sync_restores_dtensor_shards(bucket) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from rlsync.hashing import state_hash
    from rlsync.protocol.sharded import ShardedPublisher
    from rlsync.trl import ShardedWeightTransfer
    from rlsync.trl.guards import restore_weights

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (1,))
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))  # FSDP2's kind
        restored = []

        def restore(exc):  # what BucketSync does on a refusal
            restore_weights(model, transfer.publisher.detector.published, None)
            restored.append(exc)

        transfer = ShardedWeightTransfer(publisher=ShardedPublisher(bucket), on_non_finite=restore, background=False)
        transfer.attach(SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)))
        transfer.sync()
        with torch.no_grad():
            model.weight.to_local()[0, 0] = float("nan")
            model.bias[1] = float("inf")
        transfer.sync()
        assert len(restored) == 1 and read_manifest(bucket).step == 0 and isinstance(model.weight, DTensor)
        sub = Subscriber(bucket)
        sub.sync()
        served = {"weight": model.weight.to_local().detach(), "bias": model.bias.detach()}
        assert state_hash(served) == sub.state_hash == read_manifest(bucket).state_hash  # bit-equal to the published
    finally:
        dist.destroy_process_group()


def test_a_background_sharded_sync_stalls_for_the_cast_and_a_non_finite_one_is_refused_at_the_next_sync(bucket):
    from types import SimpleNamespace

    import torch.distributed as dist

    from rlsync.protocol.sharded import ShardedPublisher
    from rlsync.protocol.sharded_background import publish_group
    from rlsync.trl import FinalWeightSync, ShardedWeightTransfer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="process group of its own"):  # the trainer's group would interleave
            ShardedWeightTransfer(publisher=ShardedPublisher(bucket))
        refused = []
        transfer = ShardedWeightTransfer(publisher=ShardedPublisher(bucket, group=publish_group(30)), on_non_finite=refused.append)
        model = torch.nn.Linear(4, 3)
        trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m), weight_transfer=None)
        transfer.attach(trainer)
        transfer.sync()
        assert transfer.version == 0
        final = FinalWeightSync(trainer, transfer)  # TRL gives the other ranks no transfer: the callback is given it
        final.synced_step = 1
        final.sync(1)
        assert [r.step for r in transfer.records] == [0] and transfer.published_version == 0
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        transfer.sync()  # staged: the worker refuses it
        transfer.flush()
        assert transfer.non_finite_refused == 1 and len(refused) == 1 and read_manifest(bucket).step == 0
        assert transfer.background.errors == 1
    finally:
        transfer.background.close()
        dist.destroy_process_group()


def test_a_checkpoint_whose_upload_fails_on_a_rank_gets_no_marker(tmp_path):
    import torch.distributed as dist

    from rlsync.errors import BucketError

    class FailingBucket(LocalBucket):
        def put_file(self, key, path):
            if key.endswith(".distcp"):
                raise BucketError(f"injected failure of {key}")
            return super().put_file(key, path)

    bucket = FailingBucket(tmp_path / "bucket")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(BucketError, match="rank 0: injected failure"):
            save_sharded(BucketCheckpoints(bucket), tmp_path, 1)
        assert BucketCheckpoints(bucket).steps() == [] and restore_sharded(BucketCheckpoints(bucket), tmp_path / "r") is None
    finally:
        dist.destroy_process_group()
