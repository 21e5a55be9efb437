"""Run the trainer headless: ``python -m trainer_space [--bucket URL] [--max-steps N]``.

Every setting also comes from ``TRAINER_<FIELD>`` environment variables.
"""

from __future__ import annotations

from rlsync.roles import Role
from rlsync.spaces.runner import run_role

from .config import TrainerConfig


def build(config: TrainerConfig):
    """The role, imported once the flags are read (``--help`` imports no torch)."""
    from .trainer import Trainer

    return Trainer(config)


if __name__ == "__main__":
    run_role(Role.TRAINER, TrainerConfig, build)
