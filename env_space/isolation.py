"""Running scoring code in a confined child process: bounded in time, memory and network.

Scorers read completion text that any replica wrote, and some hand it to an evaluator
(sympy's ``parse_expr``, Python's ``eval``). A thread cannot stop a computation that
holds the GIL (``9**9**9**9``), and code that runs in the env's own process holds its
bucket token. :func:`run_confined` starts a child for a list of items, which calls the
function on each in turn and sends each result back; the parent waits at most
``timeout_s`` per item and ``budget_s`` for all of them, kills the child when either
runs out, and starts a new one for the items after an item that overstayed.

The children are never forks of the env's process, which runs threads (the bucket's
watch, the panel, hf_xet's runtime): a fork of it could inherit a lock another thread
held, or C++ thread state whose destructor waits on threads the child does not have.
They are forked from a helper process (multiprocessing's fork server,
:func:`start_scoring_server`) that is a fresh interpreter, started by ``fork`` + ``exec``
and running no thread of its own, with this module and the environment's modules
(:func:`modules_of`) imported once. The function and its items travel pickled
(``cloudpickle``: closures and lambdas work; what they capture must pickle, a value that
does not fails every item ``"error:<ExceptionType>"``).

The child confines itself first (:func:`confine`): it closes every inherited file
descriptor but its result pipe (the parent's bucket connections and sockets), reads
``/dev/null`` as stdin, drops secret-looking environment variables, leaves the network
(a new network namespace; where the kernel refuses, Python's sockets refuse to connect),
and sets limits: address space (``memory_mb`` above what it inherited), CPU seconds,
no new processes or threads, no file writes. Files the child could create are not
prevented (``touch`` of an empty file still works): keeping code from reaching an
evaluator at all is :mod:`env_space.sources.evaluators`' job; this module bounds what
gets through. :func:`call_bounded` is one such call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn as spawn
import os
import resource
import socket
import time
import types
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle

from .bounded import BoundedResult, ScoringFailure

__all__ = ["Confinement", "call_bounded", "confine", "modules_of", "run_confined", "start_scoring_server"]

logger = logging.getLogger(__name__)

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL", "AUTH")
#: Scoring children are forked from multiprocessing's fork server, never from the env's process.
_CONTEXT = multiprocessing.get_context("forkserver")
_PROCESS_NAME = "rlsync-scoring"
#: Longest a scoring child may take to start (load the function, confine itself): apart from the items' bounds.
START_TIMEOUT_S = 60.0
_READY = ("ready", None)


@dataclasses.dataclass(frozen=True)
class Confinement:
    """Bounds of one :func:`run_confined` call.

    Args:
        timeout_s: Seconds each item may take.
        budget_s: Seconds all items together may take (items left when it runs out fail ``"budget"``).
        memory_mb: Address space the child may allocate above what it inherited.
        network: Leave the network reachable (for scorers that are remote calls).
    """

    timeout_s: float
    budget_s: float
    memory_mb: int = 2048
    network: bool = False


def _leave_network() -> str:
    """Enter a new, empty network namespace; failing that, make Python's sockets refuse to connect."""
    libc = ctypes.CDLL(None, use_errno=True)
    for flags, how in ((_CLONE_NEWNET, "netns"), (_CLONE_NEWUSER | _CLONE_NEWNET, "userns")):
        if libc.unshare(flags) == 0:
            return how

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("no network while scoring")

    for name in ("connect", "connect_ex", "sendto", "bind"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]
    return "python"


def confine(keep_fds: Sequence[int], *, memory_mb: int | None, network: bool, cpu_s: float | None) -> str:
    """Confine the calling (single-purpose, child) process. Irreversible.

    Args:
        keep_fds: File descriptors to keep open besides 0-2 (the result channel).
        memory_mb: Address space it may add to what it has (``None``: unbounded).
        network: Keep network access.
        cpu_s: CPU seconds before the kernel kills it (``None``: unbounded; a persistent worker).

    Returns:
        How the network was left: ``"netns"``, ``"userns"``, ``"python"``, or ``"kept"``.
    """
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    keep = {0, 1, 2, *keep_fds}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor
    for name in [k for k in os.environ if any(w in k.upper() for w in _SECRET_WORDS)]:
        del os.environ[name]
    how = "kept" if network else _leave_network()
    if memory_mb is not None:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        limit = size + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if cpu_s is not None:  # on top of what loading the function took
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    return how


def _reply(fn: Callable[[Any], Any], item: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(item)
    except ScoringFailure as exc:
        return "error", exc.reason
    except BaseException as exc:  # noqa: BLE001 - scoring code: anything it raises is a failure
        return "error", f"error:{type(exc).__name__}"


def start_scoring_server(preload: Sequence[str] = ()) -> None:
    """Start the helper process scoring children are forked from, if it is not running yet.

    It is a fresh interpreter (``fork`` + ``exec``: none of this process's threads or locks), with
    this module and `preload` imported once, so that a child starts in milliseconds (the env's
    ``__main__`` is never run there or in a child). Called by the env before it scores (a running
    server keeps its imports: `preload` only counts for the first call); :func:`run_confined` starts
    it itself otherwise.

    Args:
        preload: Modules the scoring functions need (e.g. the environment's).
    """
    _CONTEXT.set_forkserver_preload([__name__, *preload])
    multiprocessing.forkserver.ensure_running()


def _without_main(get: Callable[[str], dict]) -> Callable[[str], dict]:
    """multiprocessing's ``spawn.get_preparation_data``, telling a scoring child not to run the env's ``__main__``
    again (a child runs a function of this module; a function of ``__main__`` travels by value)."""

    def get_preparation_data(name: str) -> dict:
        data = get(name)
        if name == _PROCESS_NAME:
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    return get_preparation_data


spawn.get_preparation_data = _without_main(spawn.get_preparation_data)


def modules_of(obj: Any) -> list[str]:
    """The modules unpickling `obj` imports, to preload (:func:`start_scoring_server`): its own (a function's, a
    partial's and its arguments', a bound method's, an instance's class's) and those of their attributes' values
    and their items."""
    parts = (obj, getattr(obj, "func", None), getattr(obj, "__self__", None), *getattr(obj, "args", ()))
    owners = [o for o in parts if o is not None]
    found = list(owners)
    for owner in owners:
        for value in getattr(owner, "__dict__", {}).values():
            found.append(value)
            found += value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    named = (types.FunctionType, types.MethodType, type)
    modules = {getattr(v, "__module__", None) if isinstance(v, named) else type(v).__module__ for v in found}
    return sorted(m for m in modules if isinstance(m, str) and m not in ("builtins", "__main__"))


def _child(conn: Connection, payload: bytes, count: int, confinement: Confinement) -> None:
    """The scoring child: load the function and its `count` items, confine itself, answer each item, then exit."""
    code = 0
    try:
        try:
            fn, items = cloudpickle.loads(payload)
            replies = (_reply(fn, item) for item in items)
        except BaseException as exc:  # noqa: BLE001 - e.g. a module the function needs is missing here
            replies = iter([("error", f"error:{type(exc).__name__}")] * count)
        memory_mb, cpu_s = confinement.memory_mb, confinement.budget_s
        confine([conn.fileno()], memory_mb=memory_mb, network=confinement.network, cpu_s=cpu_s)
        conn.send(_READY)
        for reply in replies:
            try:
                conn.send(reply)
            except Exception as exc:  # noqa: BLE001 - e.g. a returned value that does not pickle
                conn.send(("error", f"error:{type(exc).__name__}"))
    except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
        code = 1
    finally:
        os._exit(code)  # not multiprocessing's exit path: the confined child holds none of its descriptors


def _start(payload: bytes, count: int, confinement: Confinement) -> tuple[BaseProcess, Connection]:
    start_scoring_server()
    ours, theirs = _CONTEXT.Pipe()
    args = (theirs, payload, count, confinement)
    process = _CONTEXT.Process(target=_child, args=args, name=_PROCESS_NAME, daemon=True)
    process.start()
    theirs.close()
    return process, ours


def _ready(conn: Connection) -> bool:
    """Whether the child said it is ready to score within `START_TIMEOUT_S`."""
    try:
        return conn.poll(START_TIMEOUT_S) and conn.recv() == _READY
    except (EOFError, OSError):
        return False


def _end(process: BaseProcess, conn: Connection) -> None:
    conn.close()
    process.kill()
    process.join()
    process.close()


def run_confined(fn: Callable[[Any], Any], items: Sequence[Any], confinement: Confinement) -> list[BoundedResult]:
    """Call ``fn(item)`` for each item in a confined child process (see the module docstring).

    Args:
        fn: The function; it and the items are pickled to a child forked from the fork server
            (:func:`start_scoring_server`), so closures work but what they capture must pickle.
        items: Its arguments, one call each, in order.
        confinement: Time, memory and network bounds.

    Returns:
        One result per item: ``BoundedResult(value)``, or a failure: ``"timeout"`` (the item
        overstayed ``timeout_s``), ``"budget"`` (``budget_s`` of scoring ran out first; starting a
        child is bounded apart, by ``START_TIMEOUT_S``), ``"worker_died"`` (the child crashed or was
        killed, e.g. by its memory limit), ``"worker_did_not_start"``, ``"error:<ExceptionType>"``,
        or a :class:`~env_space.bounded.ScoringFailure`'s reason.
    """
    results: list[BoundedResult] = []
    deadline = time.monotonic() + confinement.budget_s
    while len(results) < len(items):
        if time.monotonic() >= deadline:
            results += [BoundedResult(failure="budget")] * (len(items) - len(results))
            break
        rest, started = list(items[len(results) :]), time.monotonic()
        try:
            payload = cloudpickle.dumps((fn, rest))
        except Exception as exc:  # noqa: BLE001 - a function or item that does not pickle fails every item
            return results + [BoundedResult(failure=f"error:{type(exc).__name__}")] * len(rest)
        process, conn = _start(payload, len(rest), confinement)
        try:
            if not _ready(conn):
                results += [BoundedResult(failure="worker_did_not_start")] * len(rest)
                break
            deadline += time.monotonic() - started  # starting a child is not scoring time
            while len(results) < len(items):
                left = deadline - time.monotonic()
                wait = min(confinement.timeout_s, left)
                if wait <= 0 or not conn.poll(wait):
                    results.append(BoundedResult(failure="timeout" if wait < left else "budget"))
                    break
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    results.append(BoundedResult(failure="worker_died"))
                    break
                results.append(BoundedResult(value) if status == "ok" else BoundedResult(failure=value))
        finally:
            _end(process, conn)
    return results


def call_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> BoundedResult:
    """Run ``fn(*args, **kwargs)`` in a confined child process with a time bound.

    Args:
        fn: The function (user code); closures work (pickled with ``cloudpickle``), its value is pickled back.
        timeout_s: Seconds to wait for it; the child is killed then.

    Returns:
        ``BoundedResult(value)``, or a failure: ``"timeout"``, ``"worker_died"`` (e.g. its memory bound),
        ``"error:<ExceptionType>"``, or a :class:`ScoringFailure`'s reason.
    """
    result = run_confined(lambda _: fn(*args, **kwargs), [None], Confinement(timeout_s, budget_s=timeout_s * 1.5))[0]
    return BoundedResult(failure="timeout") if result.failure == "budget" else result
