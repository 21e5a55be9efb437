"""Trial ``flaky_storage``: latency, 503/429 and cut-short uploads beneath a retrying bucket; everything converges."""

from __future__ import annotations

import collections
import random
from pathlib import Path

from rlsync.bucket import LocalBucket, RetryingBucket
from rlsync.protocol import Subscriber

from ...faulty import FaultyBucket
from ..invariants import Ledger, TrialResult, check_verified
from ..processes import CHILD_TIMEOUT_S
from ..toy import PublisherThread, follow_until_converged

DEFAULT_TRIALS = 8


def _flaky(raw: LocalBucket, seed: int, rng: random.Random) -> tuple[RetryingBucket, FaultyBucket]:
    faulty = FaultyBucket(
        raw, seed=seed, latency=rng.choice([0.0, 0.0005, 0.002]), error_rate=rng.uniform(0.02, 0.15),
        throttle_rate=rng.uniform(0.02, 0.1), retry_after=0.002, truncate_rate=rng.uniform(0.02, 0.15), list_lag=rng.randint(0, 3),
    )  # fmt: skip
    return RetryingBucket(faulty, max_attempts=8, base_delay=0.001, max_delay=0.01), faulty


def trial_flaky_storage(rng: random.Random, workdir: Path) -> TrialResult:
    """Publisher and three subscribers on fault-injecting, retrying buckets: all converge bit-exactly."""
    result = TrialResult("flaky_storage")
    raw = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    final = rng.randint(14, 22)
    stacks = [_flaky(raw, rng.randrange(2**31), rng) for _ in range(4)]

    class Checked(PublisherThread):
        def after_publish(self, step: int) -> None:
            # never a cut-short object behind the pointer: every named object has its promised size and stays unchanged
            ledger.observe(raw)

    publisher = Checked(stacks[0][0], ledger, final, interval=4, keep=2, pause_s=0.005, seed=rng.randrange(1000))
    subs = [Subscriber(stack[0]) for stack in stacks[1:]]
    unreadable: collections.Counter = collections.Counter()
    follow_until_converged(publisher, subs, ledger, CHILD_TIMEOUT_S, unreadable)
    ledger.observe(raw)
    check_verified(raw, result, "after the flaky run")
    for _, faulty in stacks:
        for kind, n in faulty.injected.items():
            if n:
                result.faults[f"flaky: {kind}"] += n
    if publisher.retries:
        result.faults["flaky: publish retried after retries ran out"] += publisher.retries
    if unreadable:
        result.faults["flaky: pointer seen cut short (refused)"] += sum(unreadable.values())
    return result
