"""Run the environment simulator headless: ``python -m env_space [--bucket URL] [--environment NAME]``.

Every setting also comes from ``ENV_<FIELD>`` environment variables.
"""

from __future__ import annotations

from rlsync.roles import Role
from rlsync.spaces.runner import run_role

from .config import EnvConfig


def build(config: EnvConfig):
    """The role, imported once the flags are read (``--help`` imports no torch)."""
    from .simulator import EnvSimulator

    return EnvSimulator(config)


if __name__ == "__main__":
    run_role(Role.ENV, EnvConfig, build)
