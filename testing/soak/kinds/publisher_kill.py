"""Trial ``publisher_kill``: kill -9 the publisher process at random points; each restart must resume exactly."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from rlsync.bucket import LocalBucket
from rlsync.protocol import Subscriber

from ..invariants import Ledger, TrialResult, check_verified
from ..processes import log_tail, plan_lives, publisher_child, read_journal, spawn, wait_for

DEFAULT_TRIALS = 50

PUBLISHER_KILLS = [
    "random",
    "lock",
    "mid-delta",
    "before-pointer",
    "mid-shard",
    "after-shard",
    "after-pointer",
    "mid-delete",
]
_KILL_NTH = {"lock": (1, 1), "mid-delta": (1, 6), "before-pointer": (1, 8), "mid-shard": (1, 8), "after-shard": (1, 8), "after-pointer": (1, 8), "mid-delete": (1, 2)}  # fmt: skip


def kill_after_random_publish(proc, journal: Path, rng: random.Random, final: int) -> None:
    """SIGKILL ``proc`` a random moment after a random number of its publishes (a child whose
    imports are preloaded can finish a whole run within a fixed delay, so none would be hit)."""
    publishes = rng.randint(0, final // 2)
    deadline = time.monotonic() + 60.0
    while proc.is_alive() and time.monotonic() < deadline:
        if sum(e["event"] == "published" for e in read_journal(journal)) >= publishes:
            break
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.02))
    proc.kill()


def trial_publisher_kill(
    rng: random.Random, workdir: Path, kills: list[tuple[str, int | None]] | None = None
) -> TrialResult:
    """Kill a publisher process 1-3 times at random points; each restart must resume exactly.

    Args:
        rng: Drives every random choice.
        workdir: Empty folder for the bucket, journals and logs.
        kills: ``(mode, n)`` per killed life (see :class:`HookBucket`; ``"random"``: after a random
            delay); default 1-3 random ones.
    """
    result = TrialResult("publisher_kill")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    final = rng.randint(14, 24)
    base = dict(root=str(bucket.root), owner="trainer-soak", final=final, interval=4, keep=2, seed=rng.randrange(1000))
    pointer_step: int | None = None
    for life, mode, kill in plan_lives(rng, kills, PUBLISHER_KILLS, _KILL_NTH):
        journal = workdir / f"pub-{life}.jsonl"
        cfg = dict(base, journal=str(journal), log=str(workdir / f"pub-{life}.log"), kill=kill)
        proc = spawn(publisher_child, cfg)
        if mode == "random":
            kill_after_random_publish(proc, journal, rng, final)
        code = wait_for(proc)
        events = read_journal(journal)
        killed = code == -signal.SIGKILL
        if killed:
            result.faults[f"kill -9 {mode}"] += 1
        elif code != 0:
            result.fail(f"publisher life {life} exited with {code}: {log_tail(Path(cfg['log']))}")
            break
        # the restart resumed exactly where the pointer was
        resumed = [e for e in events if e["event"] == "resumed"]
        if resumed:
            result.check(
                resumed[0]["step"] == pointer_step,
                f"life {life} resumed at {resumed[0]['step']}, the pointer was at {pointer_step}",
            )
            if resumed[0]["step"] is not None and pointer_step is not None and resumed[0]["step"] < pointer_step:
                result.lost += pointer_step - resumed[0]["step"]
            expected = 0 if pointer_step is None else pointer_step + 1
            for e in events:
                if e["event"] == "published":
                    result.check(
                        e["step"] == expected,
                        f"life {life} published {e['step']}, expected {expected} (skipped or reused)",
                    )
                    ledger.record(e["step"], e["hash"], f"life {life}")
                    expected = e["step"] + 1
        manifest = ledger.observe(bucket)
        pointer_step = manifest.step if manifest else None
        if manifest is not None:
            check_verified(bucket, result, f"after publisher life {life} ({mode or 'clean exit'})")
        if not killed:
            break
    # every version 0..final published exactly once, and a new replica gets the newest bit-exactly
    result.check(
        sorted(ledger.versions) == list(range(final + 1)), f"published versions {sorted(ledger.versions)} != 0..{final}"
    )
    sub = Subscriber(bucket)
    sub.sync()
    result.check(sub.step == final, f"a new replica ended at {sub.step}, not {final}")
    ledger.check_state(sub.step, sub.state, sub.state_hash, "new replica")
    leftovers = [p for p in bucket.root.rglob(".tmp-*")]
    if leftovers:
        result.notes["partial .tmp- files left in the bucket by killed writers"] += len(leftovers)
    return result
