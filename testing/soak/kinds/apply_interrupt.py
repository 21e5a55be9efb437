"""Trial ``apply_interrupt``: an exception in the middle of an apply; the subscriber rolls back exactly."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rlsync.bucket import LocalBucket
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.protocol import applier as applier_module

from ..invariants import Ledger, TrialResult
from ..toy import toy_master, toy_step

DEFAULT_TRIALS = 20


class _RaisingPatches(dict):
    """A patch mapping whose iteration raises after ``k`` tensors (an error mid-apply)."""

    def __init__(self, patches, k: int, exc: BaseException) -> None:
        super().__init__(patches)
        self.k, self.exc = k, exc

    def items(self):
        for i, item in enumerate(super().items()):
            if i == self.k:
                raise self.exc
            yield item


def trial_apply_interrupt(rng: random.Random, workdir: Path) -> TrialResult:
    """Raise mid-apply; the subscriber must roll back to the exact previous state, then apply cleanly."""
    result = TrialResult("apply_interrupt")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    pub = Publisher(bucket, policy=FixedInterval(rng.randint(3, 8)), owner="soak")
    sub = Subscriber(bucket)
    master = toy_master(rng.randrange(1000))
    final = rng.randint(8, 16)
    interrupts = 0
    for step in range(final + 1):
        if step:
            toy_step(master, step)
        rec = pub.publish(step, master)
        ledger.record(rec.step, rec.state_hash, "publisher")
        update = sub.fetch()
        assert update is not None
        if update.kind == "delta" and rng.random() < 0.6:
            interrupts += 1
            before = (sub.step, sub.state_hash, state_hash(sub.state), sub.lanes)
            how = rng.choice(["scatter raises", "patch iteration raises", "KeyboardInterrupt"])
            k = rng.randint(0, len(update.patches) - 1)
            exc: BaseException = KeyboardInterrupt() if how == "KeyboardInterrupt" else RuntimeError("injected")
            patches = update.patches
            real, calls = applier_module.scatter_, [0]

            def scatter_raises(*args, calls=calls, k=k, exc=exc, real=real) -> torch.Tensor:
                calls[0] += 1
                if calls[0] == k + 1:  # once: the rollback scatters too
                    raise exc
                return real(*args)

            if how == "patch iteration raises":
                update.patches = _RaisingPatches(patches, k, exc)
            else:
                applier_module.scatter_ = scatter_raises
            try:
                sub.apply(update)
                result.fail(f"apply did not raise the injected {how}")
            except (RuntimeError, KeyboardInterrupt):
                pass
            finally:
                applier_module.scatter_ = real
                update.patches = patches
            result.faults[f"apply interrupted: {how}"] += 1
            after = (sub.step, sub.state_hash, state_hash(sub.state), sub.lanes)
            result.check(
                after == before, f"state after an interrupted apply of {update.step} is not the previous state"
            )
            result.check(not sub.needs_resync, "an interrupted apply made the subscriber wait for an anchor")
        sub.apply(update)
        ledger.check_state(sub.step, sub.state, sub.state_hash, "subscriber")
    result.check(sub.step == final, f"subscriber ended at {sub.step}")
    return result
