"""Sharded publishing off the training step: every rank stalls only to cast its own shards.

:class:`ShardedBackgroundPublisher` runs a :class:`~rlsync.protocol.sharded.ShardedPublisher` on a
worker thread on every rank of a ``torch.distributed`` trainer (FSDP2), as
:class:`~rlsync.protocol.background.BackgroundPublisher` does for one process.
:meth:`~ShardedBackgroundPublisher.stage` (the trainer's thread, on every rank) casts the rank's
local shards to the serving dtype into a staging buffer, takes part in one tiny all-reduce, and
returns; the worker runs the whole collective publish (detection, hashing, encoding, upload, the
rounds with the other ranks, rank 0's pointer last) while the next step computes.

Two process groups keep the collectives apart, created collectively at setup in the same order
on every rank:

- the *worker group* (:func:`publish_group`, given to the ``ShardedPublisher``; the default
  group's backend, gloo on CPU): only the workers
  use it once training runs (the foreground uses it only for ``resume`` before the first stage,
  when no worker runs). Its timeout bounds how long a worker waits for a failed peer;
- the *control group* (gloo): only the trainer's threads use it, for the agreement below, so it is
  never busy with a publish and never interleaves with the training collectives (the trainer's
  own group, which neither group touches).

**The agreement.** Collective publishes must be the same sequence of versions on every rank, so
a rank may hand a version to its worker only when every rank does. At each :meth:`stage`, after
its cast, every rank contributes two flags to one ``MAX`` all-reduce on the control group:
*busy* (its worker holds a publish) and *failed* (its worker's last publish raised). Then, on
every rank alike:

- any *failed*: each rank waits for its own worker to be idle (a worker that waits on a failed
  peer fails too, at the latest after the worker group's timeout) and raises: its own worker's
  exception, or :class:`~rlsync.errors.ShardedPublishError` naming the other ranks'. Nothing is
  staged (the version just cast is dropped), the bucket stays at its last good version and the
  next version follows it, as in the single-process path;
- else any *busy*: the version waits in the staging buffer; if one already waited, it is
  replaced (coalesced, counted in :attr:`~ShardedBackgroundPublisher.coalesced`): the version
  handed over next is one delta against the last *published* state, which includes the
  replaced one's changes, so nothing is lost and its number is skipped;
- else: the version goes to every rank's worker.

A waiting version is handed over only at the next :meth:`stage` (where the new one replaces it)
or at :meth:`~ShardedBackgroundPublisher.flush`; a worker never takes work by itself, so no
rank's worker can start a version another rank has coalesced. ``flush`` needs no further
agreement (whether a version waits is already agreed), but every rank must call ``stage`` and
``flush`` in the same order (:class:`~rlsync.trl.FinalWeightSync` flushes on every rank when
given the transfer). Version numbers count stages from the publisher's ``next_step`` (read while
every worker is idle), so they are the same on every rank.

- **Bounded.** At most one publish in flight per rank and one version waiting. A rank keeps two
  staging buffers of its shards in the serving dtype (the worker reads one for the whole
  publish, the next cast fills the other), so a stage never waits for the worker.
- **Crash safe.** The publish is the ``ShardedPublisher``'s: every part first, rank 0's pointer
  last, so a rank killed while a background publish is in flight leaves the bucket at the
  previous version, and a restarted group continues from it.
- **No silent failure.** A worker's exception is logged and counted
  (:attr:`~ShardedBackgroundPublisher.errors`) on its rank and raised on every rank at the next
  ``stage``, or by ``flush`` (one that is not an :class:`~rlsync.errors.RlsyncError`, such as a
  collective's timeout, as :class:`~rlsync.errors.ShardedPublishError`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from typing import Mapping

import torch
import torch.distributed as dist

from ..errors import RlsyncError, ShardedPublishError
from .background import PublishWorker, cast_into
from .publisher import PublishRecord
from .sharded import ShardedPublisher

logger = logging.getLogger(__name__)

#: Seconds a background publish's collective waits for a peer before failing.
DEFAULT_PUBLISH_TIMEOUT_S = 300.0


def publish_group(timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S, backend: str | None = None) -> dist.ProcessGroup:
    """A process group over the world for a background publisher's worker or its control
    (collective: every rank calls it, in the same order as its other ``new_group`` calls).

    Args:
        timeout_s: How long a collective of a background publish waits for a peer.
        backend: Its backend (default: the default group's, which moves the trainer's tensors:
            gloo on CPU, NCCL on GPUs).

    Returns:
        The group, to give as ``ShardedPublisher(bucket, group=...)``.
    """
    return dist.new_group(backend=backend or dist.get_backend(), timeout=datetime.timedelta(seconds=timeout_s))


@dataclasses.dataclass
class _Job:
    step: int
    state: dict[str, torch.Tensor]
    buffer: int  # which of the two staging buffers holds it


class ShardedBackgroundPublisher(PublishWorker):
    """Publishes staged versions on a worker thread on every rank; see the module docstring.

    Build it on every rank, after the ``ShardedPublisher`` (collective: it creates the control group).

    Args:
        publisher: The publisher the worker runs, built on a process group of its own
            (:func:`publish_group`); nothing else may publish with it while this object is open.
        control: The group of the per-stage agreement (default: a new gloo group over the world
            whose collectives wait ``timeout_s`` for a peer).
        timeout_s: The default control group's timeout.

    Raises:
        ValueError: ``publisher`` uses the default group, which the trainer's own collectives use.
    """

    def __init__(
        self, publisher: ShardedPublisher, *, control: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S,
    ) -> None:  # fmt: skip
        if publisher.group is None or publisher.group == dist.group.WORLD:
            raise ValueError(
                "a background sharded publisher needs a process group of its own: "
                "ShardedPublisher(bucket, group=publish_group()) (or publish within the step)"
            )
        self.publisher = publisher
        self.control = control if control is not None else publish_group(timeout_s, "gloo")  # CPU flags
        #: Versions replaced in the staging buffer before any worker took them (the same on every rank).
        self.coalesced = 0
        #: Seconds the last :meth:`stage` took (cast and agreement).
        self.stall_s = 0.0
        #: Seconds of the last stage spent in the agreement's all-reduce.
        self.agree_s = 0.0
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._waiting: _Job | None = None  # staged while a worker was busy; the same version on every rank
        self._job: _Job | None = None  # handed to the worker, not yet taken
        self._in_flight: _Job | None = None
        self._assigned: int | None = None  # the newest version number handed out
        self._start("rlsync-sharded-publish")

    def stage(self, state: Mapping[str, torch.Tensor]) -> tuple[int, list[PublishRecord]]:
        """Cast this rank's shards of ``state`` into a staging buffer as the next version (collective).

        Args:
            state: This rank's state dict, as :meth:`ShardedPublisher.publish` takes it (DTensors, or
                plain tensors that rank 0 publishes).

        Returns:
            The staged version's number, and the records of the publishes finished since the last call.

        Raises:
            The exception of a publish that failed on this rank since the last call, or
            :class:`ShardedPublishError` when it failed on another rank only (on every rank alike;
            nothing is staged then).
        """
        t0 = time.perf_counter()
        with self._cond:
            free = 1 - self._in_flight.buffer if self._in_flight is not None else 0
            if self._job is not None:
                free = 1 - self._job.buffer
        staged = self._cast(state, free)
        t1 = time.perf_counter()
        with self._cond:
            working = self._job is not None or self._in_flight is not None
            flags = torch.tensor([int(working), int(self._error is not None)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        busy, failed = (bool(v) for v in flags.tolist())
        t2 = time.perf_counter()
        with self._cond:
            if failed:
                self._wait_idle(None)
                if self._error is None:
                    self._error = ShardedPublishError("a background publish failed on another rank; the bucket keeps its last good version")
                self._raise_error()
            step = self.publisher.next_step if self._assigned is None else self._assigned + 1
            self._assigned = step
            if self._waiting is not None:
                self.coalesced += 1
                logger.info("publish of version %d coalesced into the next (a rank's worker is behind)", self._waiting.step)
            self._waiting = _Job(step, staged, free)
            if not busy:
                self._hand_off()
            done, self._done = self._done, []
        self.agree_s, self.stall_s = t2 - t1, time.perf_counter() - t0
        return step, done

    def flush(self, timeout: float | None = None) -> list[PublishRecord]:
        """Publish the waiting version, if any, and wait until this rank's worker is done (every
        rank calls it at the same point of its stages).

        Returns:
            The records of the publishes finished since the last call.

        Raises:
            TimeoutError: still publishing after ``timeout`` seconds.
            The exception of a publish that failed on this rank since the last call.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._wait_idle(deadline)
            if self._error is None and self._waiting is not None:
                self._hand_off()
                self._wait_idle(deadline)
            done, self._done = self._done, []
            self._raise_error()
        return done

    def _cast(self, state: Mapping[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        """This rank's shards of ``state`` in the serving dtype, written into staging buffer ``index``,
        as DTensors of the same placements (a plain tensor, which every rank holds whole, as is)."""
        from torch.distributed.tensor import DTensor

        buffer, locals_ = self._buffers[index], {}
        staged: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}  # a tensor listed twice (tied weights) is cast once
        with torch.no_grad():
            for name, tensor in state.items():
                if id(tensor) in seen:
                    staged[name], locals_[name] = staged[seen[id(tensor)]], locals_[seen[id(tensor)]]
                    continue
                seen[id(tensor)] = name
                if isinstance(tensor, DTensor):
                    local = locals_[name] = cast_into(buffer.get(name), tensor.to_local().detach(), self.publisher.dtype)
                    staged[name] = DTensor.from_local(
                        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
                    )  # fmt: skip
                else:
                    staged[name] = locals_[name] = cast_into(buffer.get(name), tensor.detach(), self.publisher.dtype)
        self._buffers[index] = locals_
        return staged

    def _holds(self) -> bool:
        return self._waiting is not None or self._job is not None or self._in_flight is not None

    def _hand_off(self) -> None:
        """Give the waiting version to the worker (the caller holds the lock)."""
        self._job, self._waiting = self._waiting, None
        self._cond.notify_all()

    def _wait_idle(self, deadline: float | None) -> None:
        """Wait until this rank's worker holds nothing (the caller holds the lock)."""
        while self._job is not None or self._in_flight is not None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                job = self._in_flight or self._job
                raise TimeoutError(f"version {job.step if job else '?'} still publishing")
            self._cond.wait(left)

    def _raise_error(self) -> None:
        """Raise (once) the failed publish's exception, dropping the waiting version; the next
        version follows the published one (the caller holds the lock, the worker is idle)."""
        error, self._error = self._error, None
        if error is not None:
            self._waiting, self._assigned = None, None
            raise error

    def _take(self) -> _Job | None:
        job, self._job = self._job, None
        self._in_flight = job
        return job

    def _publish(self, job: _Job) -> PublishRecord:
        try:
            return self.publisher.publish(job.step, job.state)
        except RlsyncError:
            raise
        except Exception as exc:  # e.g. a collective that timed out waiting for a failed peer
            raise ShardedPublishError(f"rank {self.publisher.rank}: background publish of version {job.step} failed: {exc}") from exc

    def _finish(self, job: _Job) -> None:
        self._in_flight = None
