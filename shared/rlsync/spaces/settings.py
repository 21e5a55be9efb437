"""The roles' device and model defaults; their settings are read with :mod:`rlsync.config`.

:func:`~rlsync.config.from_env` and :func:`~rlsync.config.settings_table` are re-exported here for the
Spaces' config modules.
"""

from __future__ import annotations

import os
import socket

from ..config import from_env, settings_table

__all__ = ["GPU_DEFAULT_MODEL", "default_model", "from_env", "resolve_device", "settings_table", "space_owner"]

GPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


def resolve_device(device: str) -> str:
    """``"auto"`` becomes ``"cuda"`` when a GPU is visible, else ``"cpu"``; other values pass through."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_model(device: str) -> str | None:
    """The model used when none is set: Qwen3-0.6B on a GPU, ``None`` (the tiny offline model) on CPU."""
    return GPU_DEFAULT_MODEL if device.startswith("cuda") else None


def space_owner() -> str:
    """This trainer's id for the run lock: the Space's id (``SPACE_ID``, kept across restarts), else the host name."""
    return os.environ.get("SPACE_ID") or socket.gethostname()
