"""Worker-side weight sync for vLLM: applying verified updates inside a vLLM worker.

vLLM runs the model in worker processes; the driver reaches them with ``LLM.collective_rpc``.
:class:`SyncWorkerExtension` is mixed into the worker class
(``LLM(worker_extension_cls="rlsync.vllm.worker.SyncWorkerExtension")``) and adds the ``sync_*``
methods :class:`~rollout_space.engines.vllm_engine.VllmEngine` calls. The same
:class:`~rlsync.vllm.model_weights.ModelWeights` logic serves the ``bucket`` weight-transfer backend
(:mod:`rlsync.vllm.transfer`), inside the worker too. Its parts: :mod:`.plan` (which changes patch in place,
which reload), :mod:`.locations` (where a checkpoint tensor lives in the model), :mod:`.served` (how vLLM serves
a module's weight, and reading it back), :mod:`.model_weights` (patching, reloading, reading).

How an update reaches the weights depends on how a module keeps them:

* **In place** (CUDA, and CPU modules without a prepacked kernel, e.g. RMSNorm):
  sparse patches go through vLLM's
  :func:`~vllm.model_executor.model_loader.checkpoint_weight_patch.load_checkpoint_weight_patches`,
  i.e. the model's own ``load_weights`` in checkpoint coordinates (packed
  ``qkv_proj``/``gate_up_proj``, vocab padding and TP slicing handled by vLLM),
  writing only the changed elements.
* **Prepacked** (vLLM's CPU backend): after loading, every linear layer's weight
  is repacked into a oneDNN/SGL kernel handle and the parameter is replaced by an
  empty tensor, so there is nothing to patch in place. For those modules the
  full checkpoint tensors of the touched modules are rebuilt from the verified
  state and reloaded through vLLM's layerwise reload path (restore, ``load_weights``,
  ``process_weights_after_loading``, which prepacks again), scoped to the touched
  modules. Modules that share a parameter with a reloaded one (a tied ``lm_head``)
  are re-processed too, since vLLM's layerwise reload only re-processes the
  module that owns the loaded weight.

Reading back (:meth:`~rlsync.vllm.model_weights.ModelWeights.read`) returns checkpoint names and layouts:
packed parameters are split back into ``q/k/v`` and ``gate/up``, fused MoE experts
into one tensor per expert and projection (:mod:`rlsync.vllm.experts`), vocabulary
padding is cut off. A prepacked CPU weight cannot be read from memory, so it is
read *through its kernel*: multiplying the identity by ``W^T`` with the very
kernel that serves requests returns ``W`` exactly (one non-zero product per
output, fp32 accumulation, a bf16-representable result). The one value this
cannot recover is the sign of a zero: ``-0.0`` reads back as ``+0.0`` (and a
weight of ``+-inf`` would poison its column); a trainer state holding ``-0.0``
therefore hashes differently when read back from the CPU backend.

Tensor payloads between the driver and the workers are safetensors blobs (:mod:`.payload`).

Tensor parallelism: patches and reloads are given in global checkpoint coordinates
and the model's loader slices them per rank. Reading back gathers each sharded
parameter over the tensor-parallel group (a collective: every rank must read the
same names), so read-back and the state hash work at any TP size.

Quantized modules (fp8 and other non-"unquantized" methods, fused MoE experts) and non-float tensors are never
patched in place (an fp8 weight needs its scale; vLLM's sparse loader refuses non-float tensors): they reload.
A model loaded from a block-FP8 checkpoint (the FP8 chain, :mod:`rlsync.fp8`) is updated that way:
a delta's changed e4m3 bytes and block scales reload their modules' whole weights and scales
(``*.weight_scale_inv``, checkpoint names like the weights), and reading back returns both as
loaded: the e4m3 weight out of the CPU kernel's VNNI order (:mod:`.packing`), the scales as they are.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .model_weights import ModelWeights
from .payload import pack_tensors, unpack_patches, unpack_tensors
from .prepare import BucketBackendCalls


class SyncWorkerExtension(BucketBackendCalls):
    """Mixed into vLLM's worker class; its methods (and the ``bucket`` backend's calls) go by ``collective_rpc``.

    Method names carry a ``sync_`` prefix (no clash with the worker's own); payloads: :func:`pack_tensors`, :func:`pack_patches`.
    """

    def _sync_weights(self) -> ModelWeights:
        weights = getattr(self, "_rlsync_weights", None)
        if weights is None:
            weights = ModelWeights(self.model_runner.get_model(), self.vllm_config.model_config)
            self._rlsync_weights = weights
        return weights

    def sync_layout(self) -> dict[str, Any]:
        """The model's :class:`~rlsync.vllm.plan.WeightLayout`, JSON-friendly."""
        return self._sync_weights().layout().to_json()

    def _after_update(self) -> None:
        """What vLLM's own ``finish_weight_update`` does after new weights: reset LoRA state."""
        reset = getattr(self.model_runner, "reset_lora_state", None)
        if reset is not None:
            reset()

    def sync_load(self, payload: Mapping[str, Any]) -> None:
        """Replace all weights with a full state (checkpoint names)."""
        tensors, _ = unpack_tensors(payload)
        self._sync_weights().reload(tensors)
        self._after_update()

    def sync_load_weights(self, payload: Mapping[str, Any]) -> None:
        """Copy a full state in with the model's plain ``load_weights`` (the usual RL refit; the full-load
        baseline), only where no module is prepacked (GPU).

        Raises:
            RuntimeError: Some module is prepacked (vLLM's CPU backend).
        """
        weights = self._sync_weights()
        if weights.layout().in_place != frozenset(weights.layout().module_of.values()):
            raise RuntimeError("plain load_weights cannot update prepacked (CPU) modules; use sync_load")
        tensors, _ = unpack_tensors(payload)
        with torch.no_grad():
            weights.model.load_weights(list(tensors.items()))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def sync_apply(self, sparse: Mapping[str, Any] | None, full: Mapping[str, Any] | None) -> None:
        """Apply a planned update (see :func:`~rlsync.vllm.plan.plan_update`)."""
        patches = unpack_patches(sparse) if sparse else {}
        tensors = unpack_tensors(full)[0] if full else {}
        self._sync_weights().apply(patches, tensors)
        self._after_update()

    def sync_read(self, names: list[str] | None = None, spool_dir: str | None = None) -> dict[str, Any]:
        """Weights in checkpoint names and layout, as a payload."""
        return pack_tensors(self._sync_weights().read(names), spool_dir=spool_dir)

    def sync_transfer_memory(self) -> dict[str, int]:
        """What the ``bucket`` weight-transfer backend keeps besides the model
        (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.memory`; empty for another backend)."""
        memory = getattr(getattr(self, "weight_transfer_engine", None), "memory", None)
        return memory() if callable(memory) else {}

    def sync_state_hash(self) -> str:
        """``rlsync.hashing.state_hash`` of the served weights, in checkpoint names and layout.

        JSON-friendly, so a ``vllm serve`` client can call it too
        (``POST /collective_rpc {"method": "sync_state_hash"}``, dev mode).
        """
        return self._sync_weights().lanes().hexdigest()


def _register_bucket_backend() -> None:
    """Make ``--weight-transfer-config '{"backend": "bucket"}'`` work in every process
    that imports the worker extension (vLLM workers import it before loading the model)."""
    from .plugin import register

    register()


_register_bucket_backend()
