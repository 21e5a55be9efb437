"""The soak's trial kinds, one module each: ``trial_<kind>(rng, workdir, **options) -> TrialResult``
and ``DEFAULT_TRIALS``. A new fault kind is one module here plus one line in :data:`MODULES`."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from ..invariants import TrialResult
from . import (
    apply_interrupt,
    bucket_damage,
    checkpoints,
    flaky_storage,
    hostile_positions,
    hostile_replicas,
    hostile_tasks,
    hostile_values,
    hub_hostile,
    hub_storage,
    lock_garbage,
    pointer_entries,
    publisher_kill,
    sharded_checkpoints,
    subscriber_kill,
    two_trainers,
)

#: Trial kinds in the order a run draws their seeds.
MODULES = (publisher_kill, subscriber_kill, apply_interrupt, bucket_damage, flaky_storage, two_trainers, hub_storage, hostile_replicas,
           lock_garbage, pointer_entries, checkpoints, hostile_tasks, hostile_positions,
           sharded_checkpoints, hub_hostile, hostile_values)  # fmt: skip

TRIALS: dict[str, Callable[[random.Random, Path], TrialResult]] = {
    m.__name__.rsplit(".", 1)[1]: getattr(m, "trial_" + m.__name__.rsplit(".", 1)[1]) for m in MODULES
}
DEFAULT_TRIALS: dict[str, int] = {m.__name__.rsplit(".", 1)[1]: m.DEFAULT_TRIALS for m in MODULES}
KINDS = tuple(DEFAULT_TRIALS)
