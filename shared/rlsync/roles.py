"""The roles of a run, :class:`Role`: the one place their names are spelled.

A run has three roles: the trainer (publishes weights, learns from scored samples), the rollout replicas
(follow the weights, answer task batches) and the environment (issues task batches, scores the answers).
Code names a role by its member, never by a string: each role's entry point (``python -m trainer_space``,
its Space's page) names its own, and library calls that take a role refuse a plain string. A name read from
outside is parsed where it comes in, ``Role(name)`` (``ValueError`` on an unknown one).
"""

from __future__ import annotations

import enum

__all__ = ["Role"]


class Role(enum.StrEnum):
    """A role of a run; its value is its name (``"trainer"``, ``"rollout"``, ``"env"``)."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    ENV = "env"

    @property
    def env_prefix(self) -> str:
        """The prefix of the role's variables: ``TRAINER``, ``ROLLOUT``, ``ENV`` (``ROLLOUT_<FIELD>``,
        ``ROLLOUT_HUB_<FIELD>``)."""
        return self.value.upper()
