"""Trial ``sharded_checkpoints``: sharded (DCP) training checkpoints planted or made hostile at
random among genuine ones: written by the chain's own writer (so pinned) with a global metadata DCP
fails on beside a code-running rank-local ``__0.metadata``, a lone rank-local metadata file, a
code-running non-tensor entry, a metadata field of another type or an unknown file; edited after
their pin; or planted without a pin at a huge step. A restore resumes the newest genuine checkpoint,
counts every one it skips, and no payload ever runs."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlsync.bucket import LocalBucket
from rlsync.layout import checkpoint_folder
from rlsync.protocol import Publisher
from rlsync.trl.checkpoints import BucketCheckpoints
from rlsync.trl.sharded_checkpoints import ShardedCheckpointCallback, restore_sharded

from ..invariants import TrialResult

DEFAULT_TRIALS = 8
PLANTED_STEP = 9_999_999_999


class RunsCode:
    """Pickles as a call that creates ``path`` when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.path)!r}, 'w').close()",))


def save_sharded(checkpoints: BucketCheckpoints, scratch: Path, step: int, extra: Any = None,
                 tamper: Callable[[Path], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Save a small state with DCP as ``optimizer_0/`` (``tamper`` edits that folder), a trainer state
    at ``step``, and upload it (one rank, collective); returns the state."""
    import torch.distributed.checkpoint as dcp

    folder = scratch / f"local-{step}"
    state = {"w": torch.arange(6, dtype=torch.float32) * step, "lr": 1e-3 * step}  # a float: a non-tensor entry
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(folder / "optimizer_0"), no_dist=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if tamper is not None:
        tamper(folder / "optimizer_0")
    ShardedCheckpointCallback(checkpoints).upload(folder, step)
    return state


def _edit_metadata(edit: Callable[[Any], None]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        metadata = pickle.loads((folder / ".metadata").read_bytes())
        edit(metadata)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))

    return tamper


def fallback_to_rank_local(ran: Path) -> Callable[[Path], None]:
    """A global metadata DCP fails on (``storage_meta`` a string): it falls back to ``__0.metadata``, code."""
    edit = _edit_metadata(lambda m: setattr(m, "storage_meta", "a string"))

    def tamper(folder: Path) -> None:
        edit(folder)
        rank_local(ran)(folder)

    return tamper


def rank_local(ran: Path) -> Callable[[Path], None]:
    """A code-running rank-local ``__0.metadata`` beside a genuine global one."""
    return lambda folder: (folder / "__0.metadata").write_bytes(pickle.dumps(RunsCode(ran)))


def _first_tensor(m: Any) -> Any:
    return next(v for v in m.state_dict_metadata.values() if hasattr(v, "chunks"))


FIELDS: dict[str, Callable[[Any], None]] = {
    "version": lambda m: setattr(m, "version", 1),
    "planner_data": lambda m: setattr(m, "planner_data", ["w"]),
    "dtype": lambda m: setattr(_first_tensor(m).properties, "dtype", "float32"),
    "chunks": lambda m: setattr(_first_tensor(m), "chunks", "chunks"),
    "size": lambda m: setattr(_first_tensor(m), "size", [6]),
    "offset": lambda m: setattr(next(iter(m.storage_data.values())), "offset", -1),
    "extra_attribute": lambda m: setattr(m, "load_hook", "x"),
}


def _hostile(kind: str, ran: Path) -> dict[str, Any]:
    """The arguments of :func:`save_sharded` for a hostile checkpoint of ``kind``."""
    if kind == "fallback":
        return {"tamper": fallback_to_rank_local(ran)}
    if kind == "rank-local":
        return {"tamper": rank_local(ran)}
    if kind == "code-entry":
        return {"extra": RunsCode(ran)}
    if kind == "unknown-file":
        return {"tamper": lambda folder: (folder / "notes.bin").write_bytes(pickle.dumps(RunsCode(ran)))}
    return {"tamper": _edit_metadata(FIELDS[kind.removeprefix("field-")])}


KINDS = ["fallback", "rank-local", "code-entry", "unknown-file", *(f"field-{f}" for f in FIELDS), "edited", "planted"]


def trial_sharded_checkpoints(rng: random.Random, workdir: Path) -> TrialResult:
    """Genuine and hostile sharded checkpoints at random, then one restore."""
    result = TrialResult("sharded_checkpoints")
    bucket = LocalBucket(workdir / "bucket")
    ran = workdir / "ran"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        chain = Publisher(bucket)
        chain.publish(0, {"w": torch.zeros(6, dtype=torch.bfloat16)})
        checkpoints = BucketCheckpoints(bucket, keep=16, chain=chain)
        genuine: list[int] = []
        hostile: list[int] = []
        for step in range(1, rng.randint(4, 10) + 1):
            kind = "genuine" if rng.random() < 0.4 else rng.choice(KINDS[:-1])
            if kind == "edited":
                save_sharded(checkpoints, workdir, step)
                key = f"{checkpoint_folder(step)}/optimizer_0..__0_0.distcp"
                data = bytearray(bucket.get(key))
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                bucket.put(key, bytes(data))
            elif kind == "genuine":
                save_sharded(checkpoints, workdir, step)
            else:
                save_sharded(checkpoints, workdir, step, **_hostile(kind, ran))
            if kind == "genuine":
                genuine.append(step)
            else:
                hostile.append(step)
                result.faults[kind] += 1
        if rng.random() < 0.5:  # planted without a pin, with the worst payload
            save_sharded(BucketCheckpoints(bucket, keep=16), workdir, PLANTED_STEP, tamper=fallback_to_rank_local(ran))
            hostile.append(PLANTED_STEP)
            result.faults["planted"] += 1
        restoring = BucketCheckpoints(bucket)
        restored = restore_sharded(restoring, workdir / "restore")
        expected = max(genuine, default=None)
        result.check((restored[0] if restored else None) == expected, f"restored {restored}, the newest genuine is {expected}")
        result.check(restoring.skipped == sum(s > (expected or 0) for s in hostile), f"{restoring.skipped} skipped of {hostile}")
        if restored:
            import torch.distributed.checkpoint as dcp

            loaded = {"w": torch.zeros(6), "lr": 0.0}
            dcp.load(loaded, checkpoint_id=str(restored[1] / "optimizer_0"), no_dist=True)  # what DCP reads passed
            result.check(torch.equal(loaded["w"], torch.arange(6, dtype=torch.float32) * expected), "DCP loaded other weights")
        result.check(not ran.exists(), "a checkpoint's payload ran")
    finally:
        dist.destroy_process_group()
    return result
