"""What the three Spaces exchange through the bucket besides weights.

Layout (next to ``latest.json``, ``anchors/`` and ``deltas/``)::

    tasks/<batch>.json               env -> replicas: prompts (answers stay in the env)
    rollouts/<batch>/<replica>.json  replica -> env: G completions per task, token ids,
                                     sampling log-probs, the policy version that made them
    scores/<batch>/<replica>.json    env -> trainer: the same samples with rewards
    status/<replica>.json            each replica: version, lag, apply time, throughput
    metrics/<role>.json              trainer and env: recent figures for the panels

Every object is small JSON written whole. Readers treat anything malformed as
absent (and log it): a bad object never stops a role.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from typing import Any

from ..bucket import Bucket, BucketError, ObjectNotFoundError, validate_key

logger = logging.getLogger(__name__)

TASKS_PREFIX = "tasks/"
ROLLOUTS_PREFIX = "rollouts/"
SCORES_PREFIX = "scores/"
STATUS_PREFIX = "status/"
METRICS_PREFIX = "metrics/"
MAX_OBJECT_BYTES = 64 * 1024 * 1024
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_id(value: str) -> str:
    """Check a replica or role id used inside object keys."""
    if not isinstance(value, str) or not _ID.fullmatch(value) or value in (".", ".."):
        raise ValueError(f"invalid id {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return value


def task_key(batch: int) -> str:
    return f"{TASKS_PREFIX}{batch:010d}.json"


def rollout_key(batch: int, replica: str) -> str:
    return f"{ROLLOUTS_PREFIX}{batch:010d}/{check_id(replica)}.json"


def score_key(batch: int, replica: str) -> str:
    return f"{SCORES_PREFIX}{batch:010d}/{check_id(replica)}.json"


def status_key(replica: str) -> str:
    return f"{STATUS_PREFIX}{check_id(replica)}.json"


def metrics_key(role: str) -> str:
    return f"{METRICS_PREFIX}{check_id(role)}.json"


def batch_of(key: str) -> int | None:
    """The batch number in a ``tasks/``, ``rollouts/`` or ``scores/`` key."""
    part = key.split("/")[1].split(".")[0]
    return int(part) if part.isdigit() else None


def replica_of(key: str) -> str | None:
    """The replica id in a ``rollouts/`` or ``scores/`` key; ``None`` unless it is a valid id (see :func:`check_id`)."""
    parts = key.split("/")
    replica = parts[2][: -len(".json")] if len(parts) == 3 and parts[2].endswith(".json") else None
    return replica if replica is not None and _ID.fullmatch(replica) and replica not in (".", "..") else None


def put_json(bucket: Bucket, key: str, doc: Any) -> None:
    """Write ``doc`` as a JSON object."""
    bucket.put(validate_key(key), json.dumps(doc, separators=(",", ":")).encode())


def get_json(bucket: Bucket, key: str) -> Any | None:
    """Read a JSON object; ``None`` if missing, too large or malformed (logged)."""
    try:
        data = bucket.get(key)
    except ObjectNotFoundError:
        return None
    if len(data) > MAX_OBJECT_BYTES:
        logger.warning("ignoring %s: %d bytes is too large", key, len(data))
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: deeply nested
        logger.warning("ignoring malformed %s: %s", key, exc)
        return None


@dataclasses.dataclass
class Sample:
    """One completion of one task, as the trainer needs it."""

    task_id: str
    prompt: str
    completion: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    reward: float | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Sample":
        sample = cls(
            task_id=str(doc["task_id"]),
            prompt=str(doc["prompt"]),
            completion=str(doc["completion"]),
            prompt_ids=[int(t) for t in doc["prompt_ids"]],
            token_ids=[int(t) for t in doc["token_ids"]],
            logprobs=[float(x) for x in doc["logprobs"]],
            version=int(doc["version"]),
            reward=None if doc.get("reward") is None else float(doc["reward"]),
        )
        if len(sample.logprobs) != len(sample.token_ids):
            raise ValueError("logprobs and token_ids differ in length")
        return sample


def read_samples(bucket: Bucket, key: str) -> tuple[dict[str, Any], list[Sample]] | None:
    """Read a rollouts or scores object: ``(header fields, samples)``, or ``None`` if unusable."""
    doc = get_json(bucket, key)
    if not isinstance(doc, dict):
        return None
    try:
        samples = [Sample.from_dict(s) for s in doc.get("samples", [])]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
        logger.warning("ignoring malformed %s: %s", key, exc)
        return None
    header = {k: v for k, v in doc.items() if k != "samples"}
    return header, samples


def write_samples(bucket: Bucket, key: str, samples: list[Sample], **header: Any) -> None:
    """Write a rollouts or scores object."""
    put_json(bucket, key, {**header, "written_at": time.time(), "samples": [dataclasses.asdict(s) for s in samples]})


def list_batches(bucket: Bucket, prefix: str) -> dict[int, list[str]]:
    """Keys under ``prefix`` grouped by batch number, ignoring anything unexpected."""
    out: dict[int, list[str]] = {}
    try:
        objects = bucket.list(prefix)
    except BucketError as exc:
        logger.warning("listing %s failed: %s", prefix, exc)
        return out
    for obj in objects:
        batch = batch_of(obj.key)
        if batch is not None:
            out.setdefault(batch, []).append(obj.key)
    return out


class MetricsLog:
    """Recent rows of a role's figures, mirrored to ``metrics/<role>.json`` for any panel.

    Args:
        bucket: Where to mirror (``None``: keep in memory only).
        role: Object name under ``metrics/``.
        keep: Rows kept.
    """

    def __init__(self, bucket: Bucket | None, role: str, keep: int = 1000) -> None:
        self.bucket = bucket
        self.key = metrics_key(role)
        self.keep = keep
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        previous = get_json(bucket, self.key) if bucket is not None else None
        if isinstance(previous, dict) and isinstance(previous.get("rows"), list):  # a restarted role keeps its history
            self.rows = [r for r in previous["rows"] if isinstance(r, dict)][-keep:]

    def add(self, **row: Any) -> None:
        self.rows.append({"time": time.time(), **row})
        del self.rows[: -self.keep]

    def flush(self) -> None:
        """Write the rows to the bucket (errors are logged, not raised)."""
        if self.bucket is None:
            return
        try:
            put_json(self.bucket, self.key, {"rows": self.rows, **self.extra})
        except BucketError as exc:
            logger.warning("could not write %s: %s", self.key, exc)
