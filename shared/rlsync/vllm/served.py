"""How vLLM serves a module's weight: in place or from a prepacked CPU kernel, quantized or not, tied or not,
and how to read it back in checkpoint layout.

A prepacked CPU weight cannot be read from memory, so it is read *through its kernel*
(:func:`served_tensor`): multiplying the identity by ``W^T`` with the very kernel that serves requests
returns ``W`` exactly (see :mod:`rlsync.vllm.worker` for the one value this cannot recover, the sign of a zero).
"""

from __future__ import annotations

import torch

from .packing import Packing, unpack
from .tensor_parallel import gather_tensor_parallel, packed_part_sizes


def served_tensor(module: torch.nn.Module, param: str, dtype: torch.dtype) -> torch.Tensor:
    """A module parameter as used for serving, in vLLM layout minus vocabulary padding (``dtype``: the model's)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    base = getattr(module, "base_layer", module)  # with enable_lora, vLLM's LoRA layer wraps the original one
    lookup = isinstance(base, VocabParallelEmbedding) and not isinstance(base, ParallelLMHead)
    if param == "weight" and is_prepacked(module) and not lookup:
        tensor = _read_through_kernel(module)
    elif param == "weight" and _is_fp8_prepacked(module):
        tensor = unpack(module.weight, Packing.FP8_LINEAR)
    else:
        tensor = getattr(module, param).detach()
    tensor = gather_tensor_parallel(module, getattr(module, param), tensor)
    if isinstance(base, VocabParallelEmbedding) and param == "weight":
        tensor = tensor[: base.org_vocab_size]
    elif param == "bias" and is_prepacked(module):
        tensor = tensor.to(dtype)  # the SGL CPU kernel keeps biases in fp32
    return tensor.to("cpu")


def check_tied_head(model: torch.nn.Module) -> None:
    """On CPU a tied ``lm_head`` has its own packed copy of the embedding: it must match."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not is_tied(model) or not is_prepacked(head):
        return
    served = _read_through_kernel(head)[: head.org_vocab_size]
    if not torch.equal(served.cpu(), embed.weight.detach()[: embed.org_vocab_size].cpu()):
        raise RuntimeError("the tied lm_head kernel is stale: it no longer matches model.embed_tokens.weight")


def checkpoint_view(module: torch.nn.Module, param: str, shard: int | None) -> torch.Tensor | None:
    """A parameter of an in-place module (tensor parallel 1) as its checkpoint tensor, without a copy:
    vocabulary padding cut off, one part of a packed layer; ``None`` when no contiguous view is one."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if getattr(module, "base_layer", module) is not module or not patchable_in_place(module):
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


def is_tied(model: torch.nn.Module) -> bool:
    """Whether the model ties ``lm_head`` to the input embeddings."""
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def patchable_in_place(module: torch.nn.Module) -> bool:
    """Whether a module's weights can take element-wise checkpoint-coordinate patches.

    Not when vLLM's CPU backend serves it from a prepacked kernel copy, nor when it is
    quantized (its stored weight is not in checkpoint dtype, and needs its scales).
    """
    if is_prepacked(module):
        return False
    method = getattr(module, "quant_method", None)
    return method is None or type(method).__name__ in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def is_prepacked(module: torch.nn.Module) -> bool:
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


def block_shape(module: torch.nn.Module) -> tuple[int, int] | None:
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


def parameter_aliases(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding a parameter object that another module also holds (tied weights)."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return [m for mods in owners.values() if len(mods) > 1 for m in mods]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
