"""Tensor payloads between vLLM's driver and its workers: safetensors blobs, inline bytes when small, a file in a
spool folder when large (``collective_rpc`` arguments are msgpack)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch

from rlsync.patch import TensorPatch

#: Payloads up to this size travel inline through ``collective_rpc``; larger ones via a file.
INLINE_PAYLOAD_BYTES = 64 << 20

_INDEX = "\x00index"
_VALUES = "\x00values"


def pack_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    meta: Mapping[str, Any] | None = None,
    spool_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Serialize tensors for a ``collective_rpc`` call (safetensors format).

    Args:
        tensors: Tensors to send (moved to CPU, made contiguous).
        meta: JSON-serializable metadata carried along.
        spool_dir: Folder for payloads above :data:`INLINE_PAYLOAD_BYTES`
            (default: the system temporary folder). Must be visible to the workers.

    Returns:
        ``{"data": bytes, "meta": ...}`` or ``{"path": str, "meta": ...}``.
    """
    from safetensors.torch import save, save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in cpu.values())
    info = {"meta": json.dumps(dict(meta or {}))}
    if nbytes <= INLINE_PAYLOAD_BYTES:
        return {"data": save(cpu, metadata=info), "meta": info["meta"]}
    folder = Path(spool_dir or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-sync-{uuid.uuid4().hex}.safetensors"
    save_file(cpu, str(path), metadata=info)
    return {"path": str(path), "meta": info["meta"]}


def unpack_tensors(payload: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of :func:`pack_tensors`. A spooled file is left for its sender to remove.

    Args:
        payload: What :func:`pack_tensors` returned.

    Returns:
        ``(tensors, meta)``.
    """
    from safetensors.torch import load, load_file

    tensors = load(bytes(payload["data"])) if "data" in payload else load_file(payload["path"])
    return tensors, json.loads(payload.get("meta") or "{}")


def pack_patches(patches: Mapping[str, TensorPatch], **kwargs: Any) -> dict[str, Any]:
    """Serialize sparse patches (see :func:`pack_tensors`)."""
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, patch in patches.items():
        small = math.prod(patch.shape) < 2**31
        tensors[name + _INDEX] = patch.index.to(torch.int32) if small else patch.index  # halves index bytes
        tensors[name + _VALUES] = patch.values
        shapes[name] = list(patch.shape)
    return pack_tensors(tensors, meta={"shapes": shapes}, **kwargs)


def unpack_patches(payload: Mapping[str, Any]) -> dict[str, TensorPatch]:
    """Inverse of :func:`pack_patches`. Indices stay ``int32`` where they were sent so: vLLM's
    sparse loader takes them as they are (no widening copy)."""
    tensors, meta = unpack_tensors(payload)
    return {
        name: TensorPatch(tensors[name + _INDEX], tensors[name + _VALUES], tuple(shape))
        for name, shape in meta["shapes"].items()
    }
