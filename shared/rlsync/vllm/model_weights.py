"""A vLLM model's weights in checkpoint names, from inside a worker: patching in place, reloading whole
modules, and reading back (how each is done: :mod:`rlsync.vllm.worker`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import torch

from rlsync.patch import TensorPatch

from .checkpoint import checkpoint_names_of
from .experts import read_expert, repack_experts
from .locations import CheckpointLocations
from .plan import WeightLayout
from .served import block_shape, check_tied_head, is_prepacked, model_device, served_tensor
from .tensor_parallel import packed_part_sizes

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from rlsync.hashing import StateLanes


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
        self.where = CheckpointLocations(model, checkpoint_names)
        self.reads_through_kernels = any(map(is_prepacked, model.modules()))  # read() runs the CPU's prepacked kernels

    @property
    def checkpoint_names(self) -> list[str]:
        """Checkpoint names the model loads, sorted."""
        return self.where.names

    def layout(self) -> WeightLayout:
        """Where each checkpoint tensor lives, and which modules can be patched in place."""
        return self.where.layout()

    def views(self) -> dict[str, torch.Tensor]:
        """The served tensors that are plain views of checkpoint tensors (:meth:`CheckpointLocations.views`)."""
        return self.where.views()

    # -- writing ------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, sparse: Mapping[str, TensorPatch], full: Mapping[str, torch.Tensor]) -> None:
        """Apply in-place patches and whole-module reloads (see :func:`~rlsync.vllm.plan.plan_update`).

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

            device = model_device(self.model)
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
        skipped = sorted(n for n in names if ".".join(self.where.of[n][:2]) not in loaded)
        if skipped:
            raise RuntimeError(
                f"the vLLM model's loader skipped {len(skipped)} patched tensors, e.g. {skipped[:3]}: "
                "the served weights no longer match the verified state"
            )

    @torch.no_grad()
    def reload(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Reload whole checkpoint tensors through vLLM's layerwise reload, scoped to their modules.

        Every checkpoint tensor a touched module loads must be included (see
        :func:`~rlsync.vllm.plan.plan_update`); otherwise the module's missing part is left undefined.

        Raises:
            KeyError: A name is not a checkpoint tensor of the model.
        """
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        unknown = [n for n in tensors if n not in self.where.of]
        if unknown:
            raise KeyError(f"not checkpoint tensors of the model: {unknown[:3]}")
        paths = sorted({self.where.of[n][0] for n in tensors})
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
        for module in self.where.aliases:
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
            if name not in self.where.of:
                raise KeyError(f"not a checkpoint tensor of the model: {name!r}")
            path, param, shard = self.where.of[name]
            if name in self.where.experts:  # one expert of a fused MoE layer
                out[name] = read_expert(self.model.get_submodule(path), *self.where.experts[name][1:])
                continue
            key = (path, param)
            if key not in cache:
                cache[key] = served_tensor(self.model.get_submodule(path), param, self.model_config.dtype)
            full = cache[key]
            module = self.model.get_submodule(path)
            if shard is not None:
                sizes = packed_part_sizes(module)
                if param != "weight" and (block := block_shape(module)) is not None:  # block scales of a packed FP8 layer
                    sizes = [-(-size // block[0]) for size in sizes]
                start = sum(sizes[:shard])
                full = full[start : start + sizes[shard]]
            out[name] = full.contiguous().clone()
        check_tied_head(self.model)
        return out

    def lanes(self, names: Iterable[str] | None = None) -> StateLanes:
        """The state hash (:class:`rlsync.hashing.StateLanes`) of :meth:`read`, 16 tensors read back at a time."""
        from rlsync.hashing import StateLanes  # noqa: F811 - at run time only where hashing is needed

        names = self.checkpoint_names if names is None else list(names)
        batches = (self.read(names[i : i + 16]) for i in range(0, len(names), 16))  # bounds the read-back copies
        return StateLanes.of_items(item for batch in batches for item in batch.items())
