"""Checkpoints tied to the chain (issue 26: critical 3 and 9, medium 7, low 4): a planted or
edited checkpoint is skipped for the next older one and counted, retention keeps only pinned
checkpoints, and a restore streams files to disk within the model's own size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch

from rlsync.layout import checkpoint_folder
from rlsync.protocol import Publisher, read_manifest
from rlsync.trl.checkpoint_checks import CheckpointExpectations, weights_hash
from rlsync.trl.checkpoints import MARKER, BucketCheckpoints
from tests.helpers import master_state

LR = 1e-3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


def _save(model: torch.nn.Module, folder, step: int) -> None:
    """A Trainer-format checkpoint of ``model`` after ``step`` AdamW steps with a linear schedule."""
    folder.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 1000)
    for _ in range(step):
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    safetensors.torch.save_file({n: t.contiguous() for n, t in model.state_dict().items()}, folder / "model.safetensors")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


@pytest.fixture
def run(bucket, tmp_path):
    """A publishing chain with genuine checkpoints at steps 2 and 4, pinned in its pointer."""
    pub = Publisher(bucket, owner="t")
    pub.publish(0, master_state())
    store = BucketCheckpoints(bucket, keep=3, chain=pub)
    model = _model()
    for step in (2, 4):
        _save(model, tmp_path / f"ck{step}", step)
        store.upload(tmp_path / f"ck{step}", step, published_version=0)
    return pub, store, model


def _expect(bucket, model) -> CheckpointExpectations:
    manifest = read_manifest(bucket)
    pins = {p.step: p.weights_hash for p in manifest.checkpoints}
    return CheckpointExpectations.for_model(model, pins=pins, published_step=manifest.step, lr=LR)


def test_genuine_checkpoints_are_pinned_and_restored(bucket, tmp_path, run):
    pub, store, model = run
    assert [p.step for p in read_manifest(bucket).checkpoints] == [2, 4]
    step, folder, _ = store.restore(tmp_path / "r", _expect(bucket, model))
    assert step == 4 and store.skipped == 0
    assert weights_hash(folder / "model.safetensors") == read_manifest(bucket).checkpoints[-1].weights_hash


def _edit_file(bucket, step: int, name: str, data: bytes) -> None:
    folder = checkpoint_folder(step)
    bucket.put(f"{folder}/{name}", data)
    marker = json.loads(bucket.get(f"{folder}/{MARKER}"))
    marker["files"][name] = len(data)
    bucket.put(f"{folder}/{MARKER}", json.dumps(marker).encode())


def _edited_torch(bucket, tmp_path, step: int, name: str, edit) -> None:
    path = tmp_path / "edit.pt"
    bucket.get_file(f"{checkpoint_folder(step)}/{name}", path)
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    _edit_file(bucket, step, name, path.read_bytes())


def _edited_weights(bucket, tmp_path, step: int, edit, *, repin: Publisher | None = None) -> None:
    path = tmp_path / "edit.safetensors"
    bucket.get_file(f"{checkpoint_folder(step)}/model.safetensors", path)
    tensors = safetensors.torch.load_file(path)
    edit(tensors)
    safetensors.torch.save_file(tensors, path)
    _edit_file(bucket, step, "model.safetensors", path.read_bytes())
    if repin is not None:  # someone able to write the pointer pinned the edited weights: the other checks still hold
        repin.pin_checkpoint(step, weights_hash(path))


def _lr(state):
    for g in state["param_groups"]:
        g["lr"] = 1e3


def _shape(state):
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)


def _nan(state):
    state["state"][1]["exp_avg_sq"][0] = float("nan")


def _sched_lr(state):
    state["base_lrs"] = [1e3] * len(state["base_lrs"])
    state["_last_lr"] = [1e3] * len(state["_last_lr"])


@pytest.mark.parametrize(
    "damage",
    ["planted-copy", "trainer-state-1e12", "optimizer-lr", "scheduler-lr", "optimizer-shape", "optimizer-nan",
     "weights-x50", "weights-missing-tensor", "weights-shape", "marker-step-float", "ahead-of-pointer"],
)  # fmt: skip
def test_planted_or_edited_newest_checkpoint_is_skipped_for_the_older_one(bucket, tmp_path, run, damage):
    pub, store, model = run
    newest = 4
    if damage == "planted-copy":  # a genuine old checkpoint copied under a huge step
        newest = 999_999_999
        for o in bucket.list(checkpoint_folder(2) + "/"):
            bucket.put(o.key.replace(checkpoint_folder(2), checkpoint_folder(newest)), bucket.get(o.key))
        marker = json.loads(bucket.get(f"{checkpoint_folder(newest)}/{MARKER}"))
        bucket.put(f"{checkpoint_folder(newest)}/{MARKER}", json.dumps(dict(marker, step=newest)).encode())
    elif damage == "trainer-state-1e12":
        _edit_file(bucket, 4, "trainer_state.json", json.dumps({"global_step": 10**12}).encode())
    elif damage == "optimizer-lr":
        _edited_torch(bucket, tmp_path, 4, "optimizer.pt", _lr)
    elif damage == "scheduler-lr":
        _edited_torch(bucket, tmp_path, 4, "scheduler.pt", _sched_lr)
    elif damage == "optimizer-shape":
        _edited_torch(bucket, tmp_path, 4, "optimizer.pt", _shape)
    elif damage == "optimizer-nan":
        _edited_torch(bucket, tmp_path, 4, "optimizer.pt", _nan)
    elif damage == "weights-x50":
        _edited_weights(bucket, tmp_path, 4, lambda t: t.update({n: v * 50 for n, v in t.items()}))
    elif damage == "weights-missing-tensor":
        _edited_weights(bucket, tmp_path, 4, lambda t: t.pop("1.bias"), repin=pub)
    elif damage == "weights-shape":
        _edited_weights(bucket, tmp_path, 4, lambda t: t.update({"1.bias": torch.zeros(3)}), repin=pub)
    elif damage == "marker-step-float":
        key = f"{checkpoint_folder(4)}/{MARKER}"
        bucket.put(key, json.dumps(dict(json.loads(bucket.get(key)), step=4.0)).encode())
    elif damage == "ahead-of-pointer":
        key = f"{checkpoint_folder(4)}/{MARKER}"
        bucket.put(key, json.dumps(dict(json.loads(bucket.get(key)), published_version=10**12)).encode())
    assert store.steps()[-1] == newest
    step, folder, _ = store.restore(tmp_path / "r", _expect(bucket, model))
    assert step == (4 if damage == "planted-copy" else 2) and store.skipped == 1


def test_retention_deletes_a_planted_checkpoint_and_keeps_the_genuine_ones(bucket, tmp_path, run):
    pub, store, model = run
    for o in bucket.list(checkpoint_folder(2) + "/"):
        bucket.put(o.key.replace(checkpoint_folder(2), checkpoint_folder(999_999_999)), bucket.get(o.key))
    key = f"{checkpoint_folder(999_999_999)}/{MARKER}"
    bucket.put(key, json.dumps(dict(json.loads(bucket.get(key)), step=999_999_999)).encode())
    store.keep = 2
    _save(model, tmp_path / "ck6", 6)
    store.upload(tmp_path / "ck6", 6, published_version=0)
    assert store.steps() == [4, 6]
    assert store.restore(tmp_path / "r", _expect(bucket, model))[0] == 6


RSS_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from rlsync.bucket import LocalBucket
    from rlsync.trl.checkpoints import BucketCheckpoints
    bucket = LocalBucket(sys.argv[1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = BucketCheckpoints(bucket)
    try:
        store.download(8, sys.argv[2])
    except Exception as exc:
        print("refused:", exc, file=sys.stderr)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"grown_kib": grown, "downloaded": Path(sys.argv[2], "checkpoint-8", "optimizer.pt").exists()}))
    """
)


def test_a_large_planted_file_streams_to_disk_and_the_model_size_bounds_it(bucket, tmp_path, run):
    """Duration ~3 s: a 256 MiB planted optimizer file."""
    pub, store, model = run
    size = 256 << 20
    folder = bucket.root / checkpoint_folder(8)
    folder.mkdir(parents=True)
    with open(folder / "optimizer.pt", "wb") as f:
        f.truncate(size)
    (folder / MARKER).write_text(json.dumps({"step": 8, "files": {"optimizer.pt": size}}))
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(bucket.root), str(tmp_path / "probe")],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ},
    )  # fmt: skip
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["downloaded"] or "does not load" in out.stderr, out.stderr
    assert figures["grown_kib"] < 64 * 1024, figures  # streamed: far below the file's 256 MiB
    # with the model's expectations, such a file is refused from the marker alone, before any download
    reads = []
    original = bucket.get_file_limited
    bucket.get_file_limited = lambda *a, **k: reads.append(a[0]) or original(*a, **k)
    expect = _expect(bucket, model)
    assert expect.max_file_bytes() < size
    assert store.restore(tmp_path / "r", expect)[0] == 4 and store.skipped == 1
    assert not any("0000000008" in k for k in reads)
