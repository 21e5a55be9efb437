"""Trial ``two_trainers``: a second trainer is refused; a takeover fences the first one; the chain stays valid."""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

from rlsync.bucket import LocalBucket
from rlsync.protocol import Subscriber

from ..invariants import Ledger, TrialResult, check_verified
from ..processes import (
    CHILD_TIMEOUT_S,
    EXIT_FENCED,
    EXIT_REFUSED,
    log_tail,
    publisher_child,
    read_journal,
    spawn,
    wait_for,
)

DEFAULT_TRIALS = 10


def trial_two_trainers(rng: random.Random, workdir: Path) -> TrialResult:
    """A second trainer is refused; one that takes over fences the first; the chain stays valid."""
    result = TrialResult("two_trainers")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    base = dict(root=str(bucket.root), interval=4, keep=2, seed=rng.randrange(1000), pause_s=rng.uniform(0.01, 0.05))

    def start(name: str, owner: str, final: int, **extra) -> tuple[multiprocessing.process.BaseProcess, Path, dict]:
        cfg = dict(
            base,
            owner=owner,
            final=final,
            journal=str(workdir / f"{name}.jsonl"),
            log=str(workdir / f"{name}.log"),
            **extra,
        )
        return spawn(publisher_child, cfg), Path(cfg["journal"]), cfg

    a, a_journal, a_cfg = start("a", "trainer-a", 10_000)
    deadline = time.time() + CHILD_TIMEOUT_S
    while len([e for e in read_journal(a_journal) if e["event"] == "published"]) < rng.randint(2, 8):
        if time.time() > deadline or not a.is_alive():
            result.fail(f"trainer a did not publish: {log_tail(Path(a_cfg['log']))}")
            a.kill()
            return result
        time.sleep(0.01)
    # another owner is refused while a's lock is fresh
    b, _, b_cfg = start("b", "trainer-b", 10_000)
    code = wait_for(b)
    result.faults["second trainer started"] += 1
    result.check(
        code == EXIT_REFUSED, f"a second trainer was not refused (exit {code}): {log_tail(Path(b_cfg['log']))}"
    )
    result.check(a.is_alive(), "the first trainer stopped when a second one was refused")
    # then a takeover: the same owner id started again (a duplicate Space), or a stale lock
    how = rng.choice(["same owner", "stale lock"])
    result.faults[f"takeover: {how}"] += 1
    now = ledger.observe(bucket)
    extra_steps = rng.randint(3, 8)
    c_final = (now.step if now else 0) + 20 + extra_steps
    c_owner, c_extra = ("trainer-a", {}) if how == "same owner" else ("trainer-c", {"lock_ttl_s": 0.0})
    c, c_journal, c_cfg = start("c", c_owner, c_final, **c_extra)
    code_a = wait_for(a, 30)
    code_c = wait_for(c)
    if code_c == EXIT_FENCED:
        # a's publish was in flight at the takeover and its pointer landed after c resumed: c refused to
        # write over it; restarted (as a Space would be), c resumes after a's last version
        result.faults["takeover raced an in-flight publish (new trainer stopped, restarted)"] += 1
        c2, c_journal2, c_cfg = start("c2", c_owner, c_final, **c_extra)
        code_c = wait_for(c2)
        c_journal = c_journal2
    result.check(
        code_a == EXIT_FENCED, f"the taken-over trainer was not fenced (exit {code_a}): {log_tail(Path(a_cfg['log']))}"
    )
    result.check(code_c == 0, f"the new trainer failed (exit {code_c}): {log_tail(Path(c_cfg['log']))}")
    a_events, c_events = read_journal(a_journal), read_journal(c_journal)
    for name in ("a", "c", "c2"):
        for e in read_journal(workdir / f"{name}.jsonl"):
            if e["event"] == "published":
                ledger.record(e["step"], e["hash"], f"trainer {name}")
    manifest = ledger.observe(bucket)
    check_verified(bucket, result, f"after a takeover ({how})")
    c_resumed = next((e["step"] for e in c_events if e["event"] == "resumed"), None)
    a_last = max((e["step"] for e in a_events if e["event"] == "published"), default=-1)
    result.check(
        c_resumed is not None and a_last <= c_resumed, f"trainer a published {a_last} after c resumed at {c_resumed}"
    )
    if manifest is not None:
        result.check(
            sorted(ledger.versions) == list(range(manifest.step + 1)),
            f"versions {sorted(ledger.versions)} not consecutive",
        )
        sub = Subscriber(bucket)
        sub.sync()
        ledger.check_state(sub.step, sub.state, sub.state_hash, "replica after the takeover")
    return result
