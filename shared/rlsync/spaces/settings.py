"""The roles' device and model defaults; their settings are read with :mod:`rlsync.config`.

:func:`~rlsync.config.from_env` and :func:`~rlsync.config.settings_table` are re-exported here for the
Spaces' config modules.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, Mapping

from ..config import from_env, settings_table

__all__ = [
    "DEFAULT_PORT", "GPU_DEFAULT_MODEL", "SpaceIdentity", "default_model", "from_env", "metrics_every_field", "poll_field",
    "resolve_device", "server_port", "settings_table", "space_owner",
]  # fmt: skip

GPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
#: A panel's port where neither ``PORT`` nor ``GRADIO_SERVER_PORT`` says (the one a Space serves).
DEFAULT_PORT = 7860


def poll_field() -> Any:
    """A role's ``poll_s`` setting: seconds between reads of an unwatched bucket (0.5)."""
    return dataclasses.field(default=0.5, metadata={"help": "seconds between bucket polls (a Hub bucket is watched instead)"})


def metrics_every_field() -> Any:
    """A role's ``metrics_every_s`` setting: seconds between its metrics writes on a Hub bucket (30)."""
    return dataclasses.field(default=30.0, metadata={"help": "seconds between metrics writes on a Hub bucket"})


def resolve_device(device: str) -> str:
    """``"auto"`` becomes ``"cuda"`` when a GPU is visible, else ``"cpu"``; other values pass through."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_model(device: str) -> str | None:
    """The model used when none is set: Qwen3-0.6B on a GPU, ``None`` (the tiny offline model) on CPU."""
    return GPU_DEFAULT_MODEL if device.startswith("cuda") else None


@dataclasses.dataclass(frozen=True)
class SpaceIdentity:
    """Which Space this process runs in (``SPACE_ID``, ``SPACE_AUTHOR_NAME``, set by the Hub; empty elsewhere)."""

    id: str = ""
    author_name: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SpaceIdentity":
        """The identity from ``SPACE_<FIELD>`` (``environ``, default ``os.environ``)."""
        return from_env(cls, "SPACE", environ)


def space_owner() -> str:
    """This trainer's id for the run lock: the Space's id (``SPACE_ID``, kept across restarts), else the host name."""
    return SpaceIdentity.from_env().id or socket.gethostname()


def server_port(environ: Mapping[str, str] | None = None) -> int:
    """A panel's port: ``PORT`` (a Space's), else ``GRADIO_SERVER_PORT``, else :data:`DEFAULT_PORT`.

    Raises:
        ConfigurationError: the variable is not a whole number.
    """
    from ..errors import ConfigurationError

    environ = os.environ if environ is None else environ
    raw = environ.get("PORT") or environ.get("GRADIO_SERVER_PORT") or str(DEFAULT_PORT)
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"PORT / GRADIO_SERVER_PORT: expected a port number, got {raw!r}") from None
