"""Sharded publish from an FSDP2 trainer: real gloo process groups on CPU, 2 and 4 ranks.

``fully_shard`` runs on CPU with gloo (no DTensor fallback needed). Each test spawns
the trainer of tests/sharded_trainer.py.
"""

from __future__ import annotations

import json
import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from shared.bucket import LocalBucket
from shared.hashing import merge_records, raw_bytes, slice_record, state_hash, tensor_digest
from shared.protocol import Subscriber, read_manifest
from shared.protocol.verify import verify_bucket

from tests.sharded_trainer import run


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, bucket_dir, results, steps, **options):
    mp.spawn(run, args=(world, _port(), str(bucket_dir), str(results), steps, options), nprocs=world)
    return json.loads(results.read_text())


@pytest.mark.parametrize("numel", [0, 1, 8191, 8193, 40_000, 300_001])
def test_tree_hash_is_the_same_however_the_tensor_is_sliced(numel):
    rng = random.Random(numel)
    tensor = torch.randn(numel).to(torch.bfloat16)
    full = tensor_digest(tensor)
    data = raw_bytes(tensor)
    for _ in range(15):
        cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 8)))
        bounds = [0, *cuts, len(data)]
        records = [slice_record(data[a:b], a, len(data)) for a, b in zip(bounds, bounds[1:])]
        rng.shuffle(records)
        assert merge_records(records, tensor.dtype, (numel,)) == full
        assert all(len(p) <= 16 * 1024 for r in records for _, p in r.pieces)  # only partial leaves move
    if numel > 1:
        flipped = tensor.clone()
        flipped.view(torch.int16)[numel // 2] ^= 1
        assert tensor_digest(flipped) != full
        half = len(data) // 2
        with pytest.raises(ValueError):  # a missing slice is refused, not hashed as something else
            merge_records([slice_record(data[:half], 0, len(data))], tensor.dtype, (numel,))


def test_format_version_1_keeps_its_flat_hash():
    tensor = torch.arange(10_000, dtype=torch.float32).to(torch.bfloat16)
    assert tensor_digest(tensor, version=1) != tensor_digest(tensor)
    assert state_hash({"w": tensor}, version=1) != state_hash({"w": tensor})


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_chain_is_bit_identical_to_the_single_process_publisher(tmp_path, world):
    steps = [1, 2, 3, 4, 5]
    report = _spawn(world, tmp_path / "sharded", tmp_path / "r.json", steps, reference=str(tmp_path / "single"))
    kinds = [s["kind"] for s in report["steps"]]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta"]
    for s in report["steps"]:  # hash for hash, and equal to the hash of the gathered bf16 state
        assert s["hash"] == s["reference_hash"] == s["full_hash"] and s["kind"] == s["reference_kind"]
        assert s["files"] == world
    sharded, single = LocalBucket(tmp_path / "sharded"), LocalBucket(tmp_path / "single")
    manifest = read_manifest(sharded)
    assert [d.state_hash for d in manifest.deltas] == [d.state_hash for d in read_manifest(single).deltas]
    assert all(len(d.files) == world for d in manifest.deltas) and len(manifest.newest_anchor.files) == world
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
    # restarted; rank 1's first upload of delta 4 fails: every rank gets an error, the pointer stays, the retry lands
    report = _spawn(2, bucket_dir, tmp_path / "r2.json", [3, 4], resume=True, fault_rank=1, fail_once_on="deltas/000000000004")
    assert [s.get("kind", s.get("failed")) for s in report["steps"]] == ["anchor", "ShardedPublishError", "delta"]  # resumed: anchor first
    manifest = read_manifest(bucket)
    assert manifest.step == 4 and manifest.state_hash == report["steps"][-1]["full_hash"]
    assert all("-e0002/" in f.key for f in manifest.delta_after(3).files)  # the restarted group's own epoch
    assert verify_bucket(bucket).ok, verify_bucket(bucket).errors
    follower.sync()
    assert follower.step == 4 and state_hash(follower.state) == manifest.state_hash


def test_a_rank_turning_weights_non_finite_stops_every_rank_and_keeps_the_previous_version(tmp_path):
    report = _spawn(2, tmp_path / "bucket", tmp_path / "r.json", [1, 2, 3], fault_rank=1, poison_step=3)
    assert [s.get("kind", s.get("failed")) for s in report["steps"]] == ["anchor", "delta", "ShardedPublishError"]
    assert "NaN or Inf" in report["steps"][-1]["message"]
    bucket = LocalBucket(tmp_path / "bucket")
    assert read_manifest(bucket).step == 2 and verify_bucket(bucket).ok
    assert not any(o.key.startswith("deltas/000000000003") for o in bucket.list("deltas/"))  # nothing uploaded


def _parts(tmp_path, tensor, cuts, **overrides):
    """Anchor parts of one tensor cut at ``cuts`` (flat positions)."""
    from shared.anchor_parts import write_anchor_part
    from shared.shards import LocalSlice

    bounds = [0, *cuts, tensor.numel()]
    tmp_path.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        s = LocalSlice(tensor.reshape(-1)[a:b], overrides.get("offsets", {}).get(k, a), overrides.get("shape", tuple(tensor.shape)))
        paths.append(write_anchor_part({"w": s}, tmp_path / f"p{k}.safetensors", step=3, state_hash="h", total=tensor.numel(),
                                       part=overrides.get("parts_index", {}).get(k, k), parts=len(bounds) - 1))  # fmt: skip
    return paths


def test_anchor_parts_assemble_to_full_tensors_and_hostile_parts_are_refused(tmp_path):
    from shared.anchor_parts import load_anchor_files
    from shared.errors import FormatError

    tensor = torch.randn(10, 7).to(torch.bfloat16)
    state, metadata = load_anchor_files(_parts(tmp_path, tensor, [21, 50]))
    assert torch.equal(state["w"].view(torch.int16), tensor.view(torch.int16)) and metadata["step"] == "3"
    assert "slices" not in metadata
    cases = {
        "overlap": dict(offsets={1: 20}),
        "hole": dict(offsets={1: 22}),
        "huge shape": dict(shape=(1 << 40, 7)),  # refused before anything is allocated
        "part numbers": dict(parts_index={0: 1, 1: 0}),
    }
    for name, overrides in cases.items():
        with pytest.raises(FormatError):
            load_anchor_files(_parts(tmp_path / name.replace(" ", "_"), tensor, [21, 50], **overrides))
    with pytest.raises(FormatError):  # a part missing
        load_anchor_files(_parts(tmp_path / "missing", tensor, [21, 50])[:2])


def test_delta_parts_that_overlap_are_refused(tmp_path):
    from shared.errors import FormatError
    from shared.protocol.subscriber import _merge_patches
    from shared.patch import TensorPatch

    a = TensorPatch(torch.tensor([1, 5]), torch.ones(2, dtype=torch.bfloat16), (10,))
    b = TensorPatch(torch.tensor([5, 7]), torch.ones(2, dtype=torch.bfloat16), (10,))
    c = TensorPatch(torch.tensor([6, 9]), torch.ones(2, dtype=torch.bfloat16), (10,))
    assert _merge_patches("w", [a, c]).index.tolist() == [1, 5, 6, 9]
    with pytest.raises(FormatError):
        _merge_patches("w", [a, b])
    with pytest.raises(FormatError):
        _merge_patches("w", [c, a])
