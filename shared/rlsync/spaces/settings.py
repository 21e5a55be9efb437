"""The roles' device, model and bucket defaults; their settings are read with :mod:`rlsync.config`.

On a Space (the runtime sets ``SYSTEM=spaces``, ``SPACE_ID`` and ``SPACE_AUTHOR_NAME``) the three roles' bucket
defaults to :func:`default_bucket`, ``hf://buckets/<SPACE_AUTHOR_NAME>/rl-sync``: the same name in a trainer, a
rollout and an env Space of one owner, so that three duplicates meet in one bucket with no variable set, and none
follows the bucket of the template it was duplicated from.

:func:`~rlsync.config.from_env` and :func:`~rlsync.config.settings_table` are re-exported here for the
Spaces' config modules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from ..config import from_env, settings_table

__all__ = [
    "DEFAULT_PORT", "GPU_DEFAULT_MODEL", "LOCAL_BUCKET", "SPACE_BUCKET_NAME", "SpaceIdentity", "bucket_field",
    "default_bucket", "default_model", "from_env", "instance_id", "metrics_every_field", "on_space", "poll_field",
    "resolve_device", "server_port", "settings_table", "space_owner",
]  # fmt: skip

GPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
#: A panel's port where neither ``PORT`` nor ``GRADIO_SERVER_PORT`` says (the one a Space serves).
DEFAULT_PORT = 7860
#: The bucket of a role run outside a Space: a folder beside the working directory.
LOCAL_BUCKET = "./runs/bucket"
#: The name of the bucket every Space of one owner uses unless told otherwise.
SPACE_BUCKET_NAME = "rl-sync"


#: Characters an id inside object keys may not hold (:func:`instance_id` writes ``_`` for them).
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def on_space(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs on a Space (the runtime sets ``SYSTEM=spaces`` and ``SPACE_ID``)."""
    env = os.environ if environ is None else environ
    return env.get("SYSTEM") == "spaces" and bool(env.get("SPACE_ID"))


def instance_id(environ: Mapping[str, str] | None = None) -> str:
    """This Space's id inside keys: ``SPACE_ID`` with ``/`` as ``--`` (else the host name), other characters
    outside ``A-Z a-z 0-9 _ . -`` as ``_``; one over 64 characters keeps 55 and a hash of the whole."""
    environ = os.environ if environ is None else environ
    raw = environ.get("SPACE_ID") or socket.gethostname() or "local"
    safe = _UNSAFE.sub("_", raw.replace("/", "--")).strip(".") or "local"
    if len(safe) > 64:
        safe = f"{safe[:55]}-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"
    return safe


def default_bucket(environ: Mapping[str, str] | None = None) -> str:
    """The bucket a role uses when none is set: ``hf://buckets/<SPACE_AUTHOR_NAME>/rl-sync`` on a Space
    (the Space owner's, created at the first Start when the token can), else :data:`LOCAL_BUCKET`."""
    env = os.environ if environ is None else environ
    owner = env.get("SPACE_AUTHOR_NAME", "")
    return f"hf://buckets/{owner}/{SPACE_BUCKET_NAME}" if on_space(env) and owner else LOCAL_BUCKET


def bucket_field(help: str) -> Any:  # noqa: A002 - the field's help text, as the other fields name it
    """A role's ``bucket`` setting, defaulting to :func:`default_bucket` when the settings are built."""
    help = f"{help}; default {LOCAL_BUCKET}, on a Space hf://buckets/<SPACE_AUTHOR_NAME>/{SPACE_BUCKET_NAME}"
    return dataclasses.field(default_factory=default_bucket, metadata={"help": help, "shown_default": LOCAL_BUCKET})


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
