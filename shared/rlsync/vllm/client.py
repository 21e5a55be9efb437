"""Driving a ``vllm serve --weight-transfer-config '{"backend": "bucket"}'`` server over HTTP.

The server's workers follow the bucket themselves (:mod:`rlsync.vllm.transfer`); this client tells them
when, and keeps vLLM's pause to the write of one verified update:

1. ``collective_rpc('sync_prepare', step)``: each worker starts downloading, validating and decoding the
   next update in the background, and checks the state hash it makes (updated in O(changed) from old
   values gathered from the weights) against the published one, while the server keeps generating; the
   client polls ``sync_transfer_status`` until every worker is done. A refused update (corrupt, hostile,
   a hash mismatch) stops here: counted by the workers, raised here, generation never paused;
2. ``/pause``, ``/start_weight_update``, ``/update_weights`` with ``prepared_only`` (the workers apply the
   prepared update and nothing else: no bucket read, no decode), ``/finish_weight_update`` (the step as
   vLLM's weight version, which labels every token generated after it), ``/reset_prefix_cache``
   (checked: stale KV must not be served), ``/resume``; once per update, so a server several versions
   behind takes one short pause per version;
3. with ``verify``, ``collective_rpc('sync_verify')``: the workers re-hash the served weights (read back
   in checkpoint names) against the verified hash, in the background while the server generates (in
   vLLM's engine loop where the read-back runs the CPU backend's prepacked kernels); a mismatch is raised.

The pause (:class:`PauseMode`) is ``keep`` by default, as TRL's async GRPO pauses: in-flight requests
are frozen where they stand, so the server is idle for the apply alone, not for the tail of the batch
it was generating. Their KV cache, computed with the old weights, is dropped with the prefix cache
(``reset_running_requests``): they are recomputed with the new weights after the resume and go on
generating, so a completion may span an update, its tokens labelled with the version that sampled
each (:mod:`rlsync.vllm.versions` turns the labels into its first and last version). ``wait`` lets
in-flight requests finish before the update (the server idles through the batch's tail, and every
completion comes from one version).

Requires ``VLLM_SERVER_DEV_MODE=1`` on the server (vLLM mounts its RL and ``collective_rpc`` routes only
then) and ``--worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension`` (the ``sync_*`` methods).
"""

from __future__ import annotations

import logging

from rlsync.bucket import BucketSettings, open_bucket
from rlsync.fp8 import Chain

from .server import PauseMode, VllmServer
from .status import TransferStatus

__all__ = ["BucketSyncClient", "PauseMode"]

logger = logging.getLogger(__name__)

#: Updates one :meth:`BucketSyncClient.sync` applies at most (each in its own pause) before it returns.
MAX_UPDATES_PER_SYNC = 64


class BucketSyncClient:
    """Drives a ``vllm serve --weight-transfer-config '{"backend": "bucket"}'`` server (see the module docstring).

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        bucket: Bucket URL, read here to learn the newest step and passed to the server.
        verify: After each sync, have the workers re-hash the served weights in the background and
            compare them with the bucket's hash.
        timeout_s: HTTP timeout per call, and the longest wait for the workers to prepare or re-hash.
        reset_attempts: Calls of ``/reset_prefix_cache`` before giving up (vLLM refuses
            while blocks are still held, and says callers may retry).
        settings: The bucket's Hub settings (default: the library defaults).
        chain: The chain the server follows (``fp8``: a server started from a block-FP8 checkpoint).
        pause_mode: What the pause does with the requests in flight (see the module docstring):
            ``keep`` (the default) freezes them for the apply alone; ``wait`` lets them finish first.
    """

    def __init__(
        self,
        base_url: str,
        bucket: str,
        *,
        verify: bool = True,
        timeout_s: float = 600.0,
        reset_attempts: int = 5,
        settings: BucketSettings | None = None,
        chain: Chain = Chain.BF16,
        pause_mode: PauseMode = PauseMode.KEEP,
    ) -> None:
        self.server = VllmServer(base_url, timeout_s=timeout_s, reset_attempts=reset_attempts)
        self.bucket_url = bucket
        self.chain = Chain(chain)
        self.bucket = self.chain.bucket(open_bucket(bucket, settings=settings))
        self.verify = verify
        self.pause_mode = PauseMode(pause_mode)
        self.step: int | None = None
        #: Seconds the server was paused for each update of the last :meth:`sync` (``/pause`` to ``/resume``).
        self.pauses: list[float] = []
        self._initialized = False

    def served_state_hash(self) -> str:
        """The state hash of the weights the server's workers serve, read back now (in vLLM's engine loop:
        serving waits for it; :meth:`sync` re-hashes in the background instead).

        Raises:
            RuntimeError: The server lacks the worker extension.
        """
        results = self.server.rpc("sync_state_hash")
        if not results:
            raise RuntimeError("collective_rpc('sync_state_hash') returned no result")
        return results[0]

    def transfer_status(self) -> list[TransferStatus]:
        """Each worker's :meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.status`."""
        return self.server.statuses("sync_transfer_status")

    def _prepare(self, step: int) -> TransferStatus:
        """Have every worker prepare the next update toward ``step``, while the server generates.

        Raises:
            RuntimeError: A worker refused the update or could not fetch it (nothing applied, no pause),
                or the workers prepared different updates.
        """
        statuses = self.server.wait(self.server.statuses("sync_prepare", str(step)), "preparing")
        errors = [s.error for s in statuses if s.error]
        if errors:
            raise RuntimeError(f"the server refused or could not fetch the update toward step {step} "
                               f"before pausing (nothing applied): {errors[0]}")  # fmt: skip
        prepared = {s.prepared for s in statuses}
        if len(prepared) != 1:
            raise RuntimeError(f"the server's workers prepared different updates: {sorted(prepared, key=str)}")
        return statuses[0]

    def _init_engine(self) -> None:
        if not self._initialized:
            info = {"bucket": self.bucket_url, "chain": self.chain.value}
            self.server.post("/init_weight_transfer_engine", json={"init_info": info})
            self._initialized = True

    def prepare(self) -> int | None:
        """Have the workers prepare the next update toward the bucket's newest step now, while the server
        generates (step 1 of the module docstring), so that the next :meth:`sync` pauses without waiting for
        the download and decode (it keeps an update prepared here while the bucket's pointer leads through it).

        Returns:
            The step of the update prepared (``None``: nothing published, or up to date).

        Raises:
            RuntimeError: As :meth:`sync` before any pause (a refused update, a server without the extension).
        """
        from rlsync.protocol import read_manifest

        manifest = read_manifest(self.bucket)
        if manifest is None or manifest.step == self.step:
            return None
        self._init_engine()
        prepared = self._prepare(manifest.step).prepared
        return prepared.step if prepared is not None else None

    def _verify(self, manifest_step: int, manifest_hash: str) -> None:
        """Re-hash the served weights in the background on the workers and compare (see the module docstring).

        Raises:
            RuntimeError: The served weights differ from the verified state or from the bucket's.
        """
        statuses = self.server.wait(self.server.statuses("sync_verify"), "rehashing")
        for status in statuses:
            rehash = status.rehash
            if status.rehash_error or rehash is None:
                raise RuntimeError(f"the server could not re-hash its weights: {status.rehash_error or 'no result'}")
            wanted = manifest_hash if rehash.step == manifest_step else rehash.expected
            if rehash.served != wanted or rehash.expected != wanted:
                raise RuntimeError(f"the server's weights do not hash equal to bucket step {rehash.step}")

    def sync(self) -> int | None:
        """Bring the server to the bucket's newest step if it is behind: prepare, pause, apply, resume, once
        per update (see the module docstring).

        Returns:
            The step the server now serves (``None`` before the first publish); lower than the bucket's
            while the workers wait for an update they can verify after a refusal.

        Raises:
            RuntimeError: A worker refused an update (before any pause), ``verify`` is on and the served
                weights do not hash equal to the bucket's state, the server lacks the worker extension,
                or vLLM kept refusing to reset its prefix cache.
            httpx.HTTPStatusError: The server refused a call.
        """
        from rlsync.protocol import read_manifest

        manifest = read_manifest(self.bucket)
        self.pauses = []
        if manifest is None or manifest.step == self.step:
            return self.step
        self._init_engine()
        for _ in range(MAX_UPDATES_PER_SYNC):
            status = self._prepare(manifest.step)
            if status.prepared is None:  # up to date, or waiting for an update it can verify
                self.step = status.step
                break
            self.pauses.append(self.server.apply_prepared(status.prepared.step, self.pause_mode))
            self.step = self.transfer_status()[0].step  # a prepared update found stale was dropped: prepare again
            if self.step == manifest.step:
                break
        if self.verify and self.step is not None:
            self._verify(manifest.step, manifest.state_hash)
        return self.step

    def close(self) -> None:
        """Close the HTTP client."""
        self.server.close()
