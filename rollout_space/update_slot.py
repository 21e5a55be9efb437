"""The hand-off of one downloaded update from a fetch thread to the thread that applies it."""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["UpdateSlot"]


class UpdateSlot:
    """At most one fetched, validated update (an :class:`~rlsync.protocol.Update`, or what a follower holds of
    one: :class:`~rlsync.vllm.status.Prepared`), waiting to be applied.

    The fetch thread waits for the slot to be empty before it fetches the next update: that one
    is validated against the state this one produces.
    """

    def __init__(self) -> None:
        #: The update waiting to be applied, or ``None``.
        self.update: Any = None
        self._cond = threading.Condition()

    def wait_empty(self, stop: threading.Event) -> None:
        """Block until the waiting update was applied (or refused), or ``stop`` is set."""
        with self._cond:
            while self.update is not None and not stop.is_set():
                self._cond.wait(0.5)

    def put(self, update: Any) -> None:
        with self._cond:
            self.update = update

    def apply(self, apply: Callable[[Any], bool]) -> bool:
        """Run ``apply`` on the waiting update, then empty the slot.

        Returns:
            What ``apply`` returned; ``False`` when no update was waiting.
        """
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
