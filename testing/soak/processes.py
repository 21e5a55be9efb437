"""Child processes of the trials: an append-only journal, the publisher and subscriber loops
they run, and a forkserver to start them in milliseconds."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import random
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from rlsync.errors import BucketError, FencedError, RunLockedError, SyncError
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.protocol import applier as applier_module

from .hooks import HookBucket, die
from .toy import SHARD_BYTES, as_master, toy_master, toy_step

# forkserver children of ``python -m testing.soak`` re-run the main module, which is preloaded
warnings.filterwarnings("ignore", message=r"'testing\.[\w.]+' found in sys\.modules", category=RuntimeWarning)

EXIT_REFUSED = 3  # RunLockedError
EXIT_FENCED = 4  # FencedError
EXIT_TIMEOUT = 5
CHILD_TIMEOUT_S = 120.0


class Journal:
    """Append-only JSON lines, one ``write`` syscall each, so a SIGKILL never tears a line."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **event: Any) -> None:
        os.write(self.fd, (json.dumps(event) + "\n").encode())


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """Events of a journal (a torn last line, if any, is ignored)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def run_child(target: Callable[[dict[str, Any]], None], cfg: dict[str, Any]) -> None:
    """Run a child's loop; log any traceback to its log file and exit 1 on an unexpected error."""
    logging.basicConfig(
        filename=cfg["log"], level=logging.WARNING, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    try:
        target(cfg)
    except SystemExit:
        raise
    except BaseException:
        logging.getLogger("testing.soak.child").error("child failed:\n%s", traceback.format_exc())
        os._exit(1)


def publisher_loop(cfg: dict[str, Any]) -> None:
    """Publish versions up to ``cfg["final"]``, resuming whatever the bucket holds."""
    journal = Journal(cfg["journal"])
    bucket = HookBucket(cfg["root"], cfg.get("kill"))
    pub = Publisher(
        bucket, policy=FixedInterval(cfg["interval"]), keep_anchors=cfg["keep"], max_shard_bytes=SHARD_BYTES,
        owner=cfg["owner"], lock_ttl_s=cfg.get("lock_ttl_s", 600.0),
    )  # fmt: skip
    try:
        state = pub.resume()
    except RunLockedError as exc:
        journal.write(event="refused", error=str(exc))
        sys.exit(EXIT_REFUSED)
    if state is None:
        master, step = toy_master(cfg["seed"]), 0
    else:
        master, step = as_master(state), pub.step + 1
    journal.write(
        event="resumed", step=pub.step, hash=pub.manifest.state_hash if pub.manifest else None, pid=os.getpid()
    )
    while step <= cfg["final"]:
        if step:
            toy_step(master, step)
        try:
            rec = pub.publish(step, master)
        except FencedError as exc:
            journal.write(event="fenced", step=step, error=str(exc))
            sys.exit(EXIT_FENCED)
        journal.write(event="published", step=rec.step, kind=rec.kind, hash=rec.state_hash)
        step += 1
        if cfg.get("pause_s"):
            time.sleep(cfg["pause_s"])
    journal.write(event="done", step=pub.step)


def publisher_child(cfg: dict[str, Any]) -> None:
    """Process entry point of :func:`publisher_loop`."""
    run_child(publisher_loop, cfg)


def subscriber_loop(cfg: dict[str, Any]) -> None:
    """Follow the bucket until version ``cfg["final"]``, journaling every applied state's recomputed hash."""
    journal = Journal(cfg["journal"])
    kill = cfg.get("kill")
    bucket = HookBucket(cfg["root"], kill if kill and kill[0] == "mid-download" else None)
    if kill and kill[0] == "mid-apply":  # die while the changed elements are being scattered
        real, calls = applier_module.scatter_, [0]

        def scatter_then_die(*args) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == kill[1]:
                die()
            return real(*args)

        applier_module.scatter_ = scatter_then_die
    sub = Subscriber(bucket, workdir=cfg["workdir"])
    journal.write(event="started")
    fetched = 0
    deadline = time.time() + CHILD_TIMEOUT_S
    while time.time() < deadline:
        try:
            update = sub.fetch()
        except (SyncError, BucketError) as exc:
            journal.write(event="refused", step=sub.step, error=str(exc)[:300])
            time.sleep(cfg["poll_s"])
            continue
        if update is None:
            if sub.step == cfg["final"]:
                journal.write(event="done", step=sub.step, hash=state_hash(sub.state))
                return
            time.sleep(cfg["poll_s"])
            continue
        fetched += 1
        if kill and kill[0] == "before-apply" and fetched == kill[1]:
            die()
        try:
            sub.apply(update)
        except SyncError as exc:
            journal.write(event="refused", step=sub.step, error=str(exc)[:300])
            continue
        journal.write(
            event="applied", step=sub.step, kind=update.kind, hash=state_hash(sub.state), claimed=sub.state_hash
        )
    journal.write(event="timeout", step=sub.step)
    sys.exit(EXIT_TIMEOUT)


def subscriber_child(cfg: dict[str, Any]) -> None:
    """Process entry point of :func:`subscriber_loop`."""
    run_child(subscriber_loop, cfg)


_CONTEXT: multiprocessing.context.BaseContext | None = None


def mp_context(preload: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """A forkserver context with torch and the library preloaded, so a child starts in milliseconds.

    Args:
        preload: More modules to preload (only the first call, before the server starts, counts).
    """
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch", "rlsync.protocol", "rlsync.protocol.verify", "testing.soak.processes", *preload]
        )
        _CONTEXT = ctx
    return _CONTEXT


def spawn(target: Callable[[dict[str, Any]], None], cfg: dict[str, Any]) -> multiprocessing.process.BaseProcess:
    """Start ``target(cfg)`` in a forkserver child (daemonic: it dies with this process)."""
    proc = mp_context().Process(target=target, args=(cfg,), daemon=True)
    proc.start()
    return proc


def wait_for(proc: multiprocessing.process.BaseProcess, timeout: float = CHILD_TIMEOUT_S) -> int:
    """Wait for a child; kill it if it overruns. Returns its exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return EXIT_TIMEOUT
    return proc.exitcode if proc.exitcode is not None else EXIT_TIMEOUT


def log_tail(path: Path, n: int = 1500) -> str:
    """The last ``n`` characters of a child's log file (empty if it has none)."""
    try:
        return path.read_text()[-n:]
    except FileNotFoundError:
        return ""


def plan_lives(
    rng: random.Random, kills: list[tuple[str, int | None]] | None, modes: list[str], nth: dict
) -> list[tuple[int, str | None, tuple[str, int] | None]]:
    """``(life, mode, kill)`` for each process life: 1-3 random kills (or ``kills``), then a clean one.

    ``mode`` is the life's kill mode (``None``: none); ``kill`` the ``(mode, n)`` the child acts on
    itself (``None`` for a ``"random"`` kill, which the parent does after a random delay).
    """
    if kills is None:
        kills = [(m, None) for m in (rng.choice(modes) for _ in range(rng.randint(1, 3)))]
    plan = [(m, n if n is not None or m == "random" else rng.randint(*nth[m])) for m, n in kills]
    lives = [(life, m, None if m == "random" else (m, n)) for life, (m, n) in enumerate(plan, 1)]
    return [*lives, (len(plan) + 1, None, None)]
