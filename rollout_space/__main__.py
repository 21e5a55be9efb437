"""Run one rollout replica headless: ``python -m rollout_space [--bucket URL] [--replica-id ID]``.

Every setting also comes from ``ROLLOUT_<FIELD>`` environment variables.
"""

from __future__ import annotations

from rlsync.roles import Role
from rlsync.spaces.runner import run_role

from .config import ReplicaConfig


def build(config: ReplicaConfig):
    """The role, imported once the flags are read (``--help`` imports no torch)."""
    from .replica import Replica

    return Replica(config)


if __name__ == "__main__":
    run_role(Role.ROLLOUT, ReplicaConfig, build)
