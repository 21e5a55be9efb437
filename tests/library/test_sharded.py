"""Sharded publish from an FSDP2 trainer: real gloo process groups on CPU, 2 and 4 ranks.

``fully_shard`` runs on CPU with gloo (no DTensor fallback needed). Each test spawns
the trainer of tests/sharded_trainer.py.
"""

from __future__ import annotations

import json
import socket

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.protocol import Subscriber, read_manifest
from rlsync.protocol.verify import verify_bucket
from rlsync.shards import assign_owners, slice_placement

from tests.sharded_trainer import spawn_ranks


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, bucket_dir, results, steps, **options):
    spawn_ranks(world, _port(), str(bucket_dir), str(results), steps, options)
    return json.loads(results.read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_chain_is_bit_identical_to_the_single_process_publisher(tmp_path, world):
    steps = [1, 2, 3, 4, 5]
    report = _spawn(world, tmp_path / "sharded", tmp_path / "r.json", steps, reference=str(tmp_path / "single"))
    kinds = [s["kind"] for s in report["steps"]]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta"]
    for s in report["steps"]:  # hash for hash, and equal to the hash of the gathered bf16 state
        assert s["hash"] == s["reference_hash"] == s["full_hash"] and s["kind"] == s["reference_kind"]
        assert s["files"] == world + (s["kind"] == "anchor")  # an anchor: one file per owner rank + the index
    sharded, single = LocalBucket(tmp_path / "sharded"), LocalBucket(tmp_path / "single")
    manifest = read_manifest(sharded)
    assert [d.state_hash for d in manifest.deltas] == [d.state_hash for d in read_manifest(single).deltas]
    assert all(len(d.files) == world for d in manifest.deltas)
    _check_hugging_face_anchor(sharded, single, tmp_path / "anchor", world, report["model_bytes"])
    assert verify_bucket(sharded).ok, verify_bucket(sharded).errors
    a, b = Subscriber(sharded, max_parallel_downloads=3), Subscriber(single)
    a.sync(), b.sync()
    assert a.state_hash == b.state_hash == manifest.state_hash and state_hash(a.state) == state_hash(b.state)
    assert all(torch.equal(a.state[n].view(torch.int16), b.state[n].view(torch.int16)) for n in a.state)
    # each rank holds the shadow of its own slices only: together exactly one copy of the model
    shadows = [r["shadow_bytes"] for r in report["ranks"]]
    assert sum(shadows) == report["model_bytes"]
    assert max(shadows) <= 1.1 * report["model_bytes"] / world


def test_rank_killed_mid_publish_leaves_the_previous_version_and_a_restarted_group_continues(tmp_path):
    bucket_dir = tmp_path / "bucket"
    with pytest.raises(mp.ProcessExitedException):  # rank 1 dies as it uploads its part of delta 3 (an anchor comes first)
        _spawn(2, bucket_dir, tmp_path / "r1.json", [1, 2, 3], fault_rank=1, die_on="deltas/000000000003")
    bucket = LocalBucket(bucket_dir)
    before = read_manifest(bucket)
    assert before.step == 2 and verify_bucket(bucket).ok
    assert any(o.key.startswith("deltas/000000000003-e0001/") for o in bucket.list("deltas/"))  # rank 0's part landed
    follower = Subscriber(bucket)
    follower.sync()
    assert follower.step == 2 and follower.fetch() is None  # replicas serve step 2, nothing half-written shows
    # restarted; rank 1's first uploads of its anchor file of step 3 and of its part of delta 4 fail:
    # every rank gets an error, the pointer stays, the retry lands
    fail = ["anchors/000000000003", "deltas/000000000004"]
    report = _spawn(2, bucket_dir, tmp_path / "r2.json", [3, 4], resume=True, fault_rank=1, fail_once_on=fail)
    kinds = [s.get("kind", s.get("failed")) for s in report["steps"]]
    assert kinds == ["ShardedPublishError", "anchor", "ShardedPublishError", "delta"]  # resumed: anchor first
    manifest = read_manifest(bucket)
    assert manifest.step == 4 and manifest.state_hash == report["steps"][-1]["full_hash"]
    assert all("-e0002/" in f.key for f in manifest.delta_after(3).files)  # the restarted group's own epoch
    assert verify_bucket(bucket).ok, verify_bucket(bucket).errors
    follower.sync()
    assert follower.step == 4 and state_hash(follower.state) == manifest.state_hash


def test_a_rank_turning_weights_non_finite_stops_every_rank_and_keeps_the_previous_version(tmp_path):
    report = _spawn(2, tmp_path / "bucket", tmp_path / "r.json", [1, 2, 3], fault_rank=1, poison_step=3)
    assert [s.get("kind", s.get("failed")) for s in report["steps"]] == ["anchor", "delta", "NonFiniteError"]
    assert "NaN or Inf" in report["steps"][-1]["message"]
    bucket = LocalBucket(tmp_path / "bucket")
    assert read_manifest(bucket).step == 2 and verify_bucket(bucket).ok
    assert not any(o.key.startswith("deltas/000000000003") for o in bucket.list("deltas/"))  # nothing uploaded


def _check_hugging_face_anchor(sharded, single, folder, world, model_bytes):
    """The sharded anchor is a Hugging Face sharded checkpoint of whole tensors, equal to the single-process one."""
    newest = read_manifest(sharded).newest_anchor
    names = [f.key.rsplit("/", 1)[-1] for f in newest.files]
    assert names == [f"model-{k:05d}-of-{world:05d}.safetensors" for k in range(1, world + 1)] + ["model.safetensors.index.json"]
    (folder / "single").mkdir(parents=True)
    files = []
    for entry in newest.files:
        files.append(folder / entry.key.rsplit("/", 1)[-1])
        sharded.get_file(entry.key, files[-1])
    index = json.loads(files[-1].read_text())
    reference = {}
    for entry in read_manifest(single).newest_anchor.files:
        path = folder / "single" / entry.key.rsplit("/", 1)[-1]
        single.get_file(entry.key, path)
        if path.suffix == ".safetensors":
            reference.update(safetensors.torch.load_file(path))
            reference_metadata = safe_open(path, "pt").metadata()
    seen = {}
    for path in files[:-1]:  # plain safetensors: whole tensors under Hugging Face names, the anchor metadata
        tensors = safetensors.torch.load_file(path)
        assert safe_open(path, "pt").metadata() == reference_metadata == {k: v for k, v in index["metadata"].items() if k != "total_size"}
        assert all(index["weight_map"][n] == path.name for n in tensors) and not seen.keys() & tensors.keys()
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= model_bytes / world + max(
            t.numel() * t.element_size() for t in reference.values())  # owners balanced by bytes
        seen.update(tensors)
    assert seen.keys() == reference.keys() == index["weight_map"].keys()
    assert all(seen[n].shape == reference[n].shape and torch.equal(seen[n].view(torch.int16), reference[n].view(torch.int16)) for n in seen)
    assert index["metadata"]["total_size"] == sum(p.stat().st_size for p in files[:-1])


def test_owners_are_balanced_and_slices_must_cover_each_tensor_exactly_once():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10, "f": 0}
    owners = assign_owners(sizes, 3)
    assert owners == assign_owners(dict(reversed(sizes.items())), 3)  # the same on every rank, whatever the order
    loads = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(3)]
    assert loads == [100, 70, 90] and set(owners) == set(sizes)
    numels = {"w": 70, "v": 5}
    placement = slice_placement([{"w": (21, 29), "v": (0, 5)}, {"w": (0, 21)}, {"w": (50, 20), "v": (5, 0)}], numels)
    assert placement == {"w": [(1, 0, 21), (0, 21, 29), (2, 50, 20)], "v": [(0, 0, 5)]}
    cases = {
        "overlap": [{"w": (0, 21)}, {"w": (20, 50)}, {"v": (0, 5)}],
        "hole": [{"w": (0, 21)}, {"w": (22, 48)}, {"v": (0, 5)}],
        "short": [{"w": (0, 21)}, {"w": (21, 48)}, {"v": (0, 5)}],
        "missing tensor": [{"w": (0, 70)}],
        "unknown tensor": [{"w": (0, 70), "v": (0, 5), "x": (0, 1)}],
    }
    for name, tables in cases.items():
        with pytest.raises(ValueError):
            slice_placement(tables, numels)


def test_delta_parts_that_overlap_are_refused(tmp_path):
    from rlsync.errors import FormatError
    from rlsync.protocol.fetcher import _merge_patches
    from rlsync.patch import TensorPatch

    a = TensorPatch(torch.tensor([1, 5]), torch.ones(2, dtype=torch.bfloat16), (10,))
    b = TensorPatch(torch.tensor([5, 7]), torch.ones(2, dtype=torch.bfloat16), (10,))
    c = TensorPatch(torch.tensor([6, 9]), torch.ones(2, dtype=torch.bfloat16), (10,))
    assert _merge_patches("w", [a, c]).index.tolist() == [1, 5, 6, 9]
    with pytest.raises(FormatError):
        _merge_patches("w", [a, b])
    with pytest.raises(FormatError):
        _merge_patches("w", [c, a])


def test_a_sharded_publishers_process_group_is_destroyed_at_exit_before_the_interpreter_tears_down(tmp_path):
    """Issue 33: a rank of the sharded TRL test aborted under load ("terminate called without an active
    exception", SIGABRT): its gloo group was alive when the interpreter tore down. An exit handler
    registered before the publisher (so run after the publisher's) finds the group destroyed."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = textwrap.dedent(f"""
        import atexit
        import torch.distributed as dist
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
        from rlsync.bucket import LocalBucket
        from rlsync.protocol.sharded import ShardedPublisher
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ShardedPublisher(LocalBucket({str(tmp_path / "bucket")!r}))
    """)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{root / 'shared'}:{root}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialized at exit: False" in proc.stdout
