"""The vLLM engine following the bucket itself, through the ``bucket`` weight-transfer backend.

With ``weight_transfer_config={"backend": "bucket"}`` (the :class:`~rollout_space.engines.vllm_engine.VllmEngine`
default) each vLLM worker runs the backend (:mod:`rlsync.vllm.transfer`): a
:class:`~rlsync.protocol.Subscriber` that writes the served tensors themselves where they are plain views
(every module on a GPU), and keeps the smallest copy only for the modules it cannot write element-wise
(prepacked CPU kernels, quantized modules, fused experts). :class:`VllmBucketCalls` gives the replica's
:class:`~rollout_space.bucket_follower.BucketFollower` the calls of
:class:`~rlsync.vllm.client.BucketSyncClient`'s sequence, on the offline ``vllm.LLM``: prepare in the
background (``sync_prepare``), the pause (``update_weights`` with ``prepared_only``, then the prefix cache
reset), the background re-hash (``sync_verify``) and the status (``sync_transfer_status``). Every call holds
the engine's lock (``vllm.LLM`` is not called from two threads at once): it waits for a running
``generate``, and the background work in the workers goes on while the next one runs.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from rlsync.vllm.status import TransferStatus

__all__ = ["BUCKET_BACKEND", "VllmBucketCalls"]

#: ``weight_transfer_config`` of an engine that follows the bucket itself.
BUCKET_BACKEND = {"backend": "bucket"}


class VllmBucketCalls:
    """The :class:`~rollout_space.engine.BucketFollowingEngine` calls of the vLLM engine (a mixin: it uses the
    engine's ``llm``, ``_lock``, ``follows_bucket`` and ``_after_weight_change``)."""

    llm: Any
    _lock: threading.RLock
    follows_bucket: bool
    _after_weight_change: Callable[[], None]

    def follow_bucket(self, url: str, chain: str) -> TransferStatus:
        """Have the workers follow ``chain`` of the bucket at ``url`` (``init_weight_transfer_engine``); their
        subscriber starts again: the next update is the newest anchor.

        Returns:
            The transfer status (:meth:`transfer_status`).

        Raises:
            RuntimeError: The engine was started with another weight-transfer backend, or none.
        """
        if not self.follows_bucket:
            raise RuntimeError(f"this vLLM engine was not started with weight_transfer_config={BUCKET_BACKEND}")
        with self._lock:
            self.llm.init_weight_transfer_engine({"init_info": {"bucket": url, "chain": chain}})
        return self.transfer_status()

    def prepare_update(self) -> TransferStatus:
        """Start preparing the next update toward the newest version in the workers' background
        (``sync_prepare``: download, decode, the O(changed) hash check); a refused update is refused here.

        Returns:
            The transfer status (poll :meth:`transfer_status` until ``preparing`` is false).
        """
        return self._status_rpc("sync_prepare")

    def transfer_status(self) -> TransferStatus:
        """The workers' transfer status (:meth:`rlsync.vllm.transfer.BucketWeightTransferEngine.status`), one
        for all: ``error`` any worker's, ``preparing``/``rehashing`` while any is, a failed ``rehash`` first.

        Raises:
            RuntimeError: The workers prepared different updates.
        """
        return self._status_rpc("sync_transfer_status")

    def verify_served(self) -> TransferStatus:
        """Start re-hashing the served weights against the workers' verified hash in their background
        (``sync_verify``).

        Returns:
            The transfer status (poll until ``rehashing`` is false; then ``rehash`` holds the result).
        """
        return self._status_rpc("sync_verify")

    def apply_prepared(self, step: int) -> None:
        """The pause: write the update the workers prepared toward ``step`` (``prepared_only``: no bucket read,
        no decode; a prepared update that no longer follows the served state is dropped, and the status says
        so), then reset the prefix cache (no KV of the old weights is reused).

        Raises:
            Exception: A worker failed to write it (vLLM reports a worker's error as a bare ``Exception``);
                the workers reload their state at the next update.
        """
        with self._lock:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"step": step, "prepared_only": True}})  # failed: no session left
            self.llm.finish_weight_update(weight_version=str(step))
            self._after_weight_change()

    def _status_rpc(self, method: str) -> TransferStatus:
        with self._lock:
            statuses = self.llm.collective_rpc(method)
        return TransferStatus.merge(TransferStatus.from_wire(status) for status in statuses)
