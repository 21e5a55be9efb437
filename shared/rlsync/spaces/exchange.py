"""What the three Spaces exchange through the bucket besides weights.

Layout (next to ``latest.json``, ``anchors/`` and ``deltas/``)::

    tasks/<batch>.json               env -> replicas: prompts (answers stay in the env)
    rollouts/<batch>/<replica>.json  replica -> env: G completions per task, token ids,
                                     sampling log-probs, the policy version that made them
    scores/<batch>/<replica>.json    env -> trainer: the same samples with rewards
    status/<replica>.json            each replica: version, lag, apply time, throughput
    metrics/<role>.json              trainer and env: recent figures for the panels

Every object is small JSON written whole, and untrusted: replicas anywhere write
``rollouts/`` and ``status/``. Each object type has one parser here that checks
it strictly (bounded size and nesting, exact types, finite numbers, token ids in
``[0, vocab)``, non-empty and length-capped sequences, versions no newer than
the newest published). Readers treat a refused object as absent, log it and
count it in a :class:`Refusals` (shown on the panels): a bad object never stops
a role and never reaches the weights.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import threading
import time
from typing import Any

from ..bucket import Bucket, open_bucket, validate_key
from ..bucket.watch import watch
from ..errors import BucketError, FormatError, ObjectNotFoundError, ObjectTooLargeError
from ..jsonlimits import loads_bounded
from ..layout import (
    REPORT_PREFIXES,
    batch_of,
    is_id,
    metrics_key,
)
from ..limits import MAX_OBJECT_BYTES
from ..sampling import MIN_SAMPLED_LOGPROB

logger = logging.getLogger(__name__)

def open_role_bucket(role: str, url: str, bucket: Bucket | None = None) -> Bucket:
    """A role's bucket, watched on the Hub (:func:`~rlsync.bucket.watch.watch`); writing its own
    status and metrics does not make it poll sooner.

    Args:
        role: The role (``"trainer"``, ``"rollout"``, ``"env"``): its settings are read from the
            environment (:meth:`~rlsync.bucket.settings.BucketSettings.from_env`).
        url: The bucket to open when ``bucket`` is ``None``.
        bucket: An opened bucket (tests pass one), watched with the role's settings.

    Raises:
        ValueError: a bucket setting in the environment is invalid.
    """
    from ..bucket.settings import BucketSettings

    settings = BucketSettings.from_env(role)
    opened = bucket if bucket is not None else open_bucket(url, settings=settings)
    return watch(opened, dataclasses.replace(settings.watch, quiet_prefixes=REPORT_PREFIXES))


def put_json(bucket: Bucket, key: str, doc: Any) -> None:
    """Write ``doc`` as a JSON object."""
    bucket.put(validate_key(key), json.dumps(doc, separators=(",", ":")).encode())


def get_json(bucket: Bucket, key: str, refusals: "Refusals | None" = None) -> Any | None:
    """Read a JSON object; ``None`` if missing, too large or malformed (logged, and counted in ``refusals``)."""
    try:
        return loads_bounded(bucket.get_limited(key, MAX_OBJECT_BYTES), what=key, max_bytes=MAX_OBJECT_BYTES)
    except ObjectNotFoundError:
        return None
    except (ObjectTooLargeError, FormatError) as exc:
        if refusals is not None:
            refusals.add(key, str(exc))
        else:
            logger.warning("ignoring %s: %s", key, exc)
        return None


class Refusals:
    """Counts refused exchange objects per top-level prefix (thread-safe); roles put
    :meth:`as_dict` into their metrics, and the panels show it."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.last = ""
        self._lock = threading.Lock()

    def add(self, key: str, reason: str) -> None:
        """Count one refused object (logged as a warning)."""
        kind = key.split("/", 1)[0]
        with self._lock:
            self.counts[kind] += 1
            self.last = f"{key}: {reason}"[:300]
        logger.warning("refused %s: %s", key, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"total", "by_kind", "last"}`` for a metrics object."""
        with self._lock:
            return {"total": sum(self.counts.values()), "by_kind": dict(self.counts), "last": self.last}


@dataclasses.dataclass(frozen=True)
class SampleLimits:
    """What a rollouts or scores sample may hold.

    Args:
        vocab_size: Token ids must be below it (``None``: only non-negative is checked;
            the trainer, which knows its vocabulary, checks again).
        max_version: The newest published version (``None``: unchecked).
        max_prompt_tokens: Longest prompt, in tokens.
        max_completion_tokens: Longest completion, in tokens.
        max_total_tokens: Longest prompt plus completion (the trainer passes its model's
            context length; ``None``: unchecked).
        max_samples: Most samples in one object.
        max_chars: Longest ``task_id``, ``prompt`` or ``completion`` string.
    """

    vocab_size: int | None = None
    max_version: int | None = None
    max_prompt_tokens: int = 4096
    max_completion_tokens: int = 4096
    max_total_tokens: int | None = None
    max_samples: int = 4096
    max_chars: int = 1 << 16


DEFAULT_LIMITS = SampleLimits()
MAX_TASKS = 1024
MAX_REWARD = 1e6


def _str_field(doc: dict[str, Any], key: str, limit: int) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{key} must be a string of at most {limit} characters")
    return value


def _token_ids(doc: dict[str, Any], key: str, limit: int, vocab_size: int | None) -> list[int]:
    ids = doc.get(key)
    if not isinstance(ids, list) or not 0 < len(ids) <= limit:
        raise ValueError(f"{key} must be a non-empty list of at most {limit} token ids")
    bound = vocab_size if vocab_size is not None else 1 << 31
    if not all(type(t) is int and 0 <= t < bound for t in ids):
        raise ValueError(f"{key} holds something other than integer token ids in [0, {bound})")
    return ids


def _finite(value: Any, what: str, low: float, high: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{what} must be a finite number in [{low:g}, {high:g}], got {value!r}"[:200])
    return float(value)


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
    def from_dict(cls, doc: dict[str, Any], limits: SampleLimits = DEFAULT_LIMITS) -> "Sample":
        """Parse and check one sample.

        Raises:
            ValueError: a field is missing, of the wrong type, out of range, empty,
                too long, or not finite.
        """
        if not isinstance(doc, dict):
            raise ValueError("a sample must be a JSON object")
        token_ids = _token_ids(doc, "token_ids", limits.max_completion_tokens, limits.vocab_size)
        logprobs = doc.get("logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
            raise ValueError("logprobs and token_ids differ in length")
        version = doc.get("version")
        newest = limits.max_version if limits.max_version is not None else (1 << 62)
        if type(version) is not int or not 0 <= version <= newest:
            raise ValueError(f"version must be an integer in [0, {newest}] (the newest published), got {version!r}"[:200])
        reward = doc.get("reward")
        prompt_ids = _token_ids(doc, "prompt_ids", limits.max_prompt_tokens, limits.vocab_size)
        if limits.max_total_tokens is not None and len(prompt_ids) + len(token_ids) > limits.max_total_tokens:
            raise ValueError(f"prompt and completion hold more than {limits.max_total_tokens} tokens together")
        return cls(
            task_id=_str_field(doc, "task_id", 256),
            prompt=_str_field(doc, "prompt", limits.max_chars),
            completion=_str_field(doc, "completion", limits.max_chars),
            prompt_ids=prompt_ids,
            token_ids=token_ids,
            logprobs=[_finite(x, "a logprob", MIN_SAMPLED_LOGPROB, 0.0) for x in logprobs],
            version=version,
            reward=None if reward is None else _finite(reward, "reward", -MAX_REWARD, MAX_REWARD),
        )


def parse_samples(doc: Any, limits: SampleLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], list[Sample]]:
    """Check a rollouts or scores document: ``(header fields, samples)``.

    Raises:
        ValueError: not an object, too many samples, or any sample invalid (see :meth:`Sample.from_dict`).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        raise ValueError("not an object with a samples list")
    if len(doc["samples"]) > limits.max_samples:
        raise ValueError(f"{len(doc['samples'])} samples, more than {limits.max_samples}")
    samples = [Sample.from_dict(s, limits) for s in doc["samples"]]
    header = {k: v for k, v in doc.items() if k != "samples" and isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    return header, samples


def read_samples(
    bucket: Bucket, key: str, *, limits: SampleLimits = DEFAULT_LIMITS, refusals: Refusals | None = None
) -> tuple[dict[str, Any], list[Sample]] | None:
    """Read a rollouts or scores object: ``(header fields, samples)``, or ``None`` if missing or
    refused (see :func:`parse_samples`; refusals are logged and counted in ``refusals``)."""
    doc = get_json(bucket, key, refusals)
    if doc is None:
        return None
    try:
        return parse_samples(doc, limits)
    except ValueError as exc:
        if refusals is not None:
            refusals.add(key, str(exc))
        else:
            logger.warning("ignoring malformed %s: %s", key, exc)
        return None


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
        tasks.append({"task_id": _str_field(t, "task_id", 256), "prompt": _str_field(t, "prompt", max_chars)})
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
