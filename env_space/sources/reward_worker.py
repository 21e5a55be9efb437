"""Reward functions run in a child process that is killed when a call overstays.

A thread cannot be stopped: a reward function stuck in a CPU loop (a pathological
expression handed to a symbolic verifier, an endless ``while``) would keep a core
busy for good. :class:`RewardWorker` runs the calls in one persistent child process
(``python -m env_space.sources.reward_worker``: a fresh interpreter that imports only
the reward functions, not the Space's app), waits at most the bound for each answer,
and on a timeout kills the child and starts a new one in the background for the
next call (the first child starts with the worker, outside any call's bound). A
crash of the child (segfault, ``os._exit``) fails that call only. The child loads the
functions by name itself (built-ins or dotted paths,
:func:`~env_space.sources.rewards.load_reward`, with the parent's ``sys.path``), so
only the call's arguments and the returned values travel, pickled, over a socket
pair. Once the functions are loaded the child confines itself
(:func:`env_space.isolation.confine`: no inherited descriptors, no network, 2 GiB of
address space more, no new processes, no file writes), so a reward function reads
completion text without the env's bucket connections or token.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from env_space.bounded import BoundedResult

__all__ = ["RewardWorker"]

logger = logging.getLogger(__name__)
_MEMORY_MB = 2048  # address space a worker may add once its functions are loaded


def _serve(conn: Connection) -> None:
    """The child: receive the setup, load the functions, say ready, then answer calls until the parent leaves."""
    from env_space.isolation import confine
    from env_space.sources.rewards import load_reward

    names, answer_column, answer_tag = conn.recv()
    functions = {name: load_reward(name, answer_column=answer_column, answer_tag=answer_tag) for name in names}
    confine([conn.fileno()], memory_mb=_MEMORY_MB, network=False, cpu_s=None)
    conn.send(("ready", None))
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:  # the parent went away
            return
        try:
            reply: tuple[str, Any] = ("ok", functions[name](**kwargs))
        except BaseException as exc:  # noqa: BLE001 - user code: anything it raises is a failure
            reply = ("error", f"error:{type(exc).__name__}")
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a returned value that does not pickle
            conn.send(("error", f"error:{type(exc).__name__}"))


class RewardWorker:
    """Runs reward functions by name in a child process, one call at a time, each bounded in time.

    Args:
        names: The reward functions (built-in names or dotted paths), loaded once per child.
        answer_column: Passed to the built-in rewards.
        answer_tag: Passed to the built-in rewards.
        start_timeout_s: Time a new child may take to start and load the functions (not part of any call's bound).
    """

    def __init__(
        self, names: list[str], answer_column: str = "answer", answer_tag: str = "answer", start_timeout_s: float = 120
    ) -> None:
        self.setup = (list(names), answer_column, answer_tag)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        with self._lock:
            self._start()

    def _start(self) -> Connection | None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        command = [sys.executable, "-m", "env_space.sources.reward_worker", str(theirs.fileno())]
        self._process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        weakref.finalize(self, self._process.kill)  # a worker dropped without close() takes its child along
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(self.setup)
            if self._conn.poll(self.start_timeout_s) and self._conn.recv()[0] == "ready":
                return self._conn
        except (EOFError, OSError):
            pass
        logger.warning("the reward worker process did not start within %.0fs", self.start_timeout_s)
        self._kill()
        return None

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def _replace_in_background(self) -> None:
        """Kill the child now; start the next one on a thread (the next call waits for it)."""
        self._kill()
        self.restarts += 1

        from rlsync.supervised import SupervisedThread  # here: the child imports this module, and little else

        def start() -> None:
            with self._lock:
                if self._process is None:
                    self._start()

        SupervisedThread(start, name="reward-worker-start", restart=False).start()

    def call(self, name: str, timeout_s: float, **kwargs: Any) -> BoundedResult:
        """Call the reward function ``name`` with ``kwargs`` in the child, waiting at most ``timeout_s``.

        Returns:
            ``BoundedResult(value)``, or a failure: ``"timeout"`` (the child is killed), ``"worker_died"``,
            ``"worker_did_not_start"``, or ``"error:<ExceptionType>"`` raised by the function (or by pickling
            its arguments or result).
        """
        with self._lock:
            alive = self._process is not None and self._process.poll() is None
            conn = self._conn if alive else None
            if conn is None:
                self._kill()
                conn = self._start()
                if conn is None:
                    return BoundedResult(failure="worker_did_not_start")
            try:
                conn.send((name, kwargs))
            except Exception as exc:  # noqa: BLE001 - arguments that do not pickle, or a dead child
                self._kill()
                return BoundedResult(failure=f"error:{type(exc).__name__}")
            if not conn.poll(timeout_s):
                logger.warning("reward %s overstayed %.1fs: killing its worker process", name, timeout_s)
                self._replace_in_background()
                return BoundedResult(failure="timeout")
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._replace_in_background()
                return BoundedResult(failure="worker_died")
        return BoundedResult(value) if status == "ok" else BoundedResult(failure=value)

    def close(self) -> None:
        """Stop the child process."""
        with self._lock:
            self._kill()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
