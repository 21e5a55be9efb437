"""Worker-side weight sync for vLLM: applying verified updates inside a vLLM worker.

vLLM runs the model in worker processes; the driver reaches them with ``LLM.collective_rpc``.
:class:`SyncWorkerExtension` is mixed into the worker class
(``LLM(worker_extension_cls="rlsync.vllm.worker.SyncWorkerExtension")``) and adds the ``sync_*``
methods :class:`~rollout_space.engines.vllm_engine.VllmEngine` calls. The same :class:`ModelWeights`
logic serves the ``bucket`` weight-transfer backend (``vllm_transfer.py``), inside the worker too.

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

Reading back (:meth:`ModelWeights.read`) returns checkpoint names and layouts:
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

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from rlsync.patch import TensorPatch

from .checkpoint import checkpoint_names_of
from .experts import expert_location, read_expert, repack_experts
from .packing import Packing, unpack
from .payload import pack_tensors, unpack_patches, unpack_tensors
from .prepare import BucketBackendCalls
from .tensor_parallel import gather_tensor_parallel, packed_part_sizes

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from rlsync.hashing import StateLanes

logger = logging.getLogger(__name__)


# -- planning (driver side and worker side) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Where each checkpoint tensor lives in the vLLM model.

    Attributes:
        module_of: Checkpoint name -> path of the vLLM module that loads it.
        in_place: Module paths whose weights can be patched element-wise in place
            (no prepacked kernel copy).
        ignored_prefixes: Checkpoint-name prefixes vLLM skips on load (``lm_head.``
            when the embeddings are tied).
    """

    module_of: dict[str, str]
    in_place: frozenset[str]
    ignored_prefixes: tuple[str, ...] = ()

    def ignores(self, name: str) -> bool:
        """Whether vLLM skips this checkpoint name on load (e.g. a tied ``lm_head.weight``)."""
        return name.startswith(self.ignored_prefixes) if self.ignored_prefixes else False

    def to_json(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly form."""
        return {
            "module_of": self.module_of,
            "in_place": sorted(self.in_place),
            "ignored_prefixes": list(self.ignored_prefixes),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "WeightLayout":
        """Inverse of :meth:`to_json`."""
        return cls(dict(obj["module_of"]), frozenset(obj["in_place"]), tuple(obj.get("ignored_prefixes", ())))


def plan_update(
    layout: WeightLayout, patches: Mapping[str, TensorPatch], state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, TensorPatch], dict[str, torch.Tensor]]:
    """Split a verified delta into in-place patches and whole-tensor reloads.

    Args:
        layout: The model's layout (see :meth:`ModelWeights.layout`).
        patches: The delta, in checkpoint names and coordinates.
        state: The full verified state after the delta.

    Returns:
        ``(sparse, full)``: patches for in-place modules, and for every touched
        prepacked module the full state tensors of *all* checkpoint names it loads
        (a packed ``qkv_proj`` needs ``q``, ``k`` and ``v`` together).

    Non-float tensors go to the reload path too (vLLM's sparse loader marks
    unchanged elements with NaN, which only float tensors have).

    Raises:
        KeyError: A patch names a tensor the model does not load (and does not
            deliberately skip, like a tied ``lm_head.weight``).
    """
    sparse: dict[str, TensorPatch] = {}
    reload_modules: set[str] = set()
    for name, patch in patches.items():
        if patch.numel == 0 or layout.ignores(name):
            continue
        try:
            module = layout.module_of[name]
        except KeyError:
            raise KeyError(f"the vLLM model does not load a tensor named {name!r}") from None
        if module in layout.in_place and patch.values.dtype.is_floating_point:
            sparse[name] = patch
        else:
            reload_modules.add(module)
    full = {name: state[name] for name, module in layout.module_of.items() if module in reload_modules}
    return sparse, full


# -- the model, seen from inside a worker ------------------------------------------------


class ModelWeights:
    """Load, patch and read a vLLM model's weights in checkpoint names.

    Args:
        model: The worker's model (``model_runner.get_model()``).
        model_config: The worker's ``vllm_config.model_config``.
        checkpoint_names: Tensor names of the checkpoint; default: the names in
            the model folder's safetensors files.

    Raises:
        ValueError: A checkpoint name cannot be located in the model.
    """

    def __init__(
        self, model: torch.nn.Module, model_config: "ModelConfig", checkpoint_names: Iterable[str] | None = None
    ) -> None:
        self.model = model
        self.model_config = model_config
        if checkpoint_names is None:
            checkpoint_names = checkpoint_names_of(model_config.model, getattr(model_config, "revision", None))
        names = list(checkpoint_names)
        self._experts = {n: loc for n in names if (loc := expert_location(model, n))}  # fused MoE experts
        self._locations = {name: loc for name in names if (loc := self._locate(name)) is not None}
        self._aliases = _parameter_aliases(model)
        self.reads_through_kernels = any(map(_is_prepacked, model.modules()))  # read() runs the CPU's prepacked kernels

    # -- layout -------------------------------------------------------------------

    def _locate(self, name: str) -> tuple[str, str, int | None] | None:
        """``(module path, parameter name, shard index)`` for a checkpoint name, or ``None`` if vLLM skips it."""
        if name in self._experts:
            return self._experts[name][0], self._experts[name][1], None
        mapped = name
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapped = mapper.get_rename_mapper().map_name(name)
            if mapped is None:
                return None
        if _tied(self.model) and mapped.startswith("lm_head."):
            return None  # vLLM skips it: lm_head shares embed_tokens' weight
        module_path, _, param = mapped.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        shard = None
        for packed, parts in getattr(self.model, "packed_modules_mapping", {}).items():
            if leaf in parts:
                module_path, shard = f"{parent}.{packed}" if parent else packed, parts.index(leaf)
                break
        try:
            module = self.model.get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"cannot locate checkpoint tensor {name!r} in the vLLM model ({module_path!r})") from None
        if not hasattr(module, param):
            raise ValueError(f"vLLM module {module_path!r} has no parameter {param!r} for {name!r}")
        return module_path, param, shard

    @property
    def checkpoint_names(self) -> list[str]:
        """Checkpoint names the model loads, sorted."""
        return sorted(self._locations)

    def layout(self) -> WeightLayout:
        """Where each checkpoint tensor lives, and which modules can be patched in place."""
        module_of = {name: loc[0] for name, loc in self._locations.items()}
        in_place = {m for m in module_of.values() if _patchable_in_place(self.model.get_submodule(m))}
        return WeightLayout(module_of, frozenset(in_place), ("lm_head.",) if _tied(self.model) else ())

    def views(self) -> dict[str, torch.Tensor]:
        """The model's own tensors as checkpoint tensors, where a plain view is one: what the ``bucket``
        backend's subscriber writes in place, so no copy of them is kept (see :mod:`rlsync.vllm.transfer`).

        A module's names are all viewed or none. Not viewed: prepacked CPU modules and modules sharing
        a parameter with one (the kernel keeps its own copy), quantized modules, fused MoE experts,
        LoRA-wrapped modules, non-float parameters, and every module at tensor parallelism above 1 (a
        rank holds a shard of each tensor).

        Returns:
            Checkpoint name -> a contiguous view of the served parameter (as :meth:`read` reads it).
        """
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            return {}
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in self._aliases:
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(module)
        tied_to_kernel = {id(m) for mods in owners.values() if any(map(_is_prepacked, mods)) for m in mods}
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        refused: set[str] = set()
        for name, (path, param, shard) in self._locations.items():
            if path in refused:
                continue
            module = self.model.get_submodule(path)
            viewable = name not in self._experts and id(module) not in tied_to_kernel
            view = _checkpoint_view(module, param, shard) if viewable else None
            if view is None:
                refused.add(path)
                by_module.pop(path, None)
                continue
            by_module.setdefault(path, {})[name] = view
        return {name: view for views in by_module.values() for name, view in views.items()}

    # -- writing ------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, sparse: Mapping[str, TensorPatch], full: Mapping[str, torch.Tensor]) -> None:
        """Apply in-place patches and whole-module reloads (see :func:`plan_update`).

        Patch indices must be sorted and unique (the delta decoders check it), so vLLM's
        per-patch uniqueness check is skipped; ``int32`` indices are passed as they are.

        Raises:
            ValueError: A sparse patch carries NaN (vLLM uses NaN as the "unchanged" sentinel).
            RuntimeError: The model's loader skipped a patched tensor (it would go unnoticed until
                a later hash check otherwise).
        """
        if sparse:
            from vllm.model_executor.model_loader.checkpoint_weight_patch import (
                CheckpointWeightPatch,
                load_checkpoint_weight_patches,
            )

            device = _model_device(self.model)
            patches = [
                CheckpointWeightPatch(
                    name=name,
                    shape=tuple(p.shape),
                    dtype=p.values.dtype,
                    values=p.values.to(device, non_blocking=True),
                    indices=p.index.to(device, non_blocking=True),
                )
                for name, p in sparse.items()
            ]
            loaded = load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)
            self._check_loaded(sparse, loaded)
        if full:
            self.reload(full)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _check_loaded(self, names: Iterable[str], loaded: set[str]) -> None:
        """Raise if the loader did not report the parameter of every checkpoint name it was given."""
        skipped = sorted(n for n in names if ".".join(self._locations[n][:2]) not in loaded)
        if skipped:
            raise RuntimeError(
                f"the vLLM model's loader skipped {len(skipped)} patched tensors, e.g. {skipped[:3]}: "
                "the served weights no longer match the verified state"
            )

    @torch.no_grad()
    def reload(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Reload whole checkpoint tensors through vLLM's layerwise reload, scoped to their modules.

        Every checkpoint tensor a touched module loads must be included (see
        :func:`plan_update`); otherwise the module's missing part is left undefined.

        Raises:
            KeyError: A name is not a checkpoint tensor of the model.
        """
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        unknown = [n for n in tensors if n not in self._locations]
        if unknown:
            raise KeyError(f"not checkpoint tensors of the model: {unknown[:3]}")
        paths = sorted({self._locations[n][0] for n in tensors})
        modules = [self.model.get_submodule(p) for p in paths]
        for module in modules:
            initialize_layerwise_reload(module)
        try:
            loaded = self.model.load_weights(list(tensors.items()))
        finally:
            for module in modules:
                finalize_layerwise_reload(module, self.model_config)
        self._reprocess_aliases(modules)
        repack_experts(modules)
        if loaded is not None:
            self._check_loaded(tensors, set(loaded))

    def _reprocess_aliases(self, modules: list[torch.nn.Module]) -> None:
        """Re-run weight processing on modules that share a parameter with a reloaded one."""
        touched = {id(p) for m in modules for p in m.parameters(recurse=False)}
        done = {id(m) for m in modules}
        for module in self._aliases:
            if id(module) in done or not any(id(p) in touched for p in module.parameters(recurse=False)):
                continue
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                quant_method.process_weights_after_loading(module)

    # -- reading ------------------------------------------------------------------

    @torch.no_grad()
    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Read weights back in checkpoint names and layout, on CPU.

        Args:
            names: Checkpoint names to read (default: all the model loads).

        Returns:
            One tensor per name, as the serving kernels see it (see the module docstring
            for prepacked CPU weights).

        At tensor parallelism above 1 this is a collective: every rank must call it with
        the same names; sharded parameters are gathered over the tensor-parallel group.

        Raises:
            KeyError: An unknown name.
            RuntimeError: A tied ``lm_head`` kernel disagrees with the embedding it is tied to.
        """
        names = self.checkpoint_names if names is None else list(names)
        cache: dict[tuple[str, str], torch.Tensor] = {}
        out = {}
        for name in names:
            if name not in self._locations:
                raise KeyError(f"not a checkpoint tensor of the model: {name!r}")
            path, param, shard = self._locations[name]
            if name in self._experts:  # one expert of a fused MoE layer
                out[name] = read_expert(self.model.get_submodule(path), *self._experts[name][1:])
                continue
            key = (path, param)
            if key not in cache:
                cache[key] = _served_tensor(self.model.get_submodule(path), param, self.model_config.dtype)
            full = cache[key]
            module = self.model.get_submodule(path)
            if shard is not None:
                sizes = packed_part_sizes(module)
                if param != "weight" and (block := _block_shape(module)) is not None:  # block scales of a packed FP8 layer
                    sizes = [-(-size // block[0]) for size in sizes]
                start = sum(sizes[:shard])
                full = full[start : start + sizes[shard]]
            out[name] = full.contiguous().clone()
        _check_tied_head(self.model)
        return out

    def lanes(self, names: Iterable[str] | None = None) -> StateLanes:
        """The state hash (:class:`rlsync.hashing.StateLanes`) of :meth:`read`, 16 tensors read back at a time."""
        from rlsync.hashing import StateLanes  # noqa: F811 - at run time only where hashing is needed

        names = self.checkpoint_names if names is None else list(names)
        batches = (self.read(names[i : i + 16]) for i in range(0, len(names), 16))  # bounds the read-back copies
        return StateLanes.of_items(item for batch in batches for item in batch.items())


def _served_tensor(module: torch.nn.Module, param: str, dtype: torch.dtype) -> torch.Tensor:
    """A module parameter as used for serving, in vLLM layout minus vocabulary padding (``dtype``: the model's)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    base = getattr(module, "base_layer", module)  # with enable_lora, vLLM's LoRA layer wraps the original one
    lookup = isinstance(base, VocabParallelEmbedding) and not isinstance(base, ParallelLMHead)
    if param == "weight" and _is_prepacked(module) and not lookup:
        tensor = _read_through_kernel(module)
    elif param == "weight" and _is_fp8_prepacked(module):
        tensor = unpack(module.weight, Packing.FP8_LINEAR)
    else:
        tensor = getattr(module, param).detach()
    tensor = gather_tensor_parallel(module, getattr(module, param), tensor)
    if isinstance(base, VocabParallelEmbedding) and param == "weight":
        tensor = tensor[: base.org_vocab_size]
    elif param == "bias" and _is_prepacked(module):
        tensor = tensor.to(dtype)  # the SGL CPU kernel keeps biases in fp32
    return tensor.to("cpu")

def _check_tied_head(model: torch.nn.Module) -> None:
    """On CPU a tied ``lm_head`` has its own packed copy of the embedding: it must match."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not _tied(model) or not _is_prepacked(head):
        return
    served = _read_through_kernel(head)[: head.org_vocab_size]
    if not torch.equal(served.cpu(), embed.weight.detach()[: embed.org_vocab_size].cpu()):
        raise RuntimeError("the tied lm_head kernel is stale: it no longer matches model.embed_tokens.weight")


def _checkpoint_view(module: torch.nn.Module, param: str, shard: int | None) -> torch.Tensor | None:
    """A parameter of an in-place module (tensor parallel 1) as its checkpoint tensor, without a copy:
    vocabulary padding cut off, one part of a packed layer; ``None`` when no contiguous view is one."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if getattr(module, "base_layer", module) is not module or not _patchable_in_place(module):
        return None
    tensor = getattr(module, param).detach()
    if not tensor.is_floating_point():
        return None
    if isinstance(module, VocabParallelEmbedding) and param == "weight":
        tensor = tensor[: module.org_vocab_size]
    if shard is not None:
        sizes = packed_part_sizes(module)
        start = sum(sizes[:shard])
        tensor = tensor[start : start + sizes[shard]]
    return tensor if tensor.is_contiguous() else None


def _tied(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _patchable_in_place(module: torch.nn.Module) -> bool:
    """Whether a module's weights can take element-wise checkpoint-coordinate patches.

    Not when vLLM's CPU backend serves it from a prepacked kernel copy, nor when it is
    quantized (its stored weight is not in checkpoint dtype, and needs its scales).
    """
    if _is_prepacked(module):
        return False
    method = getattr(module, "quant_method", None)
    return method is None or type(method).__name__ in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def _is_prepacked(module: torch.nn.Module) -> bool:
    """Whether vLLM's CPU backend serves this module from a prepacked kernel copy."""
    return callable(getattr(module, "cpu_linear", None))


def _is_fp8_prepacked(module: torch.nn.Module) -> bool:
    """Whether vLLM's CPU block-FP8 kernel (``CPUFp8BlockScaledMMKernel``) keeps this module's e4m3 weight in
    its VNNI order (``convert_weight_packed``; the block scales stay as loaded)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return (
        type(kernel).__name__ == "CPUFp8BlockScaledMMKernel"
        and not getattr(module, "_cpu_skip_gemm_dispatch", False)
        and module.weight.dtype == torch.float8_e4m3fn
    )


def _block_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """The ``(rows, columns)`` of a block-quantized module's scale blocks, ``None`` for other modules."""
    block = getattr(getattr(module, "quant_method", None), "weight_block_size", None)
    return (int(block[0]), int(block[1])) if block else None


def _read_through_kernel(module: torch.nn.Module) -> torch.Tensor:
    """Recover ``W`` (``(out, in)``) from a prepacked CPU linear by multiplying the identity."""
    if hasattr(module, "output_partition_sizes"):  # ReplicatedLinear (a MoE router) has no per-partition input size
        k, n = getattr(module, "input_size_per_partition", module.input_size), sum(module.output_partition_sizes)
    else:  # ParallelLMHead
        k, n = module.embedding_dim, module.num_embeddings_per_partition
    eye = torch.eye(k, dtype=module.weight.dtype)
    out = module.cpu_linear(eye, module.weight, None)
    if tuple(out.shape) != (k, n):
        raise RuntimeError(f"kernel probe returned shape {tuple(out.shape)}, expected {(k, n)}")
    return out.t().contiguous()


def _parameter_aliases(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding a parameter object that another module also holds (tied weights)."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return [m for mods in owners.values() if len(mods) > 1 for m in mods]


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# -- the worker extension -------------------------------------------------------------------


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
        """The model's :class:`WeightLayout`, JSON-friendly."""
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
        """Apply a planned update (see :func:`plan_update`)."""
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
