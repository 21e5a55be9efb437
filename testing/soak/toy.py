"""The soak trials' toy model (fp32 master weights of a tiny decoder) and an in-process publisher of it."""

from __future__ import annotations

import collections
import threading
import time

import torch

from rlsync.errors import BucketError, FormatError, SyncError
from rlsync.protocol import FixedInterval, Publisher

from .invariants import Ledger

SHARD_BYTES = 6 * 1024  # small shards: anchors of the toy model span several files


def toy_master(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of a toy decoder (about 25k parameters) plus an integer buffer."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(48, 48, generator=g) * 0.02,
        "model.layers.0.self_attn.o_proj.weight": torch.randn(48, 48, generator=g) * 0.02,
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=g) * 0.02,
        "model.layers.0.mlp.down_proj.weight": torch.randn(48, 96, generator=g) * 0.02,
        "model.norm.weight": 1 + torch.randn(48, generator=g) * 0.02,
        "lm_head.weight": torch.randn(64, 48, generator=g) * 0.02,
        "model.step_counter": torch.tensor([0], dtype=torch.int64),
    }
    return state


def toy_step(master: dict[str, torch.Tensor], step: int, scale: float = 2e-4) -> None:
    """An RL-like in-place update that flips a few percent of the bf16 weights."""
    g = torch.Generator().manual_seed(10_000 + step)
    for t in master.values():
        if t.is_floating_point():
            t += torch.randn(t.shape, generator=g) * scale
    master["model.step_counter"] += 1


def as_master(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 master weights continuing from a resumed (bf16) state, as a restarted trainer does."""
    return {n: t.float() if t.is_floating_point() else t.clone() for n, t in state.items()}


class PublisherThread(threading.Thread):
    """An in-process publisher writing versions 0..final, recording each into a ledger."""

    def __init__(
        self,
        bucket,
        ledger: Ledger,
        final: int,
        *,
        interval: int = 5,
        keep: int = 2,
        pause_s: float = 0.03,
        seed: int = 0,
    ) -> None:
        super().__init__(daemon=True)
        self.pub = Publisher(
            bucket,
            policy=FixedInterval(interval),
            keep_anchors=keep,
            max_shard_bytes=SHARD_BYTES,
            owner="soak-thread",
        )
        self.ledger, self.final, self.pause_s = ledger, final, pause_s
        self.master = toy_master(seed)
        self.error: BaseException | None = None
        self.retries = 0

    def run(self) -> None:
        try:
            for step in range(self.final + 1):
                if step:
                    toy_step(self.master, step)
                while True:
                    try:
                        rec = self.pub.publish(step, self.master)
                        break
                    except BucketError:  # retries exhausted on a flaky bucket: the trainer retries later
                        self.retries += 1
                        time.sleep(0.01)
                self.ledger.record(rec.step, rec.state_hash, "publisher")
                self.after_publish(rec.step)
                time.sleep(self.pause_s)
        except BaseException as exc:  # reported by the trial
            self.error = exc

    def after_publish(self, step: int) -> None:
        """Hook for checks between publishes."""


def follow_until_converged(
    publisher: PublisherThread, subs: list, ledger: Ledger, timeout_s: float, unreadable: collections.Counter
) -> None:
    """Run the publisher and one follower thread per subscriber until all reach the publisher's final
    version (or time runs out), checking every state a subscriber holds; then check that they converged.

    A refused or failed update (a bucket error after retries, a pointer cut short mid-upload) is retried
    on the next poll; pointer reads refused as unreadable are counted in `unreadable`.
    """
    final = publisher.final

    def follow(i: int, sub) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                update = sub.fetch()
                if update is not None:
                    sub.apply(update)
                    ledger.check_state(sub.step, sub.state, sub.state_hash, f"subscriber {i}")
                    continue
            except FormatError as exc:  # the pointer itself cut short mid-upload: refused, retried
                unreadable[str(exc)[:40]] += 1
                ledger.check_state(sub.step, sub.state, sub.state_hash, f"subscriber {i}")
            except (SyncError, BucketError):
                ledger.check_state(sub.step, sub.state, sub.state_hash, f"subscriber {i}")
            if not publisher.is_alive() and sub.step == final:
                return
            time.sleep(0.005)

    threads = [threading.Thread(target=follow, args=(i, s), daemon=True) for i, s in enumerate(subs)]
    publisher.start()
    for t in threads:
        t.start()
    publisher.join(timeout_s)
    for t in threads:
        t.join(timeout_s)
    result = ledger.result
    result.check(publisher.error is None, f"publisher failed: {publisher.error!r}")
    for i, sub in enumerate(subs):
        result.check(sub.step == final, f"subscriber {i} ended at {sub.step}, not {final}")
        ledger.check_state(sub.step, sub.state, sub.state_hash, f"subscriber {i} at the end")
    ledger.settle()
