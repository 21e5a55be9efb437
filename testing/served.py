"""Child processes that serve a page (a panel, a Space), for tests: started with their output in a log file, waited
for until their page answers, stopped as a runtime stops them (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM ``proc`` (a role stops and checkpoints on it), SIGKILL it after ``grace_s`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def poll_until(what: str, check: Callable[[], T], timeout: float, describe: Callable[[], str] = str, every: float = 0.5) -> T:
    """``check()``'s first truthy answer within ``timeout`` seconds.

    Raises:
        AssertionError: none came; the message names ``what`` and adds ``describe()`` (a log tail, the page).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{describe()}")


class LoggedProcess:
    """``cmd`` in a process of its own, its stdout and stderr in ``log``.

    Args:
        cmd: The command.
        cwd: Its working folder.
        env: Its whole environment.
        log: The log file.
    """

    def __init__(self, cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - held open for the process, closed in close()
        self.proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_served(self, url: str, what: str, timeout: float) -> None:
        """Wait until ``url`` answers 200.

        Raises:
            AssertionError: the process exited, or the page did not come up in time (with the log's tail).
        """

        def served() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{what} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False

        poll_until(f"{what} to serve {url}", served, timeout, self.log_tail)

    def close(self, grace_s: float = 60.0) -> None:
        """:func:`stop` the process and close its log."""
        stop(self.proc, grace_s)
        self._log.close()
