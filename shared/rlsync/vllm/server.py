"""The HTTP calls of a ``vllm serve`` server with the ``bucket`` backend and the worker extension
(:class:`VllmServer`): plain POSTs, ``collective_rpc`` to the workers and their statuses, and the pause that
applies a prepared update (the sequence: :mod:`rlsync.vllm.client`)."""

from __future__ import annotations

import enum
import logging
import time
from typing import Any

from rlsync.errors import RetryableError
from rlsync.retry import RetryPolicy, call_with_retries

from .plugin import WORKER_EXTENSION
from .status import TransferStatus

logger = logging.getLogger(__name__)

#: Seconds between two polls of the workers' status while they prepare or re-hash.
POLL_S = 0.05


class PauseMode(str, enum.Enum):
    """What vLLM's ``/pause`` does with the requests in flight while an update is applied."""

    #: Freeze them where they stand; they go on with the new weights after the resume (their KV recomputed).
    KEEP = "keep"
    #: Stop admitting new requests and wait until every one in flight has finished.
    WAIT = "wait"


class VllmServer:
    """One server, over HTTP.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        timeout_s: HTTP timeout per call, and the longest wait for the workers to prepare or re-hash.
        reset_attempts: Calls of ``/reset_prefix_cache`` before giving up (vLLM refuses
            while blocks are still held, and says callers may retry).
    """

    def __init__(self, base_url: str, *, timeout_s: float, reset_attempts: int) -> None:
        import httpx

        self.timeout_s = timeout_s
        self.reset_attempts = max(1, reset_attempts)
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)

    def post(self, path: str, **kwargs: Any) -> Any:
        response = self.http.post(path, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    def rpc(self, method: str, *args: str) -> list[Any]:
        """``collective_rpc`` of a worker-extension method; one result per worker.

        Raises:
            RuntimeError: The server has no such worker method (started without the worker extension):
                vLLM fails the call or drops the connection.
        """
        import httpx

        try:
            return list(self.post("/collective_rpc", json={"method": method, "args": list(args)})["results"])
        except (httpx.TransportError, httpx.HTTPStatusError, KeyError, TypeError) as exc:
            raise RuntimeError(
                f"the server did not answer collective_rpc({method!r}) ({type(exc).__name__}: {exc}); "
                f"its workers lack the method: start vllm serve with --worker-extension-cls {WORKER_EXTENSION}"
            ) from exc

    def statuses(self, method: str, *args: str) -> list[TransferStatus]:
        """Call ``method`` on every worker and read the statuses they return."""
        return [TransferStatus.from_wire(status) for status in self.rpc(method, *args)]

    def wait(self, statuses: list[TransferStatus], busy: str) -> list[TransferStatus]:
        """Poll the workers' status until none is ``busy`` (``preparing``, ``rehashing``)."""
        deadline = time.monotonic() + self.timeout_s
        while any(getattr(s, busy) for s in statuses):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server's workers are still {busy} after {self.timeout_s} s")
            time.sleep(POLL_S)
            statuses = self.statuses("sync_transfer_status")
        return statuses

    def _reset_prefix_cache(self, pause_mode: PauseMode) -> None:
        # kept requests hold KV blocks computed with the old weights: dropped too, recomputed after the resume
        params = {"reset_running_requests": "true"} if pause_mode is PauseMode.KEEP else None

        def reset() -> None:
            if not (self.post("/reset_prefix_cache", params=params) or {}).get("success"):
                raise RetryableError("vLLM refused to reset its prefix cache (blocks are still held)")

        call_with_retries(
            reset, policy=RetryPolicy(max_attempts=self.reset_attempts, base_delay=0.1, max_delay=1.0, max_total=30.0),
            retryable=RetryableError, describe="resetting vLLM's prefix cache",
            give_up=lambda *_: RuntimeError("vLLM refused to reset its prefix cache after a weight update: stale KV would be served"),
        )  # fmt: skip

    def apply_prepared(self, step: int, pause_mode: PauseMode) -> float:
        """The pause (``pause_mode``): apply the prepared update (``prepared_only``: no download, no
        decode), reset the prefix cache, resume (also after a failure); returns the seconds the server was paused."""
        import httpx

        t0 = time.perf_counter()
        self.post("/pause", params={"mode": pause_mode.value})
        try:
            self.post("/start_weight_update")
            self.post("/update_weights", json={"update_info": {"step": step, "prepared_only": True}})
            self.post("/finish_weight_update", json={"weight_version": str(step)})
            self._reset_prefix_cache(pause_mode)
        except Exception:
            try:
                self.post("/resume")
            except httpx.HTTPError as exc:  # the sync's own error says more than a failed resume
                logger.warning("could not resume the server after a failed sync: %s", exc)
            raise
        self.post("/resume")
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()
