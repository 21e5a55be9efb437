"""The vLLM plug-in's settings: what a worker follows when ``init_info`` does not say, from the replica's own
variables (``ROLLOUT_BUCKET``, ``ROLLOUT_CHAIN``)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..config import from_env

__all__ = ["ENV_PREFIX", "BackendDefaults", "backend_defaults"]

#: The prefix of the variables a worker falls back on, the rollout replica's.
ENV_PREFIX = "ROLLOUT"


@dataclasses.dataclass(frozen=True)
class BackendDefaults:
    """The bucket URL and the chain (``bf16``, ``fp8``: :class:`~rlsync.fp8.Chain`) a worker follows by default."""

    bucket: str = ""
    chain: str = ""


def backend_defaults(environ: Mapping[str, str] | None = None) -> BackendDefaults:
    """The defaults from ``ROLLOUT_BUCKET`` and ``ROLLOUT_CHAIN`` (``environ``, default ``os.environ``)."""
    return from_env(BackendDefaults, ENV_PREFIX, environ)
