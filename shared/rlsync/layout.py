"""Every key of a run's bucket, in one place.

Layout of a bucket::

    latest.json                                  the pointer, written last (rlsync.protocol.manifest)
    lock.json                                    the run lock (rlsync.protocol.lock)
    anchors/000000000010-e0003/model.safetensors full bf16 snapshots (or model-0000k-of-0000n.safetensors + index)
    deltas/000000000011-e0003.safetensors        changed elements only (or .../part-00001-of-00004.safetensors)
    checkpoints/0000000010/...                   the trainer's checkpoints, COMPLETE.json last
    adapters/...                                 a LoRA run's adapter chain: the same layout under this prefix
    fp8/...                                      an FP8 serving chain of the bf16 weights: the same layout under this prefix
    control/publisher.json                       the anchor policy, set from any panel
    control/demand.json                          what the trainer asks the env for
    control/desired/<role>/<instance>.json       what the owner wants running on one Space (Start / Stop)
    tasks/0000000005.json                        a batch of tasks
    rollouts/0000000005/<replica>.json           a replica's answers to it
    scores/0000000005/<replica>.json             their scores
    claims/0000000005/<replica>.json             a replica generating the batch (others take the next one)
    status/<replica>.json                        one status object per replica
    metrics/<role>.json                          one metrics object per role

``e0003`` is the run-lock epoch of the trainer that wrote the files: a trainer taken over
mid-upload writes under its own epoch, so it can never overwrite the files of the trainer
that took over, even at the same step.

Nothing else in the code spells a prefix: modules import the constants, builders and
patterns below.
"""

from __future__ import annotations

import re

from .roles import Role

__all__ = [
    "POINTER_KEY", "LOCK_KEY", "ANCHOR_PREFIX", "DELTA_PREFIX", "CHECKPOINTS_PREFIX", "CHECKPOINT_MARKER",
    "ADAPTER_PREFIX", "FP8_PREFIX", "CONTROL_PREFIX", "CONTROL_KEY", "DEMAND_KEY", "DESIRED_PREFIX", "TASKS_PREFIX",
    "ROLLOUTS_PREFIX", "SCORES_PREFIX", "CLAIMS_PREFIX", "STATUS_PREFIX", "METRICS_PREFIX", "REPORT_PREFIXES", "MAX_BATCH",
    "MAX_STEP", "MAX_EPOCH", "MAX_BASE_STEP", "MAX_BASE_EPOCH",
    "ANCHOR_FILE", "DELTA_FILE", "TRAINER_READS", "ROLLOUT_READS", "ENV_READS", "ROLE_READS",
    "anchor_folder", "delta_key", "part_name", "delta_part_key", "checkpoint_folder", "check_id", "is_id", "task_key",
    "rollout_key", "score_key", "claim_key", "status_key", "metrics_key", "desired_key", "batch_of", "replica_of",
]  # fmt: skip

# -- the weights chain (rlsync.protocol) -------------------------------------------------------------
POINTER_KEY = "latest.json"
LOCK_KEY = "lock.json"
ANCHOR_PREFIX = "anchors/"
DELTA_PREFIX = "deltas/"
CHECKPOINTS_PREFIX = "checkpoints/"
#: The object a checkpoint folder's upload ends with.
CHECKPOINT_MARKER = "COMPLETE.json"
#: A LoRA run's adapter chain: the weights chain's layout again, under this prefix.
ADAPTER_PREFIX = "adapters/"
#: The FP8 serving chain a trainer may publish beside the bf16 one (rlsync.fp8): the same layout under this prefix.
FP8_PREFIX = "fp8/"

# -- control objects --------------------------------------------------------------------------------
CONTROL_PREFIX = "control/"
CONTROL_KEY = f"{CONTROL_PREFIX}publisher.json"
DEMAND_KEY = f"{CONTROL_PREFIX}demand.json"
#: What the owner of each Space wants running, one object per role and Space (rlsync.spaces.desired).
DESIRED_PREFIX = f"{CONTROL_PREFIX}desired/"

# -- the RL loop's exchange (rlsync.spaces.exchange, rlsync.trl.rollout_worker) ---------------------
TASKS_PREFIX = "tasks/"
ROLLOUTS_PREFIX = "rollouts/"
SCORES_PREFIX = "scores/"
#: A replica's claim on a task batch it is generating (``claims/<batch>/<replica>.json``), so that others take the next one.
CLAIMS_PREFIX = "claims/"
STATUS_PREFIX = "status/"
METRICS_PREFIX = "metrics/"
#: A role's own reports: no other role answers them (see :attr:`~rlsync.bucket.watch.WatchConfig.quiet_prefixes`).
REPORT_PREFIXES = (STATUS_PREFIX, METRICS_PREFIX)
#: The largest batch number (keys hold ten digits).
MAX_BATCH = 10**10 - 1

# -- what each role reads: its watched view lists and follows only these (rlsync.bucket.watch) ------
#: The pointers of the chains a follower serves (weights, a LoRA run's adapters, the FP8 chain): it reads
#: the files they name by key, never listing them.
_POINTERS = (POINTER_KEY, ADAPTER_PREFIX + POINTER_KEY, FP8_PREFIX + POINTER_KEY)
#: The trainer: the chains it publishes (whose files it lists to retain and clean up) and their lock, its
#: checkpoints, the panels' control objects, the scored samples.
TRAINER_READS = (POINTER_KEY, LOCK_KEY, ANCHOR_PREFIX, DELTA_PREFIX, ADAPTER_PREFIX, FP8_PREFIX, CHECKPOINTS_PREFIX,
                 CONTROL_PREFIX, SCORES_PREFIX)  # fmt: skip
#: A rollout replica: the chains' pointers, the demand, the task batches and who answered or claimed them.
ROLLOUT_READS = (*_POINTERS, CONTROL_PREFIX, TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX, CLAIMS_PREFIX)
#: The env: the newest published version (the adapter chain's pointer first), the demand, its batches and
#: their answers, scores and claims.
ENV_READS = (POINTER_KEY, ADAPTER_PREFIX + POINTER_KEY, CONTROL_PREFIX, TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX,
             CLAIMS_PREFIX)  # fmt: skip
#: Each role's reads. Keys outside them (another role's reports, a flood under a prefix the role does not
#: read) cost the role no listing page; a read of one asks the bucket.
ROLE_READS: dict[Role, tuple[str, ...]] = {
    Role.TRAINER: TRAINER_READS, Role.ROLLOUT: ROLLOUT_READS, Role.ENV: ENV_READS
}

#: The largest version a key holds (twenty digits).
MAX_STEP = 10**20 - 1
#: The largest run-lock epoch a trainer writes, in the lock and in keys (exact in any JSON reader's double);
#: readers parse the sixteen digits the key grammar allows.
MAX_EPOCH = 2**53 - 1
#: A version or epoch read from the bucket above these leaves no room, and a trainer never builds on it (a new
#: run's first version after the old run's newest, the next run-lock epoch after the lock's or the pointer's):
#: a planted pointer or lock near the largest could otherwise leave no number to write. Such an object is
#: refused and counted like a garbage lock or an unreadable pointer.
MAX_BASE_STEP = MAX_STEP // 2
MAX_BASE_EPOCH = MAX_EPOCH // 2

_STEP = r"(\d{12,20})"
_EPOCH = r"(?:-e(\d{4,16}))?"  # format version 1 had no epoch
#: An anchor's file; groups: step, epoch, file name.
ANCHOR_FILE = re.compile(
    re.escape(ANCHOR_PREFIX) + _STEP + _EPOCH + r"/(model(?:-\d{5}-of-\d{5})?\.safetensors(?:\.index\.json)?)"
)
#: A delta's file; groups: step, epoch, then part and parts for a sharded delta.
DELTA_FILE = re.compile(
    re.escape(DELTA_PREFIX) + _STEP + _EPOCH + r"(?:\.safetensors|/part-(\d{5})-of-(\d{5})\.safetensors)"
)
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BATCH_KEY = re.compile(
    rf"^(?:{re.escape(TASKS_PREFIX)}([0-9]{{10}})\.json"
    rf"|(?:{re.escape(ROLLOUTS_PREFIX)}|{re.escape(SCORES_PREFIX)}|{re.escape(CLAIMS_PREFIX)})([0-9]{{10}})/[^/]+)$"
)


def _version(step: int, epoch: int) -> str:
    """``<step>-e<epoch>`` of a key; a number readers would refuse is never written.

    Raises:
        ValueError: ``step`` is not in ``[0, MAX_STEP]`` or ``epoch`` not in ``[0, MAX_EPOCH]``.
    """
    if not (0 <= step <= MAX_STEP and 0 <= epoch <= MAX_EPOCH):
        raise ValueError(f"version {step} of epoch {epoch} is past the keys' [0, {MAX_STEP}] and [0, {MAX_EPOCH}]")
    return f"{step:012d}-e{epoch:04d}"


def anchor_folder(step: int, epoch: int) -> str:
    """Key prefix of the anchor of ``step`` written under run-lock epoch ``epoch`` (see :func:`_version`)."""
    return f"{ANCHOR_PREFIX}{_version(step, epoch)}"


def delta_key(step: int, epoch: int) -> str:
    """Key of the delta producing ``step``, written under run-lock epoch ``epoch`` (see :func:`_version`)."""
    return f"{DELTA_PREFIX}{_version(step, epoch)}.safetensors"


def part_name(part: int, parts: int) -> str:
    """File name of part ``part`` (0-based) of ``parts`` of a sharded delta."""
    return f"part-{part + 1:05d}-of-{parts:05d}.safetensors"


def delta_part_key(step: int, epoch: int, part: int, parts: int) -> str:
    """Key of one part of the sharded delta producing ``step``."""
    return f"{DELTA_PREFIX}{_version(step, epoch)}/{part_name(part, parts)}"


def checkpoint_folder(step: int, prefix: str = CHECKPOINTS_PREFIX) -> str:
    """Key prefix of the checkpoint of ``step``."""
    return f"{prefix}{step:010d}"


def is_id(value: object) -> bool:
    """Whether ``value`` is a valid replica or role id: 1-64 of ``A-Z a-z 0-9 _ . -``, not ``.`` or ``..``."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None and value not in (".", "..")


def check_id(value: str) -> str:
    """Check a replica or role id used inside object keys.

    Raises:
        ValueError: not an id (see :func:`is_id`).
    """
    if not is_id(value):
        raise ValueError(f"invalid id {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return value


def task_key(batch: int) -> str:
    """``tasks/<batch>.json``, ten digits.

    Raises:
        ValueError: ``batch`` is not in ``[0, MAX_BATCH]``.
    """
    if not 0 <= batch <= MAX_BATCH:
        raise ValueError(f"batch {batch} is not in [0, {MAX_BATCH}]")
    return f"{TASKS_PREFIX}{batch:010d}.json"


def _replica_key(prefix: str, batch: int, replica: str) -> str:
    return f"{prefix}{batch:010d}/{check_id(replica)}.json"


def rollout_key(batch: int, replica: str) -> str:
    """``rollouts/<batch>/<replica>.json``: a replica's completions of a batch."""
    return _replica_key(ROLLOUTS_PREFIX, batch, replica)


def score_key(batch: int, replica: str) -> str:
    """``scores/<batch>/<replica>.json``: the env's scores of a replica's completions."""
    return _replica_key(SCORES_PREFIX, batch, replica)


def claim_key(batch: int, replica: str) -> str:
    """``claims/<batch>/<replica>.json``: a replica's claim on a batch."""
    return _replica_key(CLAIMS_PREFIX, batch, replica)


def status_key(replica: str) -> str:
    return f"{STATUS_PREFIX}{check_id(replica)}.json"


def metrics_key(role: str) -> str:
    return f"{METRICS_PREFIX}{check_id(role)}.json"


def desired_key(role: Role, instance: str) -> str:
    """``control/desired/<role>/<instance>.json``: what the owner wants of one Space's role (its instance id,
    :func:`check_id`)."""
    return f"{DESIRED_PREFIX}{Role(role).value}/{check_id(instance)}.json"


def batch_of(key: str) -> int | None:
    """The batch number in a ``tasks/``, ``rollouts/``, ``scores/`` or ``claims/`` key written as this module writes
    them (ten digits; ``tasks/5.json`` or ``tasks/0000000005.x.json`` are not batch keys)."""
    found = _BATCH_KEY.fullmatch(key)
    return int(found.group(1) or found.group(2)) if found else None


def replica_of(key: str) -> str | None:
    """The replica id in a ``rollouts/`` or ``scores/`` key; ``None`` unless it is a valid id (see :func:`check_id`)."""
    parts = key.split("/")
    replica = parts[2][: -len(".json")] if len(parts) == 3 and parts[2].endswith(".json") else None
    return replica if is_id(replica) else None
