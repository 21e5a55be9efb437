"""Soak test: "nothing lost, nothing half-applied" under kills, damage, flaky storage and two trainers.

Every trial builds a fresh local bucket, injects one kind of fault many times at
random moments, and checks the same invariants throughout:

* a replica never serves a mix of two versions: after every apply, the
  whole-state hash of its tensors (recomputed from the bytes, not the
  subscriber's own claim) equals the hash the pointer published for its step;
* every replica ends at the newest published version, bit-exactly;
* no published version is lost, reused or skipped: pointer steps are
  consecutive across publisher restarts, and every object the pointer ever
  named keeps its bytes (its sha256 never changes) until retention drops it;
* ``verify_bucket`` passes whenever no damage was injected on purpose.

Trial kinds (``--kinds``):

``publisher_kill``
    A publisher process (a small fp32 toy model and a plain
    :class:`~shared.protocol.Publisher` loop, not the GRPO trainer) is killed
    with SIGKILL after a random delay or at a chosen point inside ``publish``:
    while taking the run lock, mid delta upload, between the data and the
    pointer, mid anchor shard upload, between anchor shards, after the pointer
    but before the retention delete, and halfway through the retention delete.
    It is restarted with the same owner id and must ``resume()`` from the last
    complete publish.
``subscriber_kill``
    A subscriber process is killed after a random delay, mid download, between
    fetch and apply, or mid apply (while hashing the patched tensors); a fresh
    process bootstraps and must reach the newest version bit-exactly.
``apply_interrupt``
    In-process: an exception (or ``KeyboardInterrupt``) is raised after k
    tensors of a delta were written; the subscriber must roll back to the exact
    previous state hash, then apply the same update cleanly.
``bucket_damage``
    A delta deleted, bytes flipped, a file truncated, an old delta replayed
    over a newer one (pointer size fixed up), a pointer naming a missing file,
    an anchor shard deleted or flipped, a garbled pointer: subscribers refuse,
    keep their last good state, and reach the newest version after the next
    anchor.
``flaky_storage``
    :class:`~shared.bucket.FaultyBucket` (latency, 503, 429 with retry-after,
    uploads cut short, lagging listings) under a
    :class:`~shared.bucket.RetryingBucket`, beneath the publisher and three
    subscriber threads: everything converges bit-exactly and no cut-short
    upload is ever named by the pointer.
``two_trainers``
    A second trainer with another owner id is refused (``RunLockedError``);
    then one that takes the run over (same owner id, or a stale lock) makes the
    first one stop with ``FencedError``; the chain stays valid.

Usage::

    python -m benchmarks.soak                      # default trial counts
    python -m benchmarks.soak --trials 3           # 3 trials of every kind
    python -m benchmarks.soak --kinds publisher_kill --trials 200 --seed 7
    python -m benchmarks.soak --json soak.json

Exit status 1 if any state was lost or any invariant was violated.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from shared.bucket import BucketError, FaultyBucket, LocalBucket, RetryingBucket
from shared.errors import FormatError, SyncError
from shared.hashing import state_hash
from shared.protocol import (
    POINTER_KEY,
    FencedError,
    FixedInterval,
    Manifest,
    Publisher,
    RunLockedError,
    Subscriber,
    read_manifest,
)
from shared.protocol import subscriber as subscriber_module
from shared.protocol.verify import verify_bucket

logger = logging.getLogger("benchmarks.soak")
# forkserver children of ``python -m benchmarks.soak`` re-run the main module, which is preloaded
warnings.filterwarnings("ignore", message=r"'benchmarks\.\w+' found in sys\.modules", category=RuntimeWarning)

DEFAULT_TRIALS = {
    "publisher_kill": 50,
    "subscriber_kill": 20,
    "apply_interrupt": 20,
    "bucket_damage": 30,
    "flaky_storage": 8,
    "two_trainers": 10,
}
KINDS = tuple(DEFAULT_TRIALS)

EXIT_REFUSED = 3  # RunLockedError
EXIT_FENCED = 4  # FencedError
EXIT_TIMEOUT = 5
SHARD_BYTES = 6 * 1024  # small shards: anchors of the toy model span several files
CHILD_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------
# the toy model


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


# ---------------------------------------------------------------------------
# results


@dataclasses.dataclass
class TrialResult:
    """What one trial injected and found.

    Attributes:
        kind: The trial kind.
        faults: Faults injected, by name.
        lost: Published versions that were lost (a restarted publisher resumed
            below them, or an object the pointer still named vanished or changed).
        violations: Invariant violations, described.
        checks: Invariant checks that ran.
        notes: Things observed that are not faults nor violations (e.g. temporary files a killed writer left).
        seconds: Wall time.
    """

    kind: str
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lost: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    checks: int = 0
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        logger.error("%s: %s", self.kind, message)
        self.violations.append(message)

    def check(self, ok: bool, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.fail(message)
        return ok


class Ledger:
    """What the bucket published, as observed: version -> state hash, and each named object's sha256.

    Args:
        result: Where violations are reported.
    """

    def __init__(self, result: TrialResult) -> None:
        self.result = result
        self.versions: dict[int, str] = {}
        self.objects: dict[str, str] = {}
        self.pending: list[tuple[int, str, str]] = []
        self.lock = threading.Lock()

    def record(self, step: int, digest: str, where: str) -> None:
        """Record that ``step`` was published with ``digest``; a different hash for a known step is a reused version."""
        with self.lock:
            known = self.versions.setdefault(step, digest)
        if known != digest:
            self.result.lost += 1
            self.result.fail(f"version {step} published twice with different states ({where})")

    def observe(self, bucket: LocalBucket, *, expect_intact: bool = True) -> Manifest | None:
        """Read the pointer; record its versions and the sha256 of every object it names.

        With ``expect_intact``, a named object that is missing, of another size
        than the pointer says, or whose bytes changed since it was first seen is
        a violation (and a lost version).
        """
        try:
            manifest = read_manifest(bucket)
        except FormatError as exc:
            self.result.fail(f"pointer unreadable: {exc}")
            return None
        if manifest is None:
            return None
        self.result.checks += 1
        for entry in manifest.anchors:
            self.record(entry.step, entry.state_hash, "pointer")
        for delta in manifest.deltas:
            self.record(delta.step, delta.state_hash, "pointer")
        files = [(a.step, f) for a in manifest.anchors for f in a.files] + [(d.step, d.file) for d in manifest.deltas]
        for step, f in files:
            try:
                data = bucket.get(f.key)
            except BucketError:
                if expect_intact:
                    self.result.lost += 1
                    self.result.fail(f"{f.key} (version {step}) is named by the pointer but missing")
                continue
            digest = hashlib.sha256(data).hexdigest()
            with self.lock:
                first = self.objects.setdefault(f.key, digest)
            if expect_intact and (first != digest or len(data) != f.size):
                self.result.lost += 1
                self.result.fail(f"{f.key} (version {step}) changed after the pointer named it")
        return manifest

    def check_state(self, step: int | None, tensors: dict[str, torch.Tensor], claimed: str | None, where: str) -> None:
        """A subscriber's state must be exactly a published version: recomputed hash == published hash of its step."""
        if step is None:
            self.result.check(not tensors, f"{where}: holds tensors but no version")
            return
        actual = state_hash(tensors)
        self.check_hash(step, actual, claimed, where)

    def check_hash(self, step: int, actual: str, claimed: str | None, where: str) -> None:
        """Check a state seen at ``step``; a version not recorded yet (a reader can see the pointer
        before the publisher's call returns) is checked by :meth:`settle`."""
        with self.lock:
            published = self.versions.get(step)
            if published is None:
                self.pending.append((step, actual, where))
        self.result.check(claimed == actual, f"{where}: claims hash {str(claimed)[:12]} at {step}, holds {actual[:12]}")
        if published is not None:
            self._compare(step, actual, published, where)

    def _compare(self, step: int, actual: str, published: str | None, where: str) -> None:
        self.result.check(
            published == actual,
            f"{where}: serves step {step} with hash {actual[:12]}, published {str(published)[:12]} (a mix or a fork)",
        )

    def settle(self) -> None:
        """Check the states seen before their version was recorded (call once publishing is over)."""
        with self.lock:
            pending, self.pending = self.pending, []
        for step, actual, where in pending:
            self._compare(step, actual, self.versions.get(step), where)


def _verify(bucket: LocalBucket, result: TrialResult, where: str) -> None:
    report = verify_bucket(bucket)
    result.check(report.ok, f"verify_bucket failed {where}: {report.errors}")


# ---------------------------------------------------------------------------
# child processes: a journal, kill hooks, the publisher and subscriber loops


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


def die() -> None:
    """SIGKILL this process (what ``kill -9`` does)."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover


def _key_kind(key: str) -> str:
    if key == POINTER_KEY:
        return "pointer"
    if key == "lock.json":
        return "lock"
    return key.split("/", 1)[0] if "/" in key else "other"


class HookBucket(LocalBucket):
    """A local bucket that kills its own process at a chosen point.

    ``kill=(event, n)`` fires at the n-th occurrence of ``event``:

    * ``lock``: before writing the run lock;
    * ``mid-delta``: halfway through writing a delta (a partial temporary file is left);
    * ``before-pointer``: after the data of a publish, before the pointer;
    * ``mid-shard``: halfway through writing an anchor shard;
    * ``after-shard``: after an anchor shard, before the next shard or the pointer;
    * ``after-pointer``: after the pointer, before retention deletes anything;
    * ``mid-delete``: after deleting half of what retention drops;
    * ``mid-download``: halfway through downloading an anchor shard, or before a delta arrives (subscriber).
    """

    def __init__(self, root: str | Path, kill: tuple[str, int] | None = None) -> None:
        super().__init__(root)
        self.kill_event, self.kill_nth = kill if kill else (None, 0)
        self.counts: collections.Counter = collections.Counter()

    def hit(self, event: str) -> None:
        """Count an occurrence of ``event``; die if it is the chosen one."""
        self.counts[event] += 1
        if event == self.kill_event and self.counts[event] == self.kill_nth:
            die()

    def _due(self, event: str) -> bool:
        """Whether the next occurrence of ``event`` is the one to die at."""
        return event == self.kill_event and self.counts[event] + 1 == self.kill_nth

    def _partial_write(self, key: str, data: bytes) -> None:
        """What a writer killed mid-upload leaves: a partial temporary file next to the target."""
        path = self.root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, _ = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.write(fd, data[: len(data) // 2])

    def put(self, key: str, data: bytes) -> None:
        kind = _key_kind(key)
        if kind == "deltas":
            if self._due("mid-delta"):
                self._partial_write(key, data)
            self.hit("mid-delta")
        elif kind == "lock":
            self.hit("lock")
        elif kind == "pointer":
            self.hit("before-pointer")
        super().put(key, data)
        if kind == "pointer":
            self.hit("after-pointer")

    def put_file(self, key: str, path: str | Path) -> None:
        if self._due("mid-shard"):
            self._partial_write(key, Path(path).read_bytes())
        self.hit("mid-shard")
        super().put_file(key, path)
        self.hit("after-shard")

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self._due("mid-delete"):
            super().delete(keys[: len(keys) // 2])
        self.hit("mid-delete")
        super().delete(keys)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        if _key_kind(key) == "deltas":
            self.hit("mid-download")
        return super().get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        if self._due("mid-download"):
            data = super().get(key)
            Path(f"{path}.part").write_bytes(data[: len(data) // 2])
        self.hit("mid-download")
        super().get_file_limited(key, path, max_bytes)


def _child(target: Callable[[dict[str, Any]], None], cfg: dict[str, Any]) -> None:
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
        logging.getLogger("benchmarks.soak.child").error("child failed:\n%s", traceback.format_exc())
        os._exit(1)


def publisher_loop(cfg: dict[str, Any]) -> None:
    """Publish versions up to ``cfg["final"]``, resuming whatever the bucket holds."""
    journal = Journal(cfg["journal"])
    bucket = HookBucket(cfg["root"], cfg.get("kill"))
    pub = Publisher(
        bucket, policy=FixedInterval(cfg["interval"]), keep_anchors=cfg["keep"], max_shard_bytes=SHARD_BYTES,
        owner=cfg["owner"], follow_control=False, lock_ttl_s=cfg.get("lock_ttl_s", 600.0),
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
    _child(publisher_loop, cfg)


def subscriber_loop(cfg: dict[str, Any]) -> None:
    """Follow the bucket until version ``cfg["final"]``, journaling every applied state's recomputed hash."""
    journal = Journal(cfg["journal"])
    kill = cfg.get("kill")
    bucket = HookBucket(cfg["root"], kill if kill and kill[0] == "mid-download" else None)
    if kill and kill[0] == "mid-apply":  # die while the patched tensors are being hashed
        real, calls = subscriber_module.tensor_digest, [0]

        def digest_then_die(tensor: torch.Tensor) -> bytes:
            calls[0] += 1
            if calls[0] == kill[1]:
                die()
            return real(tensor)

        subscriber_module.tensor_digest = digest_then_die
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
    _child(subscriber_loop, cfg)


_CONTEXT: multiprocessing.context.BaseContext | None = None


def mp_context(preload: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """A forkserver context with torch and the library preloaded, so a child starts in milliseconds.

    Args:
        preload: More modules to preload (only the first call, before the server starts, counts).
    """
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "shared.protocol", "shared.protocol.verify", "benchmarks.soak", *preload])
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


def _log_tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text()[-n:]
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------
# trial: kill -9 the publisher


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


def _plan_kills(
    rng: random.Random, kills: list[tuple[str, int | None]] | None, modes: list[str], nth: dict
) -> list[tuple[str, int | None]]:
    """The kill of each life but the last: given, or 1-3 random ``(mode, n)``."""
    if kills is None:
        kills = [(m, None) for m in (rng.choice(modes) for _ in range(rng.randint(1, 3)))]
    return [(m, n if n is not None or m == "random" else rng.randint(*nth[m])) for m, n in kills]


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
    plan = _plan_kills(rng, kills, PUBLISHER_KILLS, _KILL_NTH)
    pointer_step: int | None = None
    life = 0
    while True:
        life += 1
        mode, nth = plan[life - 1] if life <= len(plan) else (None, None)
        kill = (mode, nth) if mode and mode != "random" else None
        journal = workdir / f"pub-{life}.jsonl"
        cfg = dict(base, journal=str(journal), log=str(workdir / f"pub-{life}.log"), kill=kill)
        proc = spawn(publisher_child, cfg)
        if mode == "random":
            time.sleep(rng.uniform(0.0, 0.4))
            proc.kill()
        code = wait_for(proc)
        events = read_journal(journal)
        killed = code == -signal.SIGKILL
        if killed:
            result.faults[f"kill -9 {mode}"] += 1
        elif code != 0:
            result.fail(f"publisher life {life} exited with {code}: {_log_tail(Path(cfg['log']))}")
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
            _verify(bucket, result, f"after publisher life {life} ({mode or 'clean exit'})")
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


# ---------------------------------------------------------------------------
# trial: kill -9 a subscriber


SUBSCRIBER_KILLS = ["random", "mid-download", "before-apply", "mid-apply"]
_SUB_NTH = {"mid-download": (1, 6), "before-apply": (1, 8), "mid-apply": (1, 40)}


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
            follow_control=False,
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
    plan = _plan_kills(rng, kills, SUBSCRIBER_KILLS, _SUB_NTH)
    lives: list[Path] = []
    life = 0
    while True:
        life += 1
        mode, nth = plan[life - 1] if life <= len(plan) else (None, None)
        kill = (mode, nth) if mode and mode != "random" else None
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
            result.fail(f"subscriber life {life} exited with {code}: {_log_tail(Path(cfg['log']))}")
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


# ---------------------------------------------------------------------------
# trial: an exception in the middle of apply


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
    pub = Publisher(bucket, policy=FixedInterval(rng.randint(3, 8)), owner="soak", follow_control=False)
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
            before = (sub.step, sub.state_hash, state_hash(sub.state), dict(sub._digests))
            how = rng.choice(["digest raises", "patch iteration raises", "KeyboardInterrupt"])
            k = rng.randint(0, len(update.patches) - 1)
            exc: BaseException = KeyboardInterrupt() if how == "KeyboardInterrupt" else RuntimeError("injected")
            patches = update.patches
            real, calls = subscriber_module.tensor_digest, [0]

            def digest_raises(tensor: torch.Tensor, calls=calls, k=k, exc=exc, real=real) -> bytes:
                calls[0] += 1
                if calls[0] > k:
                    raise exc
                return real(tensor)

            if how == "patch iteration raises":
                update.patches = _RaisingPatches(patches, k, exc)
            else:
                subscriber_module.tensor_digest = digest_raises
            try:
                sub.apply(update)
                result.fail(f"apply did not raise the injected {how}")
            except (RuntimeError, KeyboardInterrupt):
                pass
            finally:
                subscriber_module.tensor_digest = real
                update.patches = patches
            result.faults[f"apply interrupted: {how}"] += 1
            after = (sub.step, sub.state_hash, state_hash(sub.state), dict(sub._digests))
            result.check(
                after == before, f"state after an interrupted apply of {update.step} is not the previous state"
            )
            result.check(not sub.needs_resync, "an interrupted apply made the subscriber wait for an anchor")
        sub.apply(update)
        ledger.check_state(sub.step, sub.state, sub.state_hash, "subscriber")
    result.check(sub.step == final, f"subscriber ended at {sub.step}")
    return result


# ---------------------------------------------------------------------------
# trial: damage in the bucket


DAMAGE = ["delete-delta", "flip-delta", "truncate-delta", "replay-old-delta", "pointer-missing-delta",
          "delete-anchor-shard", "flip-anchor-shard", "truncate-anchor-shard", "pointer-missing-anchor", "garble-pointer"]  # fmt: skip


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out))
        out[i] ^= rng.randint(1, 255)
    return bytes(out)


def _edit_pointer(bucket: LocalBucket, edit: Callable[[dict], None]) -> None:
    doc = json.loads(bucket.get(POINTER_KEY))
    edit(doc)
    bucket.put(POINTER_KEY, json.dumps(doc).encode())


def checked_sync(sub: Subscriber, ledger: Ledger, where: str, rounds: int = 50) -> int:
    """Fetch and apply until nothing changes, checking the whole state after every apply, and that
    every refused update left the state exactly as it was.

    Returns:
        Updates refused.
    """
    refused = 0
    for _ in range(rounds):
        before = (sub.step, sub.state_hash, state_hash(sub.state))
        try:
            update = sub.fetch()
            if update is None:
                break
            sub.apply(update)
        except SyncError:
            refused += 1
            ledger.result.check(
                (sub.step, sub.state_hash, state_hash(sub.state)) == before,
                f"{where}: a refused update changed the state",
            )
            break
        ledger.check_state(sub.step, sub.state, sub.state_hash, where)
    return refused


def trial_bucket_damage(rng: random.Random, workdir: Path, damage: str | None = None) -> TrialResult:
    """Damage one object; followers refuse it, keep their state, and recover at the next anchor."""
    result = TrialResult("bucket_damage")
    bucket = LocalBucket(workdir / "bucket")
    ledger = Ledger(result)
    interval = rng.randint(3, 6)
    pub = Publisher(
        bucket,
        policy=FixedInterval(interval),
        keep_anchors=3,
        max_shard_bytes=SHARD_BYTES,
        owner="soak",
        follow_control=False,
    )
    master = toy_master(rng.randrange(1000))
    follower = Subscriber(bucket)
    step = 0

    def publish_next() -> None:
        nonlocal step
        if step:
            toy_step(master, step)
        rec = pub.publish(step, master)
        ledger.record(rec.step, rec.state_hash, "publisher")
        step += 1

    for _ in range(rng.randint(2, 2 * interval)):
        publish_next()
        checked_sync(follower, ledger, "follower")
    damage = damage or rng.choice(DAMAGE)
    manifest = read_manifest(bucket)
    assert manifest is not None
    if "delta" in damage:  # make sure a delta exists past the follower
        while manifest.delta_after(follower.step) is None:
            publish_next()
            manifest = read_manifest(bucket)
            if manifest.newest_anchor.step == manifest.step:
                checked_sync(follower, ledger, "follower")
        target = manifest.delta_after(follower.step)
        key = target.file.key
    else:
        publish_next()  # one version the follower has not applied yet
        manifest = read_manifest(bucket)
        shards = manifest.newest_anchor.files
        key = rng.choice(shards).key
    data = bucket.get(key)
    if damage.startswith("delete"):
        bucket.delete([key])
    elif damage.startswith("flip"):
        bucket.put(key, _flip(data, rng))
    elif damage.startswith("truncate"):
        bucket.put(key, data[: rng.randrange(len(data))])
    elif damage == "replay-old-delta":
        older = [d for d in manifest.deltas if d.step < target.step]
        if older:
            old = bucket.get(rng.choice(older).file.key)
        else:  # no older delta retained: replay the newest one over this one instead
            old = (
                bucket.get(manifest.deltas[-1].file.key)
                if manifest.deltas[-1].step != target.step
                else _flip(data, rng)
            )
        bucket.put(key, old)
        _edit_pointer(
            bucket, lambda doc: [d["file"].update(size=len(old)) for d in doc["deltas"] if d["file"]["key"] == key]
        )
    elif damage == "pointer-missing-delta":
        _edit_pointer(
            bucket,
            lambda doc: [
                d["file"].update(key="deltas/999999999999.safetensors")
                for d in doc["deltas"]
                if d["file"]["key"] == key
            ],
        )
    elif damage == "pointer-missing-anchor":
        _edit_pointer(bucket, lambda doc: [f.update(key=f"{f['key'].rsplit('/', 1)[0]}/missing.safetensors")
                                           for a in doc["anchors"] for f in a["files"] if f["key"] == key])  # fmt: skip
    elif damage == "garble-pointer":
        raw = bucket.get(POINTER_KEY)
        bucket.put(POINTER_KEY, rng.choice([raw[: rng.randrange(len(raw))], _flip(raw, rng), b"\x00" * 64]))
    result.faults[damage] += 1
    refused = checked_sync(follower, ledger, "follower after damage")
    newcomer = Subscriber(bucket)
    refused += checked_sync(newcomer, ledger, "newcomer after damage")
    if not refused:  # e.g. flipped padding in a header, or a pointer edit that kept it valid
        result.notes["damage no reader noticed (states still exact)"] += 1
    # the publisher goes on; past the next anchor everyone is bit-exact again
    target_step = step + interval + 1
    while step <= target_step:
        publish_next()
    for sub, name in ((follower, "follower"), (newcomer, "newcomer"), (Subscriber(bucket), "late joiner")):
        checked_sync(sub, ledger, name)
        result.check(sub.step == step - 1, f"{name} ended at {sub.step} after {damage}, newest is {step - 1}")
    return result


# ---------------------------------------------------------------------------
# trial: flaky storage


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
    unreadable = collections.Counter()

    def follow(i: int, sub: Subscriber) -> None:
        deadline = time.time() + CHILD_TIMEOUT_S
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
    publisher.join(CHILD_TIMEOUT_S)
    for t in threads:
        t.join(CHILD_TIMEOUT_S)
    result.check(publisher.error is None, f"publisher failed: {publisher.error!r}")
    for i, sub in enumerate(subs):
        result.check(sub.step == final, f"subscriber {i} ended at {sub.step}, not {final}")
        ledger.check_state(sub.step, sub.state, sub.state_hash, f"subscriber {i} at the end")
    ledger.settle()
    ledger.observe(raw)
    _verify(raw, result, "after the flaky run")
    for _, faulty in stacks:
        for kind, n in faulty.injected.items():
            if n:
                result.faults[f"flaky: {kind}"] += n
    if publisher.retries:
        result.faults["flaky: publish retried after retries ran out"] += publisher.retries
    if unreadable:
        result.faults["flaky: pointer seen cut short (refused)"] += sum(unreadable.values())
    return result


# ---------------------------------------------------------------------------
# trial: two trainers


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
            result.fail(f"trainer a did not publish: {_log_tail(Path(a_cfg['log']))}")
            a.kill()
            return result
        time.sleep(0.01)
    # another owner is refused while a's lock is fresh
    b, _, b_cfg = start("b", "trainer-b", 10_000)
    code = wait_for(b)
    result.faults["second trainer started"] += 1
    result.check(
        code == EXIT_REFUSED, f"a second trainer was not refused (exit {code}): {_log_tail(Path(b_cfg['log']))}"
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
        code_a == EXIT_FENCED, f"the taken-over trainer was not fenced (exit {code_a}): {_log_tail(Path(a_cfg['log']))}"
    )
    result.check(code_c == 0, f"the new trainer failed (exit {code_c}): {_log_tail(Path(c_cfg['log']))}")
    a_events, c_events = read_journal(a_journal), read_journal(c_journal)
    for name in ("a", "c", "c2"):
        for e in read_journal(workdir / f"{name}.jsonl"):
            if e["event"] == "published":
                ledger.record(e["step"], e["hash"], f"trainer {name}")
    manifest = ledger.observe(bucket)
    _verify(bucket, result, f"after a takeover ({how})")
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


TRIALS: dict[str, Callable[[random.Random, Path], TrialResult]] = {
    "publisher_kill": trial_publisher_kill,
    "subscriber_kill": trial_subscriber_kill,
    "apply_interrupt": trial_apply_interrupt,
    "bucket_damage": trial_bucket_damage,
    "flaky_storage": trial_flaky_storage,
    "two_trainers": trial_two_trainers,
}


def run_trial(kind: str, seed: int, root: Path, **kwargs: Any) -> TrialResult:
    """Run one trial of ``kind`` with its own seed in a fresh folder under ``root`` (removed if it passed)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{kind}-{seed}-", dir=root))
    t0 = time.perf_counter()
    try:
        result = TRIALS[kind](random.Random(seed), workdir, **kwargs)
    except Exception:
        result = TrialResult(kind)
        result.fail(f"trial crashed (seed {seed}):\n{traceback.format_exc()}")
    result.seconds = time.perf_counter() - t0
    if result.violations:
        logger.error("%s seed %d failed; files kept in %s", kind, seed, workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------
# summary


def summarize(results: list[TrialResult]) -> dict[str, Any]:
    """Totals by kind: trials, faults injected by name, states lost, invariant checks and violations."""
    out: dict[str, Any] = {"kinds": {}, "trials": len(results), "lost": 0, "violations": 0, "checks": 0}
    for r in results:
        k = out["kinds"].setdefault(
            r.kind,
            {
                "trials": 0,
                "faults": collections.Counter(),
                "notes": collections.Counter(),
                "lost": 0,
                "violations": [],
                "checks": 0,
                "seconds": 0.0,
            },
        )
        k["trials"] += 1
        k["faults"].update(r.faults)
        k["notes"].update(r.notes)
        k["lost"] += r.lost
        k["violations"] += r.violations
        k["checks"] += r.checks
        k["seconds"] += r.seconds
        out["lost"] += r.lost
        out["violations"] += len(r.violations)
        out["checks"] += r.checks
    for k in out["kinds"].values():
        k["faults"] = dict(sorted(k["faults"].items()))
        k["notes"] = dict(sorted(k["notes"].items()))
    return out


def format_table(summary: dict[str, Any], wall_s: float) -> str:
    lines = [f"{'kind':<16} {'trials':>6} {'faults':>7} {'lost':>5} {'violations':>10} {'checks':>7} {'s/trial':>8}"]
    for kind, k in summary["kinds"].items():
        lines.append(
            f"{kind:<16} {k['trials']:>6} {sum(k['faults'].values()):>7} {k['lost']:>5} {len(k['violations']):>10} "
            f"{k['checks']:>7} {k['seconds'] / max(k['trials'], 1):>8.2f}"
        )
    lines.append(f"{'total':<16} {summary['trials']:>6} {sum(sum(k['faults'].values()) for k in summary['kinds'].values()):>7} "
                 f"{summary['lost']:>5} {summary['violations']:>10} {summary['checks']:>7}   wall {wall_s:.0f}s")  # fmt: skip
    lines.append("")
    lines.append("faults injected, by kind:")
    for kind, k in summary["kinds"].items():
        for name, n in k["faults"].items():
            lines.append(f"  {kind:<16} {name:<48} {n:>6}")
    notes = [(kind, name, n) for kind, k in summary["kinds"].items() for name, n in k["notes"].items()]
    if notes:
        lines.append("")
        lines.append("observed (not faults, not violations):")
        lines += [f"  {kind:<16} {name:<48} {n:>6}" for kind, name, n in notes]
    violations = [(kind, v) for kind, k in summary["kinds"].items() for v in k["violations"]]
    if violations:
        lines.append("")
        lines.append("violations:")
        lines += [f"  {kind}: {v.splitlines()[0][:300]}" for kind, v in violations[:50]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="trials of every kind (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_TRIALS.items()) + ")",
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary as JSON to this file")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where trial buckets go (default: a temporary folder)"
    )
    parser.add_argument(
        "--log-level", default="CRITICAL", help="library log level (refusals are logged as errors by design)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.WARNING)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="rlsync-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    seeds = random.Random(args.seed)
    plan = [
        (kind, seeds.randrange(2**31))
        for kind in args.kinds
        for _ in range(args.trials if args.trials is not None else DEFAULT_TRIALS[kind])
    ]
    t0 = time.perf_counter()
    results = []
    for i, (kind, seed) in enumerate(plan, 1):
        result = run_trial(kind, seed, root)
        results.append(result)
        status = "ok" if not result.violations and not result.lost else f"FAILED ({len(result.violations)} violations)"
        print(
            f"[{i:>4}/{len(plan)}] {kind:<16} seed {seed:<10} {result.seconds:6.2f}s {status}",
            file=sys.stderr,
            flush=True,
        )
    wall = time.perf_counter() - t0
    summary = summarize(results)
    summary["wall_s"] = wall
    print(format_table(summary, wall))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if not args.workdir and not summary["violations"]:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if summary["lost"] or summary["violations"] else 0


if __name__ == "__main__":
    from benchmarks.soak import main as _main  # children pickle functions of benchmarks.soak, not of __main__

    sys.exit(_main())
