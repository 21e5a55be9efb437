"""Trial ``checkpoints``: planted and edited training checkpoints (a genuine one copied under a
huge step, a trainer state at step 10^12, lr 1e3, weights x50, NaN moments, a missing tensor,
wrong shapes, a float marker step, a huge file, a code-running pickle). A restore resumes only the
newest genuine checkpoint, counts every one it skips, and retention deletes the planted ones."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch

from rlsync.bucket import LocalBucket
from rlsync.layout import checkpoint_folder
from rlsync.protocol import Publisher, read_manifest
from rlsync.trl.checkpoint_checks import CheckpointExpectations
from rlsync.trl.checkpoints import MARKER, BucketCheckpoints

from ..bystanders import check_bystanders, plant_bystanders
from ..invariants import TrialResult
from ..toy import toy_master

DEFAULT_TRIALS = 12
LR = 1e-3


class _Pwned:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


def _train_and_save(model: torch.nn.Module, opt, sched, folder: Path, step: int) -> None:
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: t.contiguous() for n, t in model.state_dict().items()}, folder / "model.safetensors")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _replace(bucket: LocalBucket, step: int, name: str, data: bytes) -> None:
    folder = checkpoint_folder(step)
    bucket.put(f"{folder}/{name}", data)
    marker = json.loads(bucket.get(f"{folder}/{MARKER}"))
    marker["files"][name] = len(data)
    bucket.put(f"{folder}/{MARKER}", json.dumps(marker).encode())


def _torch_edit(edit: Callable[[dict], None]) -> Callable[[LocalBucket, int, str, Path], None]:
    def apply(bucket: LocalBucket, step: int, name: str, scratch: Path) -> None:
        bucket.get_file(f"{checkpoint_folder(step)}/{name}", scratch)
        state = torch.load(scratch, weights_only=True)
        edit(state)
        torch.save(state, scratch)
        _replace(bucket, step, name, scratch.read_bytes())

    return apply


def _weights_edit(edit: Callable[[dict], None]) -> Callable[[LocalBucket, int, str, Path], None]:
    def apply(bucket: LocalBucket, step: int, name: str, scratch: Path) -> None:
        bucket.get_file(f"{checkpoint_folder(step)}/model.safetensors", scratch)
        tensors = safetensors.torch.load_file(scratch)
        edit(tensors)
        safetensors.torch.save_file(tensors, scratch)
        _replace(bucket, step, "model.safetensors", scratch.read_bytes())

    return apply


def _set_lr(state: dict) -> None:
    for group in state["param_groups"]:
        group["lr"] = 1e3


def _set_sched_lr(state: dict) -> None:
    state["base_lrs"] = [1e3] * len(state["base_lrs"])


def _nan_moment(state: dict) -> None:
    state["state"][0]["exp_avg_sq"].view(-1)[0] = float("nan")


def _wrong_shape(state: dict) -> None:
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)


def _marker(edit: Callable[[dict], None]) -> Callable[[LocalBucket, int, str, Path], None]:
    def apply(bucket: LocalBucket, step: int, name: str, scratch: Path) -> None:
        key = f"{checkpoint_folder(step)}/{MARKER}"
        marker = json.loads(bucket.get(key))
        edit(marker)
        bucket.put(key, json.dumps(marker).encode())

    return apply


def _file(data: Callable[[], bytes]) -> Callable[[LocalBucket, int, str, Path], None]:
    return lambda bucket, step, name, scratch: _replace(bucket, step, name, data())


DAMAGE: dict[str, tuple[str, Callable[[LocalBucket, int, str, Path], None]]] = {
    "trainer-state-1e12": ("trainer_state.json", _file(lambda: json.dumps({"global_step": 10**12}).encode())),
    "optimizer-lr-1e3": ("optimizer.pt", _torch_edit(_set_lr)),
    "scheduler-lr-1e3": ("scheduler.pt", _torch_edit(_set_sched_lr)),
    "optimizer-nan": ("optimizer.pt", _torch_edit(_nan_moment)),
    "optimizer-shape": ("optimizer.pt", _torch_edit(_wrong_shape)),
    "weights-x50": ("model.safetensors", _weights_edit(lambda t: t.update({n: v * 50 for n, v in t.items()}))),
    "weights-missing-tensor": ("model.safetensors", _weights_edit(lambda t: t.pop("1.bias"))),
    "marker-step-float": (MARKER, _marker(lambda m: m.update(step=float(m["step"])))),
    "marker-huge-file": (MARKER, _marker(lambda m: m["files"].update({"optimizer.pt": 6 << 30}))),
    "pickle-runs-code": ("optimizer.pt", _file(lambda: pickle.dumps(_Pwned()))),
    "truncated": ("scheduler.pt", _file(lambda: b"\x80\x02")),
}


def _plant_copy(bucket: LocalBucket, source: int, target: int) -> None:
    """A genuine checkpoint copied under another step (marker edited to match)."""
    for obj in bucket.list(checkpoint_folder(source) + "/"):
        bucket.put(obj.key.replace(checkpoint_folder(source), checkpoint_folder(target)), bucket.get(obj.key))
    key = f"{checkpoint_folder(target)}/{MARKER}"
    bucket.put(key, json.dumps(dict(json.loads(bucket.get(key)), step=target)).encode())


def trial_checkpoints(rng: random.Random, workdir: Path) -> TrialResult:
    """Genuine checkpoints every few steps; before each restore, the newest few are planted or edited."""
    result = TrialResult("checkpoints")
    bucket = LocalBucket(workdir / "bucket")
    before = plant_bystanders(bucket, rng)
    pub = Publisher(bucket, owner="soak")
    pub.publish(0, toy_master(rng.randrange(1000)))
    store = BucketCheckpoints(bucket, keep=3, chain=pub)
    model = _model(rng.randrange(1000))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 10_000)
    hostile: set[int] = set()  # steps planted or edited so far
    for step in range(1, rng.randint(6, 10)):
        _train_and_save(model, opt, sched, workdir / f"ck{step}", step)
        store.upload(workdir / f"ck{step}", step, published_version=0)
        genuine = [s for s in store.steps() if s not in hostile]
        if step < 3 or rng.random() < 0.3:
            continue
        for victim in sorted(rng.sample(genuine[-2:], rng.randint(1, min(2, len(genuine[-2:]))))):
            kind = rng.choice([*DAMAGE, "planted-copy"])
            if kind == "planted-copy":
                target = rng.choice([victim + 10**9, 999_999_999 - victim])
                _plant_copy(bucket, victim, target)
                hostile.add(target)
            else:
                name, damage = DAMAGE[kind]
                damage(bucket, victim, name, workdir / "scratch")
                hostile.add(victim)
            result.faults[f"checkpoint {kind}"] += 1
        manifest = read_manifest(bucket)
        expect = CheckpointExpectations.for_model(
            model, pins={p.step: p.weights_hash for p in manifest.checkpoints}, published_step=manifest.step, lr=LR
        )  # fmt: skip
        retained = store.steps()
        intact = [s for s in retained if s not in hostile]
        expected = intact[-1] if intact else None
        skipped = store.skipped
        restored = store.restore(workdir / "restore", expect)
        result.check((restored[0] if restored else None) == expected, f"restored {restored and restored[0]}, newest genuine {expected}")
        newer = [s for s in retained if expected is None or s > expected]
        result.check(store.skipped - skipped == len(newer), f"skipped {store.skipped - skipped} of {len(newer)} hostile")
    result.check(not (Path.cwd() / "pwned").exists(), "a pickle ran code")
    _train_and_save(model, opt, sched, workdir / "last", 100)
    store.upload(workdir / "last", 100, published_version=0)  # retention: only pinned, genuine checkpoints stay
    planted = [s for s in store.steps() if s > 100]
    result.check(not planted, f"retention kept planted checkpoints {planted}")
    check_bystanders(bucket, before, result)
    return result
