"""The hand-off of one downloaded update from a fetch thread to the engine, and when it may go in."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["UpdateSlot"]

#: Longest a wait for the slot to empty or for a batch's generation to end lasts before ``stop`` is looked at again.
WAIT_STEP_S = 0.5


class UpdateSlot:
    """At most one fetched, validated update (an :class:`~rlsync.protocol.Update`, or what a follower holds of
    one: :class:`~rlsync.vllm.status.Prepared`), waiting to be applied.

    The fetch thread waits for the slot to be empty before it fetches the next update: that one
    is validated against the state this one produces. An update is applied as soon as no batch is
    being generated (:meth:`holding`): a batch's samples are all of the version it started with, and
    no update waits for the replica's other work between batches (claims, writes, waits for request budget).
    """

    def __init__(self) -> None:
        #: The update waiting to be applied, or ``None``.
        self.update: Any = None
        self._cond = threading.Condition()
        self._generating = threading.Lock()  # held while a batch is generated: no update goes in meanwhile

    def wait_empty(self, stop: threading.Event) -> None:
        """Block until the waiting update was applied (or refused), or ``stop`` is set."""
        with self._cond:
            while self.update is not None and not stop.is_set():
                self._cond.wait(WAIT_STEP_S)

    def put(self, update: Any) -> None:
        with self._cond:
            self.update = update

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the served version for the block (a batch's generation): an update waits until it ends."""
        with self._generating:
            yield

    def apply(self, apply: Callable[[Any], bool]) -> bool:
        """Run ``apply`` on the waiting update, then empty the slot (after the batch being generated, if any).

        Returns:
            What ``apply`` returned; ``False`` when no update was waiting.
        """
        with self._generating:
            return self._apply(apply)

    def apply_when_free(self, apply: Callable[[Any], bool], stop: threading.Event) -> bool:
        """:meth:`apply` as soon as no batch is being generated, unless ``stop`` is set first."""
        while not stop.is_set():
            if self._generating.acquire(timeout=WAIT_STEP_S):
                try:
                    return self._apply(apply)
                finally:
                    self._generating.release()
        return False

    def _apply(self, apply: Callable[[Any], bool]) -> bool:
        with self._cond:
            update = self.update
        if update is None:
            return False
        try:
            return apply(update)
        finally:
            with self._cond:
                self.update = None
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake a fetch thread waiting in :meth:`wait_empty` (on stop)."""
        with self._cond:
            self._cond.notify_all()
