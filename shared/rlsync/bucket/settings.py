"""The Hub backend's settings (its registry entry's ``settings``: ``rlsync.bucket.hf``) in one object, and the one
call that reads them from the environment, refusing settings that cannot work together at start.

>>> settings = BucketSettings.from_env(Role.ROLLOUT)   # at an entry point: HF_BUCKET_*, HUB_*, ROLLOUT_HUB_*
>>> bucket = watch(open_bucket(url, settings=settings), settings.watch)

Library code never reads the environment: without settings, a bucket has the defaults of
[`HfTransferConfig`], [`BudgetConfig`] and [`WatchConfig`].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from ..config import from_env
from ..errors import ConfigurationError
from ..roles import Role
from .budget import TRAINER_WEIGHT, BudgetConfig, RequestMeter
from .hf_transport import HfTransferConfig
from .watch import WatchConfig

__all__ = ["HUB_ENV_PREFIX", "ROLE_WEIGHTS", "TRANSFER_ENV_PREFIX", "BucketSettings", "role_weight"]

#: The prefix of the timeout variables (``HF_BUCKET_CONNECT_TIMEOUT``, ``HF_BUCKET_READ_TIMEOUT``).
TRANSFER_ENV_PREFIX = "HF_BUCKET"
#: The prefix of the budget and watch variables (``HUB_SHARE``, ``HUB_FEED``); ``<ROLE>_HUB_<FIELD>``
#: overrides ``HUB_<FIELD>`` for one role.
HUB_ENV_PREFIX = "HUB"
#: Each role's default :attr:`BudgetConfig.weight` where it is not 1 (``HUB_WEIGHT`` / ``<ROLE>_HUB_WEIGHT`` win).
ROLE_WEIGHTS: dict[Role, float] = {Role.TRAINER: TRAINER_WEIGHT}


def _prefixes(role: Role | None) -> tuple[str, ...]:
    return (HUB_ENV_PREFIX, f"{role.env_prefix}_{HUB_ENV_PREFIX}") if role is not None else (HUB_ENV_PREFIX,)


@dataclasses.dataclass(frozen=True)
class _WeightVariable:
    """`HUB_WEIGHT` / `<ROLE>_HUB_WEIGHT` alone, `None` where neither is set."""

    weight: float | None = None


@dataclasses.dataclass(frozen=True)
class _ShareVariable:
    """`HUB_SHARE` / `<ROLE>_HUB_SHARE` alone."""

    share: int = BudgetConfig.share


def _budget(role: Role | None, environ: Mapping[str, str] | None) -> BudgetConfig:
    """The role's budget, or a :class:`ConfigurationError` that names the variables and a share that works."""
    prefixes = _prefixes(role)
    weight = role_weight(role, environ)
    try:
        return from_env(BudgetConfig, prefixes, environ, weight=weight)
    except ConfigurationError as exc:
        share = from_env(_ShareVariable, prefixes, environ).share
        if weight > share:
            who, weights = role.value if role else "process", " or ".join(f"{p}_WEIGHT" for p in prefixes)
            raise ConfigurationError(
                f"{exc}: the {who}'s weight {weight:g} ({weights}, default {ROLE_WEIGHTS.get(role, 1.0):g}) is more"
                f" than {HUB_ENV_PREFIX}_SHARE={share}, the weights of every role on the token added up:"
                f" set {HUB_ENV_PREFIX}_SHARE={max(1, math.ceil(weight))} or more"
            ) from None
        raise


def role_weight(role: Role | None, environ: Mapping[str, str] | None = None) -> float:
    """A role's part of the token's budget (:attr:`BudgetConfig.weight`): `HUB_WEIGHT` then
    `<ROLE>_HUB_WEIGHT`, else :data:`ROLE_WEIGHTS` (1 for a role not named there).

    Entry points that run several roles on one token add their weights up for `HUB_SHARE`.

    Args:
        role ([`~rlsync.roles.Role`]): The role; `None`: `HUB_WEIGHT` only.
        environ (`Mapping[str, str]`, *optional*): The variables (default: `os.environ`).

    Returns:
        `float`: the weight.

    Raises:
        `ValueError`: a weight variable is not a number (the message names it).
    """
    weight = from_env(_WeightVariable, _prefixes(role), environ).weight
    return ROLE_WEIGHTS.get(role, 1.0) if weight is None else weight  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class BucketSettings:
    """How a role's Hub bucket makes requests: timeouts, request budget, and how it follows changes.

    Args:
        transfer ([`HfTransferConfig`], *optional*):
            Request timeouts, process-wide: the first Hub bucket of the process installs them
            (`rlsync.bucket.hf_transport.install` replaces them). `None`: the defaults.
        budget ([`BudgetConfig`], *optional*):
            The role's share of the Hub's request budget; defaults to `BudgetConfig()`.
        watch ([`WatchConfig`], *optional*):
            How [`~rlsync.bucket.watch.watch`] follows the bucket; defaults to `WatchConfig()`.
        role ([`~rlsync.roles.Role`], *optional*):
            The role, for the request meter's logs and panel.
    """

    transfer: HfTransferConfig | None = None
    budget: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)
    watch: WatchConfig = dataclasses.field(default_factory=WatchConfig)
    role: Role | None = None
    _meter: RequestMeter = dataclasses.field(init=False, repr=False, compare=False, metadata={"env": None})

    def __post_init__(self) -> None:
        object.__setattr__(self, "_meter", RequestMeter(self.budget, role=self.role))

    @classmethod
    def from_env(cls, role: Role | None = None, environ: Mapping[str, str] | None = None) -> "BucketSettings":
        """The settings from `HF_BUCKET_<FIELD>` (timeouts) and `HUB_<FIELD>` then `<ROLE>_HUB_<FIELD>`
        (budget and watch) variables; `HUB_PACING` sets `BudgetConfig.enabled`. A role's weight defaults to
        :data:`ROLE_WEIGHTS` (the trainer's publishes are the product) unless a variable sets it.

        Args:
            role ([`~rlsync.roles.Role`], *optional*): The role; `None`: no role overrides.
            environ (`Mapping[str, str]`, *optional*): The variables (default: `os.environ`).

        Returns:
            [`BucketSettings`]: the settings.

        Raises:
            `ConfigurationError`: a variable has an invalid value (the message names it), or the budget is invalid
                (a role's weight over the share: the message names the variables and a share that works).
            `TypeError`: `role` is not a [`~rlsync.roles.Role`] (a plain name: parse it first).
        """
        if role is not None and not isinstance(role, Role):
            raise TypeError(f"role must be a Role (Role({role!r}) parses a name), not {type(role).__name__}")
        prefixes = _prefixes(role)
        return cls(
            transfer=from_env(HfTransferConfig, TRANSFER_ENV_PREFIX, environ),
            budget=_budget(role, environ),
            watch=from_env(WatchConfig, prefixes, environ),
            role=role,
        )

    def meter(self) -> RequestMeter:
        """The [`RequestMeter`] with this budget: one per settings, so that the Hub requests of what a role opens
        with its settings (its bucket, and the token check before it) are counted and paced together."""
        return self._meter
