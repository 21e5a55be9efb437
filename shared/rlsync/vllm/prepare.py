"""Work the ``bucket`` backend does in a vLLM worker while generation runs: one background job at a time.

vLLM's weight-update API (``start_weight_update``, ``update_weights``, ``finish_weight_update``) runs
inside a pause of generation, so nothing slow may happen there. vLLM offers no "prepare" call of its
own, so the backend's worker extension adds ``collective_rpc`` methods (``sync_prepare``,
``sync_verify``, ``sync_transfer_status``) that start a :class:`BackgroundJob` and return at once:
``vLLM``'s engine loop keeps scheduling requests while the job downloads, decodes and verifies the
next update (:meth:`~rlsync.protocol.Subscriber.fetch`) or re-hashes the served weights. The pause
then only applies what the job prepared (:mod:`rlsync.vllm.transfer`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundJob(Generic[T]):
    """Runs one job at a time in a daemon thread and keeps its result (or error) until taken.

    Args:
        name: The thread's name (for logs and stack dumps).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._result: T | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a job is in flight."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, job: Callable[[], T]) -> bool:
        """Start ``job`` unless one is in flight; the previous result and error are dropped.

        Returns:
            Whether it was started (``False``: one is still running).
        """
        with self._lock:
            if self.running:
                return False
            self._result, self._error = None, None
            self._thread = threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True)
            self._thread.start()
            return True

    def _run(self, job: Callable[[], T]) -> None:
        try:
            result = job()
        except Exception as exc:  # noqa: BLE001 - kept for the caller, who reports it (a refused update, a bucket error)
            logger.warning("%s failed: %s: %s", self.name, type(exc).__name__, exc)
            with self._lock:
                self._error = exc
            return
        with self._lock:
            self._result = result

    def wait(self) -> None:
        """Wait for the job in flight, if any."""
        thread = self._thread
        if thread is not None:
            thread.join()

    @property
    def error(self) -> BaseException | None:
        """The last job's exception, until the next :meth:`start` or :meth:`take`."""
        return self._error

    @property
    def result(self) -> T | None:
        """The last job's result (``None`` while running, after an error, or once taken)."""
        return None if self.running else self._result

    def take(self) -> T | None:
        """The last job's result, removed (waits for a job in flight)."""
        self.wait()
        with self._lock:
            result, self._result, self._error = self._result, None, None
        return result


class BucketBackendCalls:
    """The ``bucket`` backend's ``collective_rpc`` calls before vLLM's pause, mixed into the worker extension
    (:class:`~rlsync.vllm.worker.SyncWorkerExtension`); each returns the backend's status as
    :meth:`~rlsync.vllm.status.TransferStatus.to_wire` writes it (the caller reads it with ``from_wire``)."""

    def _bucket_engine(self) -> Any:
        """The ``bucket`` weight-transfer backend of this worker.

        Raises:
            RuntimeError: The server runs another backend, or none (``--weight-transfer-config``).
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if not callable(getattr(engine, "prepare", None)):
            raise RuntimeError("this vLLM server does not run the bucket backend: --weight-transfer-config '{\"backend\": \"bucket\"}'")
        return engine

    def sync_prepare(self, step: int | str | None = None) -> dict[str, Any]:
        """Start preparing the next update toward ``step`` in the background, while vLLM generates
        (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.prepare`; ``step`` may come as a string,
        the form ``collective_rpc`` over HTTP passes arguments in; ``None`` or ``""``: the newest).

        Returns:
            The backend's status, on the wire.
        """
        return self._bucket_engine().prepare(None if step in (None, "", "None") else int(step)).to_wire()

    def sync_verify(self) -> dict[str, Any]:
        """Start re-hashing the served weights against the verified state, off the pause
        (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.verify`).

        Returns:
            The backend's status, on the wire.
        """
        return self._bucket_engine().verify().to_wire()

    def sync_transfer_status(self) -> dict[str, Any]:
        """The ``bucket`` backend's status (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.status`)."""
        return self._bucket_engine().status().to_wire()

