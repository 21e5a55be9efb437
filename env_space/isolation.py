"""Running scoring code in a confined child process: bounded in time, memory and network.

Scorers read completion text that any replica wrote, and some hand it to an evaluator
(sympy's ``parse_expr``, Python's ``eval``). A thread cannot stop a computation that
holds the GIL (``9**9**9**9``), and code that runs in the env's own process holds its
bucket token. :func:`run_confined` forks a child for a list of items, which calls the
function on each in turn and sends each result back; the parent waits at most
``timeout_s`` per item and ``budget_s`` for all of them, kills the child when either
runs out, and forks a new one for the items after an item that overstayed.

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
import os
import resource
import signal
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from .bounded import BoundedResult, ScoringFailure

__all__ = ["Confinement", "call_bounded", "confine", "run_confined"]

logger = logging.getLogger(__name__)

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL", "AUTH")


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
    if cpu_s is not None:
        cpu = math.ceil(cpu_s) + 1
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


def _child(conn: Connection, fn: Callable[[Any], Any], items: Sequence[Any], confinement: Confinement) -> None:
    confine(
        [conn.fileno()], memory_mb=confinement.memory_mb, network=confinement.network, cpu_s=confinement.budget_s
    )
    for item in items:
        reply = _reply(fn, item)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a returned value that does not pickle
            conn.send(("error", f"error:{type(exc).__name__}"))


def _fork(fn: Callable[[Any], Any], items: Sequence[Any], confinement: Confinement) -> tuple[int, Connection]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            ours.close()
            _child(Connection(theirs.detach()), fn, items, confinement)
        except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return pid, Connection(ours.detach())


def _end(pid: int, conn: Connection) -> None:
    conn.close()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def run_confined(fn: Callable[[Any], Any], items: Sequence[Any], confinement: Confinement) -> list[BoundedResult]:
    """Call ``fn(item)`` for each item in a confined child process (see the module docstring).

    Args:
        fn: The function; it runs in a forked child, so closures work and nothing but its
            return value is pickled.
        items: Its arguments, one call each, in order.
        confinement: Time, memory and network bounds.

    Returns:
        One result per item: ``BoundedResult(value)``, or a failure: ``"timeout"`` (the item
        overstayed ``timeout_s``), ``"budget"`` (``budget_s`` ran out first), ``"worker_died"``
        (the child crashed or was killed, e.g. by its memory limit), ``"error:<ExceptionType>"``,
        or a :class:`~env_space.bounded.ScoringFailure`'s reason.
    """
    results: list[BoundedResult] = []
    deadline = time.monotonic() + confinement.budget_s
    while len(results) < len(items):
        if time.monotonic() >= deadline:
            results += [BoundedResult(failure="budget")] * (len(items) - len(results))
            break
        pid, conn = _fork(fn, items[len(results) :], confinement)
        try:
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
            _end(pid, conn)
    return results


def call_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> BoundedResult:
    """Run ``fn(*args, **kwargs)`` in a confined child process with a time bound.

    Args:
        fn: The function (user code); closures work (the child is forked), only its value is pickled back.
        timeout_s: Seconds to wait for it; the child is killed then.

    Returns:
        ``BoundedResult(value)``, or a failure: ``"timeout"``, ``"worker_died"`` (e.g. its memory bound),
        ``"error:<ExceptionType>"``, or a :class:`ScoringFailure`'s reason.
    """
    result = run_confined(lambda _: fn(*args, **kwargs), [None], Confinement(timeout_s, budget_s=timeout_s * 1.5))[0]
    return BoundedResult(failure="timeout") if result.failure == "budget" else result
