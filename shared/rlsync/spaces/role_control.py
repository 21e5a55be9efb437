"""Role process control: :class:`RoleRunner` starts and stops the role a panel hosts in
its own process (the only in-process object a panel touches)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import ConfigurationError
from ..roles import Role
from ..supervised import SupervisedThread
from .desired import Wanted, record_wanted
from .snapshots import redact

logger = logging.getLogger(__name__)


class RoleObject(Protocol):
    """What :class:`RoleRunner` needs of a role object (Trainer, Replica, EnvSimulator)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...
    @property
    def threads(self) -> Sequence[threading.Thread]: ...


class OneThreadRole:
    """A role object whose work runs on one thread, ``_thread`` (``None`` until started): the ``running`` and
    ``threads`` of :class:`RoleObject` (the runner reads a crash from the thread)."""

    _thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def threads(self) -> list[threading.Thread]:
        return [self._thread] if self._thread is not None else []


_BUILD_LOCK = threading.Lock()


class RoleRunner:
    """Starts and stops the role objects a panel hosts, in background threads.

    Building a role (loading a model) can take a while, so :meth:`start` builds
    and starts it in a thread and returns at once; :attr:`state` tells where it is.

    Args:
        name: The role, shown in status lines and the controls' labels.
        build: ``build(config) -> list of role objects`` (one, or several replicas). ``config`` is the role's
            settings dataclass, recorded in the bucket at a Start (:mod:`.desired`).
    """

    def __init__(self, name: Role, build: Callable[[Any], Sequence[RoleObject]]) -> None:
        self.name = name
        self._build = build
        self.objects: list[RoleObject] = []
        self.config: Any = None
        self.error = ""
        self._starting = False
        self._stopped = False
        self._stopper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._recording = threading.Lock()  # orders the desired-state writes of a Start and a Stop

    @property
    def running(self) -> bool:
        return any(o.running for o in self.objects)

    @property
    def state(self) -> str:
        if self._starting:
            return "starting"
        if self._stopper is not None and self._stopper.is_alive():
            return "stopping"
        if self.running:
            return "running"
        if self.error or self.crash:
            return "failed"
        return "finished" if self.objects and not self._stopped else "stopped"

    @property
    def crash(self) -> str:
        """Why a role's thread ended with an exception, redacted ("" when none did, or after a Stop)."""
        if self._stopped:
            return ""
        for obj in self.objects:
            for thread in getattr(obj, "threads", ()):
                if isinstance(thread, SupervisedThread) and thread.error and not thread.is_alive():
                    return redact(thread.error)
        return ""

    def start(self, config: Any, wait: bool = False, record: bool = True) -> str:
        """Build the role objects from ``config`` and start them (in a background thread).

        Args:
            config: The role's config dataclass.
            wait: Block until started (or failed).
            record: Once started, record in the bucket that the owner wants it running, with ``config``
                (:mod:`.desired`: a restart resumes it); ``False`` for the resume at boot itself.

        Returns:
            A status line.
        """
        with self._lock:
            if self._starting or self.running or self.state == "stopping":
                return f"**{self.name}** is {self.state}; not started again."
            self._starting = True
            self._stopped = False
            self.error = ""
            self.config = config
        thread = SupervisedThread(self._start, args=(config, record), name=f"start-{self.name}", restart=False)
        thread.start()
        if wait:
            thread.join()
        return self.status()

    def _start(self, config: Any, record: bool) -> None:
        t0 = time.perf_counter()
        objects: list[Any] = []
        try:
            with _BUILD_LOCK:  # one build at a time: transformers' lazy imports are not thread-safe
                objects = list(self._build(config))
            if self._stopped:  # Stop was pressed while building
                logger.info("%s: start cancelled", self.name)
                _close(objects)
                return
            for obj in objects:
                obj.start()
            self.objects = objects
            logger.info("%s started (%d object(s)) in %.1fs", self.name, len(objects), time.perf_counter() - t0)
        except Exception as exc:  # shown in the panel; the panel keeps working
            # a refused setting's message is the line to show; anything else is named by its type
            self.error = redact(str(exc) if isinstance(exc, ConfigurationError) else f"{type(exc).__name__}: {exc}")
            logger.error("%s failed to start: %s", self.name, redact(traceback.format_exc()))
            _close(objects)  # nothing of a failed start keeps running or holds its model
            return
        finally:
            self._starting = False
        with self._recording:  # a Stop pressed meanwhile records after this, or this sees it and records nothing
            if record and not self._stopped:
                record_wanted(self.name, Wanted.RUNNING, config, objects)

    def stop(self, wait: bool = True, record: bool = True) -> str:
        """Stop the role objects; returns a status line.

        Args:
            wait: Wait for their threads to end; otherwise stop them in a background
                thread (the state reads "stopping" meanwhile), as the panel's Stop does.
            record: Record in the bucket that the owner wants it stopped (:mod:`.desired`: a restart leaves it
                stopped); ``False`` for a stop the owner did not ask for (the runtime's SIGTERM before a restart).
        """
        self._stopped = True
        objects, config = list(self.objects), self.config

        def stop_all() -> None:
            if record:
                with self._recording:
                    record_wanted(self.name, Wanted.STOPPED, config, objects)
            _close(objects)
            logger.info("%s stopped", self.name)

        if wait:
            stop_all()
        else:
            self._stopper = SupervisedThread(stop_all, name=f"stop-{self.name}", restart=False)
            self._stopper.start()
        return self.status()

    def status(self) -> str:
        """One status line."""
        line = f"**{self.name}**: {self.state}"
        if reason := self.error or self.crash:
            line += f": {reason}"
        return line


def _close(objects: list[Any]) -> None:
    """Close (else stop) each role object: close() also releases engines (GPU memory) and background
    workers; Start builds new objects. One that fails to close is logged; the others are still closed."""
    for obj in objects:
        try:
            getattr(obj, "close", obj.stop)()
        except Exception:  # noqa: BLE001 - the others must still be closed
            logger.exception("closing %s failed", type(obj).__name__)
