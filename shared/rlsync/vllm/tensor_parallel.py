"""Whole parameters from tensor-parallel shards, for reading a vLLM model back at TP > 1."""

from __future__ import annotations

import torch

__all__ = ["all_gather", "gather_tensor_parallel", "packed_part_sizes"]


def gather_tensor_parallel(module: torch.nn.Module, param: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """The whole parameter (vLLM layout) from this rank's shard, gathered over the TP group.

    Column-parallel layers (packed ones too) are sharded along their output rows, one slice of
    every packed part per rank; row-parallel layers along their input columns; vocabulary
    embeddings along (padded) vocabulary rows. Replicated parameters are returned as they are.
    A collective at TP > 1: every rank must call it, in the same order.
    """
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    if isinstance(module, VocabParallelEmbedding):
        return torch.cat(all_gather(local), dim=0) if local.dim() >= 1 else local
    input_dim, output_dim = _dims(param, local)
    if isinstance(module, RowParallelLinear) and input_dim is not None:
        return torch.cat(all_gather(local), dim=input_dim)
    if isinstance(module, ColumnParallelLinear) and output_dim is not None:
        shards = all_gather(local)
        parts = list(getattr(module, "output_partition_sizes", [local.shape[0]]))
        replicas = [getattr(module, "num_kv_head_replicas", 1) if i > 0 and len(parts) == 3 else 1
                    for i in range(len(parts))]  # QKV: k and v heads may be replicated over ranks
        out, offset = [], 0
        for size, repeat in zip(parts, replicas):
            out.extend(shard.narrow(0, offset, size) for shard in shards[::repeat])
            offset += size
        return torch.cat(out, dim=0)
    return local


def _dims(param: torch.nn.Parameter, local: torch.Tensor) -> tuple[int | None, int | None]:
    """``(input_dim, output_dim)`` of a parameter's shards. vLLM's CPU backend replaces a prepacked weight by an
    empty parameter without its loader's attributes; read through its kernel, it is ``(out, in)``."""
    if param.numel() == 0 and local.dim() == 2:
        return 1, 0
    return getattr(param, "input_dim", None), getattr(param, "output_dim", None)


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's copy of `tensor`, in rank order, through the group's CPU (gloo) group
    (``[tensor]`` at TP 1). A collective at TP > 1.

    Moved through CPU as raw bytes: gloo does not reduce or gather every dtype (bf16, fp8).
    """
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return [tensor]
    raw = tensor.detach().to("cpu").contiguous().view(torch.uint8)
    gathered = [torch.empty_like(raw) for _ in range(group.world_size)]
    dist.all_gather(gathered, raw, group=group.cpu_group)
    return [g.view(tensor.dtype).view(tensor.shape) for g in gathered]


def packed_part_sizes(module: torch.nn.Module) -> list[int]:
    """Rows of each part a packed linear layer stacks (q/k/v, gate/up), as in the checkpoint.

    ``QKVParallelLinear.output_sizes`` counts a key/value head once per rank that holds it (when
    there are fewer key/value heads than ranks), so the checkpoint's sizes come from the head counts.
    """
    if hasattr(module, "total_num_kv_heads"):
        kv_heads = module.total_num_kv_heads
        return [module.total_num_heads * module.head_size, kv_heads * module.head_size, kv_heads * module.v_head_size]
    return list(module.output_sizes)
