"""Publishing off the training step: the step stalls only to cast its weights into a staging buffer.

:class:`BackgroundPublisher` runs a :class:`~rlsync.protocol.Publisher` on a worker thread.
:meth:`~BackgroundPublisher.stage` (the trainer's thread) casts each tensor to the serving dtype
into a staging buffer and returns; the worker then detects the changes against the last
*published* state, hashes, encodes and uploads, and writes the pointer last, while the next
step computes.

- **Bounded.** At most one publish is in flight and one version waits in the staging buffer.
  The worker reads the buffer only during change detection and then releases it (an anchor
  keeps it, and the next stage allocates a new one), so a stage waits at most for one detection.
- **Coalescing.** A stage while a version still waits replaces it: the new version is one delta
  against the last published state, which includes the replaced one's changes, so nothing is
  lost; its version number is skipped (deltas chain by their base version) and counted in
  :attr:`BackgroundPublisher.coalesced`.
- **Crash safe.** The publish itself is the :class:`Publisher`'s: data objects first, the
  pointer last, so a process killed at any moment leaves the bucket at the previous version.
- **No silent failure.** An exception in the worker is logged and counted
  (:attr:`BackgroundPublisher.errors`), and raised by the next :meth:`~BackgroundPublisher.stage`
  or :meth:`~BackgroundPublisher.flush`; the bucket stays at its last good version and the
  next version is a delta against it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Iterable

import torch

from ..aliases import alias_key
from ..detect import serving_dtype_of
from .publisher import PublishRecord, Publisher

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    step: int
    buffer: dict[str, torch.Tensor]


class PublishWorker:
    """The worker thread of a background publisher: it publishes the jobs it is handed, one at a
    time, keeps their records, and logs, counts and keeps (the first) exception of a failed one.

    A subclass has ``publisher`` and ``_assigned`` (the newest version number handed out); it says
    whether it holds a version (:meth:`_holds`) and when a job waits (:meth:`_take`, both under the
    lock), how to publish it (:meth:`_publish`) and what to clear once it is done (:meth:`_finish`,
    under the lock), and calls :meth:`_start` at the end of its constructor.
    """

    def _start(self, name: str) -> None:
        #: Publishes that raised in the worker.
        self.errors = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._done: list[PublishRecord] = []
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def version(self) -> int | None:
        """The newest version staged, in flight or published (``None`` before the first stage):
        the one replicas get once the worker is done with it."""
        with self._cond:
            staged = self._assigned if self._holds() else None
        known = [v for v in (staged, self.publisher.step) if v is not None]
        return max(known) if known else None

    @property
    def busy(self) -> bool:
        """Whether a version waits or a publish is in flight."""
        with self._cond:
            return self._holds()

    def flush(self, timeout: float | None = None) -> list[PublishRecord]:  # pragma: no cover - subclasses
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> list[PublishRecord]:
        """:meth:`flush`, then stop the worker (it stops even when the flush raises)."""
        try:
            return self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout)

    def _holds(self) -> bool:  # pragma: no cover - subclasses
        """Whether a version waits or is in flight (the caller holds the lock)."""
        raise NotImplementedError

    def _take(self) -> Any:  # pragma: no cover - subclasses
        """The job to publish next, now marked in flight, or ``None`` (the caller holds the lock)."""
        raise NotImplementedError

    def _publish(self, job: Any) -> PublishRecord:  # pragma: no cover - subclasses
        raise NotImplementedError

    def _finish(self, job: Any) -> None:  # pragma: no cover - subclasses
        """Clear what marks ``job`` in flight (the caller holds the lock)."""
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._take()
                while job is None and not self._closing:
                    self._cond.wait()
                    job = self._take()
                if job is None:
                    return
            try:
                record = self._publish(job)
            except BaseException as exc:  # every failure reaches the trainer at its next stage or flush
                logger.error("background publish of version %d failed: %s", job.step, exc, exc_info=True)
                with self._cond:
                    self.errors += 1
                    if self._error is None:
                        self._error = exc
            else:
                with self._cond:
                    self._done.append(record)
            finally:
                with self._cond:
                    self._finish(job)
                    self._cond.notify_all()


class BackgroundPublisher(PublishWorker):
    """Publishes staged versions on a worker thread; see the module docstring.

    Args:
        publisher: The publisher the worker runs (its run lock, chain and policy). Nothing
            else may call it while this object is open, and one thread stages.
    """

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        #: Versions replaced in the staging buffer before the worker took them.
        self.coalesced = 0
        #: Seconds the last :meth:`stage` took (waiting for the buffer, and the cast).
        self.stall_s = 0.0
        #: Seconds of the last stage spent waiting for the worker to release the buffer.
        self.wait_s = 0.0
        self._buffer: dict[str, torch.Tensor] | None = None
        self._buffer_busy = False  # the worker reads the buffer (change detection)
        self._pending: _Job | None = None
        self._in_flight: int | None = None
        self._assigned: int | None = None  # the newest version number handed out
        self._start("rlsync-publish")

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, list[PublishRecord]]:
        """Cast ``(name, tensor)`` pairs into the staging buffer as the next version and return.

        The pairs must name the whole state (as :meth:`Publisher.publish` takes it). Waits only
        while the worker reads the buffer; a version still waiting is replaced (coalesced).

        Returns:
            The staged version's number, and the records of the publishes finished since the
            last call.

        Raises:
            The exception of a publish that failed since the last call (raised once; nothing
            is staged then).
        """
        t0 = time.perf_counter()
        with self._cond:
            self._raise_error()
            while self._buffer_busy:
                self._cond.wait()
            t1 = time.perf_counter()
            buffer = self._buffer if self._buffer is not None else {}
            self._buffer = None  # ours while casting: the worker cannot take a half-written buffer
            if self._pending is not None:
                self.coalesced += 1
                logger.info("publish of version %d coalesced into the next (the worker is behind)", self._pending.step)
                self._pending = None
        staged: dict[str, torch.Tensor] = {}
        first: dict[tuple, str] = {}  # a tensor listed twice (tied weights) is staged once, under both names
        try:
            with torch.no_grad():
                for name, tensor in tensors:
                    key = alias_key(tensor)
                    if key is not None and key in first:
                        staged[name] = staged[first[key]]
                        continue
                    first.setdefault(key, name)
                    staged[name] = cast_into(buffer.get(name), tensor.detach(), self.publisher.dtype)
        finally:
            with self._cond:
                self._buffer = staged
        with self._cond:
            step = max(self.publisher.next_step, -1 if self._assigned is None else self._assigned + 1)
            self._assigned = step
            self._pending = _Job(step, staged)
            self._cond.notify_all()
            done, self._done = self._done, []
        self.wait_s, self.stall_s = t1 - t0, time.perf_counter() - t0
        return step, done

    def flush(self, timeout: float | None = None) -> list[PublishRecord]:
        """Wait until the staged version is published.

        Returns:
            The records of the publishes finished since the last call.

        Raises:
            TimeoutError: still publishing after ``timeout`` seconds.
            The exception of a publish that failed since the last call.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._holds():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"version {self._in_flight or self._assigned} still publishing after {timeout} s")
                self._cond.wait(left)
            done, self._done = self._done, []
            self._raise_error()
        return done

    def _raise_error(self) -> None:
        """Raise (once) the exception of a failed publish, after waiting for the worker to be idle
        (so the caller may read the publisher, e.g. to restore the published weights); the next
        version then follows the published one. The caller holds the lock."""
        if self._error is None:
            return
        while self._holds():
            self._cond.wait()
        error, self._error = self._error, None
        if error is not None:
            self._assigned = None
            raise error

    def _release(self, job: _Job, kept: bool) -> None:
        with self._cond:
            if self._buffer_busy:
                self._buffer_busy = False
                if kept and self._buffer is job.buffer:
                    self._buffer = None  # the publisher keeps it (an anchor): the next stage allocates
                self._cond.notify_all()

    def _holds(self) -> bool:
        return self._pending is not None or self._in_flight is not None

    def _take(self) -> _Job | None:
        job, self._pending = self._pending, None
        if job is not None:
            self._in_flight, self._buffer_busy = job.step, True
        return job

    def _publish(self, job: _Job) -> PublishRecord:
        return self.publisher.publish(job.step, job.buffer, release=lambda kept: self._release(job, kept))

    def _finish(self, job: _Job) -> None:
        if self._buffer_busy:
            self._buffer_busy = False  # the publish failed before it released the buffer
        self._in_flight = None


def cast_into(target: torch.Tensor | None, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in its serving dtype, written into ``target`` when that fits (else a new tensor).

    Args:
        target: The staging tensor of the previous version under this name, if any.
        tensor: The trained tensor (any device; the result is on its device).
        dtype: The serving dtype of floating-point tensors (``None``: keep each tensor's).

    Returns:
        ``target`` overwritten, or a new tensor when it does not fit.
    """
    want = serving_dtype_of(tensor, dtype)
    if target is None or target.shape != tensor.shape or target.dtype != want or target.device != tensor.device:
        target = torch.empty(tensor.shape, dtype=want, device=tensor.device)
    return target.copy_(tensor)
