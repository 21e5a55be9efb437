"""Trainer-format checkpoints in the bucket (rlsync.trl.checkpoints): upload marker last,
retention, and hostile or incomplete checkpoints skipped for the next older one."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import safetensors.torch
import torch

from rlsync.errors import CheckpointError
from rlsync.layout import checkpoint_folder
from rlsync.trl.checkpoints import MARKER, BucketCheckpoints


def trainer_folder(tmp_path, step: int):
    folder = tmp_path / f"local-{step}"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.full((4,), float(step))}, folder / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.ones(4) * step}}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "training_args.bin").write_bytes(b"not uploaded")
    return folder


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_upload_restore_and_retention(bucket, tmp_path):
    store = BucketCheckpoints(bucket, keep=2)
    for step in (2, 4, 6):
        store.upload(trainer_folder(tmp_path, step), step, published_version=step + 1)
    assert store.steps() == [4, 6]  # retention
    assert not bucket.exists(f"{checkpoint_folder(6)}/training_args.bin")
    step, folder, marker = store.restore(tmp_path / "restore")
    assert step == 6 and marker["published_version"] == 7
    assert torch.equal(torch.load(folder / "optimizer.pt", weights_only=True)["state"][0]["exp_avg"], torch.ones(4) * 6)
    # a checkpoint cut short before its marker is never resumed from
    bucket.put(f"{checkpoint_folder(8)}/optimizer.pt", b"partial")
    assert store.restore(tmp_path / "r2")[0] == 6


@pytest.mark.parametrize("damage", ["truncated", "pickle", "marker-path", "marker-json", "missing", "too-large"])
def test_hostile_newest_checkpoint_falls_back_to_the_older_one(bucket, tmp_path, damage):
    store = BucketCheckpoints(bucket, keep=3, max_file_bytes=1 << 20)
    for step in (2, 4):
        store.upload(trainer_folder(tmp_path, step), step)
    folder, marker_key = checkpoint_folder(4), f"{checkpoint_folder(4)}/{MARKER}"
    marker = json.loads(bucket.get(marker_key))
    if damage == "truncated":
        bucket.put(f"{folder}/optimizer.pt", bucket.get(f"{folder}/optimizer.pt")[:-10])
    elif damage == "pickle":  # a code-running pickle with the size the marker claims
        data = pickle.dumps(Evil())
        bucket.put(f"{folder}/optimizer.pt", data)
        marker["files"]["optimizer.pt"] = len(data)
        bucket.put(marker_key, json.dumps(marker).encode())
    elif damage == "marker-path":
        marker["files"]["../../escape"] = 3
        bucket.put(marker_key, json.dumps(marker).encode())
    elif damage == "marker-json":
        bucket.put(marker_key, b"{" * 50_000)
    elif damage == "missing":
        bucket.delete([f"{folder}/scheduler.pt"])
    elif damage == "too-large":
        marker["files"]["optimizer.pt"] = 1 << 40
        bucket.put(marker_key, json.dumps(marker).encode())
    with pytest.raises(CheckpointError):
        store.download(4, tmp_path / "direct")
    step, restored, _ = store.restore(tmp_path / "restore")
    assert step == 2 and json.loads((restored / "trainer_state.json").read_text())["global_step"] == 2
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()
