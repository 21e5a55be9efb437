"""What the three Spaces exchange through the bucket besides weights.

Layout (next to ``latest.json``, ``anchors/`` and ``deltas/``)::

    tasks/<batch>.json               env -> replicas: prompts (answers stay in the env)
    rollouts/<batch>/<replica>.json  replica -> env: G completions per task, token ids,
                                     sampling log-probs, the policy version that made them
    scores/<batch>/<replica>.json    env -> trainer: the same samples with rewards
    status/<replica>.json            each replica: version, lag, apply time, throughput
    metrics/<role>.json              trainer and env: recent figures for the panels

Every object is small JSON written whole, and untrusted: replicas anywhere write
``rollouts/`` and ``status/``. The samples of ``rollouts/`` and ``scores/`` are the library's
format (:mod:`rlsync.scores`, re-exported here); each other object type has one parser here that checks
it strictly (bounded size and nesting, exact types, finite numbers, token ids in
``[0, vocab)``, non-empty and length-capped sequences, versions no newer than
the newest published). Readers treat a refused object as absent, log it and
count it in a :class:`Refusals` (shown on the panels): a bad object never stops
a role and never reaches the weights.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from ..bucket import Bucket, open_bucket
from ..bucket.watch import watch
from ..errors import BucketError
from ..layout import (
    REPORT_PREFIXES,
    ROLE_READS,
    batch_of,
    is_id,
    metrics_key,
)
from ..scores import (  # noqa: F401 - the scores format lives in the library; re-exported for the Spaces
    DEFAULT_LIMITS,
    MAX_REWARD,
    Refusals,
    Sample,
    SampleLimits,
    string_field,
    get_json,
    parse_samples,
    put_json,
    read_samples,
    write_samples,
)

logger = logging.getLogger(__name__)

MAX_TASKS = 1024


def open_role_bucket(role: str, url: str, bucket: Bucket | None = None) -> Bucket:
    """A role's bucket, watched on the Hub (:func:`~rlsync.bucket.watch.watch`) under the prefixes the
    role reads only (:data:`rlsync.layout.ROLE_READS`); writing its own status and metrics does not make
    it poll sooner.

    Args:
        role: The role (``"trainer"``, ``"rollout"``, ``"env"``): its settings are read from the
            environment (:meth:`~rlsync.bucket.settings.BucketSettings.from_env`), its watched
            prefixes from :data:`rlsync.layout.ROLE_READS`.
        url: The bucket to open when ``bucket`` is ``None``.
        bucket: An opened bucket (tests pass one), watched with the role's settings.

    Raises:
        ValueError: a bucket setting in the environment is invalid.
        KeyError: not a role of :data:`rlsync.layout.ROLE_READS`.
    """
    from ..bucket.settings import BucketSettings

    reads = ROLE_READS[role]
    settings = BucketSettings.from_env(role)
    opened = bucket if bucket is not None else open_bucket(url, settings=settings)
    return watch(opened, dataclasses.replace(settings.watch, prefixes=reads, quiet_prefixes=REPORT_PREFIXES))


def parse_tasks(doc: Any, *, max_chars: int = DEFAULT_LIMITS.max_chars) -> list[dict[str, str]]:
    """The ``{"task_id", "prompt"}`` entries of a task batch document.

    Raises:
        ValueError: not an object with a list of at most ``MAX_TASKS`` tasks, each with
            a string ``task_id`` (at most 256 characters) and a string ``prompt``.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list) or len(doc["tasks"]) > MAX_TASKS:
        raise ValueError(f"not an object with a list of at most {MAX_TASKS} tasks")
    tasks = []
    for t in doc["tasks"]:
        if not isinstance(t, dict):
            raise ValueError("a task must be a JSON object")
        tasks.append({"task_id": string_field(t, "task_id", 256), "prompt": string_field(t, "prompt", max_chars)})
    return tasks


_STATUS_NUMBERS = (
    "applied_step", "newest_step", "lag", "apply_s", "idle_per_sync_s", "bytes_downloaded", "reads", "refused",
    "refused_objects", "tokens_per_s", "completions", "skipped_stale", "updated_at",
)  # fmt: skip
_STATUS_STRINGS = ("replica_id", "engine", "state_hash", "engine_state_hash")
_SYNC_FIELDS = ("step", "kind", "nbytes", "download_s", "idle_s", "time")


def _json_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and abs(value) < 1e18


_HUB_NUMBERS = ("share", "window_s", "api", "resolver", "api_limit", "resolver_limit", "throttled", "waited_s")
_HUB_TIERS = ("free", "pro", "team", "enterprise")
_MAX_HUB_KINDS = 64


def parse_hub(doc: Any) -> dict[str, Any] | None:
    """Check a role's Hub request counts (``RequestMeter.snapshot()`` in its status or metrics):
    known numbers only, a known tier, a pacing notice of at most 200 characters, whole-run totals
    by request kind (at most 64 kinds, names of at most 64 characters, non-negative integers);
    ``None`` if unusable."""
    if not isinstance(doc, dict) or doc.get("tier") not in _HUB_TIERS:
        return None
    out: dict[str, Any] = {k: doc[k] for k in _HUB_NUMBERS if _json_number(doc.get(k))}
    kinds = doc.get("by_kind")
    if isinstance(kinds, dict) and len(kinds) <= _MAX_HUB_KINDS:
        out["by_kind"] = {
            k: n for k, n in kinds.items() if isinstance(k, str) and len(k) <= 64 and type(n) is int and n >= 0
        }
    out["tier"] = doc["tier"]
    out["short"] = doc.get("short") is True
    out["pacing"] = doc["pacing"][:200] if isinstance(doc.get("pacing"), str) else ""
    return out


def parse_status(doc: Any) -> dict[str, Any]:
    """Check a replica status object; returns only its known fields, each of the right type
    (numbers finite, strings at most 128 characters, at most 200 recent syncs).

    Raises:
        ValueError: not an object, or no valid ``replica_id``.
    """
    if not isinstance(doc, dict) or not is_id(doc.get("replica_id")):
        raise ValueError("not a status object with a valid replica_id")
    out: dict[str, Any] = {k: doc[k] for k in _STATUS_NUMBERS if _json_number(doc.get(k))}
    out.update({k: doc[k] for k in _STATUS_STRINGS if isinstance(doc.get(k), str) and len(doc[k]) <= 128})
    hub = parse_hub(doc.get("hub"))
    if hub is not None:
        out["hub"] = hub
    syncs = doc.get("recent_syncs")
    out["recent_syncs"] = [
        {k: s[k] for k in _SYNC_FIELDS if _json_number(s.get(k)) or (k == "kind" and s.get(k) in ("anchor", "delta"))}
        for s in (syncs[-200:] if isinstance(syncs, list) else [])
        if isinstance(s, dict)
    ]
    return out


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
        every_s: Least seconds between two writes (a flush in between is skipped, the rows kept for
            the next); roles on the Hub pass their setting, as every write is a request. With it set,
            a flush also writes only when a row was added since the last write.
    """

    def __init__(self, bucket: Bucket | None, role: str, keep: int = 1000, every_s: float = 0.0) -> None:
        self.bucket = bucket
        self.every_s = every_s
        self._flushed_at = -math.inf
        self._dirty = True
        self.key = metrics_key(role)
        self.keep = keep
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        previous = get_json(bucket, self.key) if bucket is not None else None
        if isinstance(previous, dict) and isinstance(previous.get("rows"), list):  # a restarted role keeps its history
            self.rows = [r for r in previous["rows"] if isinstance(r, dict)][-keep:]

    def add(self, **row: Any) -> None:
        """Append a row; non-finite floats (a diverged loss) are stored as ``null``, since readers refuse ``NaN``/``Infinity``."""
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.rows.append({"time": time.time(), **clean})
        del self.rows[: -self.keep]
        self._dirty = True

    def flush(self, force: bool = False) -> None:
        """Write the rows to the bucket (errors are logged, not raised); skipped within ``every_s`` of
        the last write unless `force`."""
        if self.bucket is None:
            return
        if not force and self.every_s and (time.monotonic() - self._flushed_at < self.every_s or not self._dirty):
            return
        self._flushed_at, self._dirty = time.monotonic(), False
        try:
            put_json(self.bucket, self.key, {"rows": self.rows, **self.extra})
        except BucketError as exc:
            logger.warning("could not write %s: %s", self.key, exc)
