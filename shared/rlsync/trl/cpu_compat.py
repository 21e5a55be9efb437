"""Run TRL's ``AsyncGRPOTrainer`` where no GPU is present (trl 1.16).

Two pieces of the trainer assume CUDA; :func:`apply_cpu_compat` replaces just those:

1. ``get_peak_flops_per_device`` (``trl.trainer.utils``, called in
   ``AsyncGRPOTrainer.__init__`` for the MFU figures) asks ``torch.cuda`` for the
   device name, which raises without a GPU. Replaced by a version that returns
   ``None`` (MFU figures off, as TRL does for unknown devices) when the training
   device is not CUDA, and calls TRL's own otherwise.
2. Packed ("tree") attention (``trl.experimental.async_grpo.packing.tree_attention``)
   calls a flash-attention-3 kernel fetched from the Hub with ``kernels``: GPU-only,
   and unreachable offline. Replaced by :func:`sdpa_tree_attention`, the same
   variable-length attention (each segment attends causally, bottom-right aligned, to
   the keys of its root-to-segment path) computed segment by segment with
   ``torch.nn.functional.scaled_dot_product_attention``. Slower, but exact to float
   rounding (tests check log-probabilities against a plain forward within 1e-5).

On a GPU machine nothing is replaced unless the flash-attention kernel cannot be
fetched, in which case the SDPA attention is the fallback.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from trl.experimental.async_grpo import async_grpo_trainer, packing

logger = logging.getLogger(__name__)

_original_peak_flops = async_grpo_trainer.get_peak_flops_per_device


def peak_flops_per_device(accelerator, dtype: str) -> float | None:
    """TRL's peak-FLOPs lookup on CUDA devices, ``None`` (MFU off) elsewhere."""
    if accelerator.device.type != "cuda":
        return None
    return _original_peak_flops(accelerator, dtype)


def sdpa_tree_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """TRL's tree attention with per-segment SDPA instead of the flash-attention-3 varlen kernel.

    Args and return value as ``trl.experimental.async_grpo.packing.tree_attention``:
    ``query``/``key``/``value`` are ``[1, heads, tokens, dim]`` over one packed row;
    segment ``i`` holds queries ``cu_q[i]:cu_q[i+1]`` and attends to the packed
    positions ``tree_kv_index[cu_k[i]:cu_k[i+1]]``. Returns ``([1, tokens, heads, dim], None)``.

    Raises:
        NotImplementedError: ``softcap`` is set (no model here uses it).
    """
    if softcap:
        raise NotImplementedError("sdpa_tree_attention does not implement logit softcapping")
    query, key, value = (x[0] for x in (query, key, value))  # [heads, tokens, dim]
    keys, values = key.index_select(1, tree_kv_index), value.index_select(1, tree_kv_index)
    out = torch.empty_like(query)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        n_q, n_k = q1 - q0, k1 - k0
        pos = torch.arange(n_k - n_q, n_k, device=query.device)[:, None]  # bottom-right causal alignment
        col = torch.arange(n_k, device=query.device)[None, :]
        mask = col <= pos
        if sliding_window:
            mask &= col > pos - sliding_window
        out[:, q0:q1] = F.scaled_dot_product_attention(
            query[None, :, q0:q1], keys[None, :, k0:k1], values[None, :, k0:k1],
            attn_mask=mask, scale=scaling, enable_gqa=True,
        )[0]  # fmt: skip
    return out.transpose(0, 1).unsqueeze(0), None


def _flash_kernel_available() -> bool:
    try:
        packing._flash_attn()
    except Exception as exc:  # noqa: BLE001 - any failure to fetch or load the kernel
        logger.warning("flash-attention-3 kernel unavailable (%s): using SDPA tree attention", exc)
        return False
    return True


def apply_cpu_compat() -> bool:
    """Replace TRL's two GPU-only pieces when no GPU is present (idempotent).

    Call before constructing ``AsyncGRPOTrainer``.

    Returns:
        Whether the SDPA tree attention is in use.
    """
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        async_grpo_trainer.get_peak_flops_per_device = peak_flops_per_device
    use_sdpa = not on_gpu or not _flash_kernel_available()
    if use_sdpa:
        packing.tree_attention = sdpa_tree_attention
        packing.register_tree_attention()
    return use_sdpa
