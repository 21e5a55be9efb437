"""Trial ``subscriber_kill``: kill -9 a subscriber process; a fresh one must reach the newest version bit-exactly."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from rlsync.bucket import LocalBucket

from ..invariants import Ledger, TrialResult
from ..processes import CHILD_TIMEOUT_S, log_tail, plan_lives, read_journal, spawn, subscriber_child, wait_for
from ..toy import PublisherThread

DEFAULT_TRIALS = 20

SUBSCRIBER_KILLS = ["random", "mid-download", "before-apply", "mid-apply"]
_SUB_NTH = {"mid-download": (1, 6), "before-apply": (1, 8), "mid-apply": (1, 40)}


def trial_subscriber_kill(
    rng: random.Random, workdir: Path, kills: list[tuple[str, int | None]] | None = None
) -> TrialResult:
    """Kill a following subscriber process 1-3 times; a fresh one must reach the newest version bit-exactly.

    Args:
        rng: Drives every random choice.
        workdir: Empty folder for the bucket, journals and logs.
        kills: ``(mode, n)`` per killed life (``mid-download``, ``before-apply``, ``mid-apply``,
            ``random``); default 1-3 random ones.
    """
    result = TrialResult("subscriber_kill")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    final = rng.randint(20, 30)
    publisher = PublisherThread(bucket, ledger, final, pause_s=rng.uniform(0.01, 0.05), seed=rng.randrange(1000))
    lives: list[Path] = []
    for life, mode, kill in plan_lives(rng, kills, SUBSCRIBER_KILLS, _SUB_NTH):
        journal = workdir / f"sub-{life}.jsonl"
        lives.append(journal)
        (workdir / f"scratch-{life}").mkdir()
        cfg = dict(root=str(bucket.root), final=final, poll_s=0.01, journal=str(journal), log=str(workdir / f"sub-{life}.log"),
                   workdir=str(workdir / f"scratch-{life}"), kill=kill)  # fmt: skip
        proc = spawn(subscriber_child, cfg)
        if life == 1:  # the first subscriber follows from version 0: every kill point is reached
            deadline = time.time() + CHILD_TIMEOUT_S
            while proc.is_alive() and time.time() < deadline and not read_journal(journal):
                time.sleep(0.005)
            publisher.start()
        if mode == "random":
            time.sleep(rng.uniform(0.0, 0.5))
            proc.kill()
        code = wait_for(proc)
        if code == -signal.SIGKILL:
            result.faults[f"kill -9 {mode}"] += 1
            continue
        if code != 0:
            result.fail(f"subscriber life {life} exited with {code}: {log_tail(Path(cfg['log']))}")
        break
    publisher.join(CHILD_TIMEOUT_S)
    result.check(publisher.error is None, f"publisher failed: {publisher.error!r}")
    # every state any life ever held was exactly a published version
    for n, journal in enumerate(lives, 1):
        for e in read_journal(journal):
            if e["event"] == "applied":
                ledger.check_hash(e["step"], e["hash"], e["claimed"], f"subscriber life {n}")
    ledger.settle()
    done = [e for e in read_journal(lives[-1]) if e["event"] == "done"]
    if result.check(bool(done), f"the last subscriber never reached version {final}"):
        result.check(done[0]["step"] == final, f"the last subscriber ended at {done[0]['step']}")
        ledger.check_hash(final, done[0]["hash"], done[0]["hash"], "last subscriber")
    return result
