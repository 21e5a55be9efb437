"""Sync figures in the Trackio run that TRL's ``report_to="trackio"`` opens.

TRL's own logs (loss, reward, KL, ...) reach Trackio through transformers'
``TrackioCallback``; :class:`TrackioSyncFigures` adds what the bucket sync did at each
publish (kind, bytes, % changed, publish time, catch-up bytes) to the same run, as
``sync/*`` metrics at the optimizer step the version was sent at (the step axis of TRL's rows),
also when it is published in the background and its record arrives a step later. When the background
publisher falls behind, versions sent while another waited are coalesced into the next (never published
on their own): ``sync/coalesced`` counts them, so a publisher that cannot keep up with the step shows.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from transformers import TrainerCallback

from rlsync.protocol import PublishRecord

logger = logging.getLogger(__name__)


def sync_figures(rec: PublishRecord, coalesced: int = 0) -> dict[str, float]:
    """The Trackio metrics of one publish.

    Args:
        rec: What the publish wrote.
        coalesced: Versions coalesced so far in the run (sent, then replaced before they were published).

    Returns:
        ``sync/*`` metrics: the version, bytes of the anchor or delta, % of elements changed, seconds
        spent encoding, hashing and uploading, the bytes a new replica downloads to catch up, and the
        versions coalesced so far.
    """
    return {
        "sync/version": rec.step,
        f"sync/{rec.kind}_bytes": rec.nbytes,
        "sync/changed_pct": 100 * rec.changed_fraction,
        "sync/publish_s": rec.encode_s + rec.hash_s + rec.upload_s,
        "sync/upload_s": rec.upload_s,
        "sync/catchup_bytes": rec.catchup_bytes,
        "sync/coalesced": coalesced,
    }


#: Publishes kept for a Trackio run that has not started (the newest).
MAX_PENDING = 1000


class OptionalCallback(TrainerCallback):
    """Another callback whose first exception turns it off (logged) instead of ending the training: a tracker
    that cannot reach its server, e.g. Trackio whose Space cannot be created (the run trains on without it).

    Args:
        inner: The callback (transformers' ``TrackioCallback``).
    """

    def __init__(self, inner: TrainerCallback) -> None:
        self.inner = inner
        #: The exception that turned it off (``None``: on).
        self.error: BaseException | None = None


def _guarded(event: str):
    def call(self: OptionalCallback, args, state, control, **kwargs):
        if self.error is not None:
            return None
        try:
            return getattr(self.inner, event)(args, state, control, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure never ends the training
            self.error = exc
            logger.error("%s is off for the rest of this run (%s failed): %s", type(self.inner).__name__, event, exc)
            return None

    call.__name__ = event
    return call


for _event in [name for name in vars(TrainerCallback) if name.startswith("on_")]:
    setattr(OptionalCallback, _event, _guarded(_event))


class TrackioSyncFigures(TrainerCallback):
    """Logs each publish's :func:`sync_figures` to the current Trackio run.

    Pass :meth:`record` as :class:`~rlsync.trl.BucketWeightTransfer`'s ``on_publish`` and
    :meth:`sent` as its ``on_send`` (or call them from yours) and add the callback to a trainer created
    with ``report_to="trackio"``.
    Publishes made before the run starts (the initial anchor) are kept and logged once it
    does; the callback must come before transformers' ``TrackioCallback`` so that the final
    publish (:class:`~rlsync.trl.FinalWeightSync`, at train end) is logged before the run is
    finished: use :meth:`install`.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._sent_at: dict[int, int] = {}  # version -> the optimizer step it was sent at, until its record
        self._run: Any = None
        self._lock = threading.Lock()
        self.logged = 0
        self.failed = 0
        #: Versions sent that a later version's record overtook: coalesced into it by a publisher behind.
        self.coalesced = 0
        self._state: Any = None  # the trainer's TrainerState while it trains (its global_step is live)

    def install(self, trainer: Any) -> "TrackioSyncFigures":
        """Add this callback to ``trainer`` and move its ``TrackioCallback`` (if any) after it.

        Args:
            trainer: A ``transformers.Trainer`` (e.g. TRL's ``AsyncGRPOTrainer``).

        Returns:
            This callback.
        """
        from transformers.integrations import TrackioCallback

        trainer.add_callback(self)
        tracker = trainer.pop_callback(TrackioCallback)
        if tracker is not None:
            trainer.add_callback(OptionalCallback(tracker))
        return self

    def sent(self, version: int) -> None:
        """Note the optimizer step ``version`` is sent at (its figures are logged at that step)."""
        with self._lock:
            self._sent_at[version] = self._step()
            while len(self._sent_at) > 8:  # never recorded (a failed publish's version is sent again)
                del self._sent_at[next(iter(self._sent_at))]

    def record(self, rec: PublishRecord) -> None:
        """Queue one publish's figures (at the step its version was sent at) and log what can be logged.
        Versions sent before ``rec``'s and still unrecorded were coalesced into it: counted."""
        with self._lock:
            step = self._sent_at.pop(rec.step, None)
            overtaken = [version for version in self._sent_at if version < rec.step]
            for version in overtaken:
                del self._sent_at[version]
            self.coalesced += len(overtaken)
            self._pending.append((self._step() if step is None else step, sync_figures(rec, self.coalesced)))
            del self._pending[:-MAX_PENDING]  # no Trackio run (yet, or at all): the newest are kept
        self._drain()

    def _step(self) -> int:
        return self._state.global_step if self._state is not None else 0

    def _drain(self) -> None:
        with self._lock:
            if self._run is None:
                from trackio import context_vars

                self._run = context_vars.current_run.get()
            if self._run is None:
                return
            pending, self._pending = self._pending, []
        for step, figures in pending:
            try:  # best effort, like TRL's own trace logging: a Trackio hiccup must not stop training
                self._run.log(figures, step=step)
                self.logged += 1
            except Exception as exc:
                self.failed += 1
                if self.failed == 1:
                    logger.warning("could not log sync figures to Trackio (%s); counting further failures", exc)

    def on_train_begin(self, args, state, control, **kwargs):
        self._state = state

    def on_log(self, args, state, control, **kwargs):
        self._drain()

    def on_train_end(self, args, state, control, **kwargs):
        self._drain()
        if self._pending:
            logger.warning("%d publish(es) not logged to Trackio: no Trackio run was started", len(self._pending))
        with self._lock:
            self._run = None  # TrackioCallback finishes it next; another train() starts a new one
