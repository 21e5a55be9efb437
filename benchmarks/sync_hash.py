"""Replica pause and state hash at a real model's size: what a sync costs a replica's generation.

A state shaped like Qwen3-0.6B (``transformers.Qwen3Config`` with its real dimensions, built on the
meta device, weights drawn like an LLM's in bf16; the tied ``lm_head`` counted once) is published
through the library's :class:`~rlsync.protocol.Publisher` to a local bucket: one anchor, then
deltas that each change ``--changed`` of the elements (a random set, by one to a few ulps, as small
AdamW steps do). Then the trainer's objects are freed and a replica follows with a
:class:`~rlsync.protocol.Subscriber` whose state is the "engine's" own tensors (``weights=``, as the
transformers engine gives it). Measured in the same run, best of the deltas:

* the replica's pause (``Subscriber.apply``) against the bare scatter of the same patch into the
  same tensors;
* the replica's fetch (download, decode, hash update and check: before the pause);
* the state hash: updating it from one delta's changes (old and new bits) against a full hash of
  the whole state; the trainer's ``hash_s`` of the same delta;
* an anchor bootstrap (fetch + apply) against a plain safetensors load and copy of the same file;
* peak RSS of the trainer's part, of the replica's bootstrap (the anchor file's pages count while
  it is hashed and copied) and of the replica following deltas, against the model's bytes.

    python -m benchmarks.sync_hash                   # Qwen3-0.6B dimensions (596M parameters)
    python -m benchmarks.sync_hash --params 50e6     # fewer layers (and a smaller vocabulary)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from benchmarks.qwen3 import MODELS, qwen3_shapes
from rlsync.bucket import LocalBucket
from rlsync.dtypes import bits_to_numpy, int_view
from rlsync.hashing import StateLanes, changes_lanes
from rlsync.patch import scatter_
from rlsync.protocol import FixedInterval, Publisher, Subscriber

logger = logging.getLogger("benchmarks.sync_hash")

def scaled_shapes(params: float | None) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of Qwen3-0.6B (``params=None``), or of the same layers with fewer of them (and a
    32k vocabulary where the real one alone would pass ``params``); tied tensors once."""
    dims = dict(MODELS["qwen3-0.6b"])
    if params is not None:
        hidden, inter = dims["hidden_size"], dims["intermediate_size"]
        per_layer = 4 * hidden * hidden + 3 * hidden * inter  # about: q, k, v, o (GQA rounds down) and the MLP
        if dims["vocab_size"] * hidden > params / 2:
            dims["vocab_size"] = 32000
        dims["num_hidden_layers"] = max(1, round((params - dims["vocab_size"] * hidden) / per_layer))
    return qwen3_shapes(dims)


def make_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights drawn like an LLM's: matrices ~N(0, 0.02), norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        for row in t.view(-1).split(1 << 24):
            row.copy_(torch.randn(row.numel(), generator=gen) * 0.02 + (1.0 if len(shape) == 1 else 0.0))
        out[name] = t
    return out


def small_step(state: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> None:
    """Change ``fraction`` of each tensor's elements, at random positions, by one to three ulps."""
    for tensor in state.values():
        bits = bits_to_numpy(int_view(tensor))
        n = max(1, int(bits.size * fraction))
        index = rng.choice(bits.size, n, replace=False)
        step = rng.integers(1, 4, n).astype(np.int64) * rng.choice([-1, 1], n)
        bits[index] = (bits[index].astype(np.int64) + step).astype(bits.dtype)  # ulps of the magnitude


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace) -> dict:
    shapes = scaled_shapes(args.params)
    total = sum(int(np.prod(s)) for s in shapes.values())
    logger.info("%d tensors, %.0fM parameters", len(shapes), total / 1e6)
    rng = np.random.default_rng(0)
    out: dict = {"parameters": total, "changed_fraction": args.changed, "deltas": args.deltas}
    with tempfile.TemporaryDirectory(prefix="rlsync-sync-hash-") as tmp:
        bucket = LocalBucket(Path(tmp) / "bucket")
        # -- trainer --------------------------------------------------------------------------
        state = make_state(shapes, seed=0)
        pub = Publisher(bucket, policy=FixedInterval(1000))
        records = [pub.publish(0, state)]
        t0 = time.perf_counter()
        full = StateLanes.of(state)
        out["full_hash_s"] = time.perf_counter() - t0
        for step in range(1, args.deltas + 1):
            small_step(state, args.changed, rng)
            records.append(pub.publish(step, state))
        out["trainer_hash_update_s"] = min(r.hash_s for r in records[1:])
        out["changed"] = [r.changed for r in records[1:]]
        assert records[-1].state_hash == StateLanes.of(state).hexdigest() != full.hexdigest()
        del state, pub, full
        gc.collect()
        out["trainer_peak_rss_bytes"] = peak_rss()
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak from here on is the replica's (VmHWM := VmRSS)
        out["rss_before_replica_bytes"] = peak_rss()  # the interpreter and libraries
        # -- replica --------------------------------------------------------------------------
        weights = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes.items()}  # the engine's tensors
        sub = Subscriber(bucket, weights=weights)
        t0 = time.perf_counter()
        anchor = sub.fetch()
        t1 = time.perf_counter()
        sub.apply(anchor)
        out["anchor_fetch_s"], out["anchor_apply_s"] = t1 - t0, time.perf_counter() - t1
        out["anchor_download_s"], out["anchor_verify_s"] = anchor.download_s, anchor.decode_s
        del anchor
        out["anchor_peak_rss_bytes"] = peak_rss()
        Path("/proc/self/clear_refs").write_text("5")
        path = next((bucket.root / "anchors").rglob("*.safetensors"))
        t0 = time.perf_counter()
        for name, tensor in safetensors.torch.load_file(path).items():
            weights[name].copy_(tensor)
        out["plain_load_copy_s"] = time.perf_counter() - t0
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        fetch, pause, scatter, update = [], [], [], []
        for _ in range(args.deltas):
            t0 = time.perf_counter()
            delta = sub.fetch()
            fetch.append(time.perf_counter() - t0)
            assert delta is not None and delta.kind == "delta"
            t0 = time.perf_counter()
            sub.apply(delta)
            pause.append(time.perf_counter() - t0)
            for name, patch in delta.patches.items():  # undo, then the bare scatter of the same patch
                scatter_(weights[name], patch.index, delta.old[name])
            t0 = time.perf_counter()
            for name, patch in delta.patches.items():
                scatter_(weights[name], patch.index, patch.values)
            scatter.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            changes_lanes({
                name: (weights[name].element_size(), weights[name].numel(), patch.index.numpy(),
                       bits_to_numpy(int_view(delta.old[name])), bits_to_numpy(int_view(patch.values)))
                for name, patch in delta.patches.items()
            })  # fmt: skip
            update.append(time.perf_counter() - t0)
        assert sub.verify_weights() is True and sub.state_hash == records[-1].state_hash
        out.update(
            replica_fetch_s=min(fetch), replica_pause_s=min(pause), bare_scatter_s=min(scatter),
            hash_update_s=min(update), replica_peak_rss_bytes=peak_rss(), delta_bytes=[r.nbytes for r in records[1:]],
            model_bytes=2 * total,
        )  # fmt: skip
    out["replica_added_rss_over_model"] = (out["replica_peak_rss_bytes"] - out["rss_before_replica_bytes"]) / out["model_bytes"]
    out["pause_over_scatter"] = out["replica_pause_s"] / out["bare_scatter_s"]
    out["full_hash_over_update"] = out["full_hash_s"] / out["hash_update_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=None, help="parameters (default: Qwen3-0.6B's own dimensions)")
    parser.add_argument("--changed", type=float, default=0.0126, help="fraction of elements each delta changes")
    parser.add_argument("--deltas", type=int, default=3, help="deltas published and applied (figures: the best)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
