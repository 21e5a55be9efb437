"""The scored samples the trainer learns from, as they travel through a bucket, and their strict parser.

``scores/<batch>/<replica>.json`` (and ``rollouts/``, the same samples before rewards) hold a
header (with ``format_version``, :data:`SAMPLES_FORMAT_VERSION`) and a list of samples: prompt and completion token ids, the sampler's per-token
log-probabilities, the policy version that made them (the first and, for a completion generated across
an update, the last) and the reward. Every object is
untrusted: :func:`read_samples` checks it (bounded size and nesting, exact types, finite
numbers, token ids in ``[0, vocab)``, non-empty and length-capped sequences, versions no
newer than the newest published) and treats a refused object as absent, logging it and
counting it in a :class:`Refusals`. This is library code: a TRL run reads its scores with it
(:class:`rlsync.trl.BucketSync`), and the Spaces write and read the same objects.
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

from .bucket import Bucket, validate_key
from .errors import FormatError, ObjectNotFoundError, ObjectTooLargeError
from .jsonlimits import loads_bounded
from .limits import MAX_OBJECT_BYTES
from .sampling import MIN_SAMPLED_LOGPROB

__all__ = [
    "DEFAULT_LIMITS", "MAX_REWARD", "Refusals", "SAMPLES_FORMAT_VERSION", "Sample", "SampleLimits", "get_json",
    "parse_samples", "put_json",
    "read_samples", "string_field", "write_samples",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: Format of the rollouts and scores objects; a reader refuses another (one without the field is
#: version 1, the format before the field existed).
SAMPLES_FORMAT_VERSION = 1


def put_json(bucket: Bucket, key: str, doc: Any) -> None:
    """Write ``doc`` as a JSON object."""
    bucket.put(validate_key(key), json.dumps(doc, separators=(",", ":")).encode())


def get_json(bucket: Bucket, key: str, refusals: "Refusals | None" = None, max_bytes: int | None = None) -> Any | None:
    """Read a JSON object; ``None`` if missing, larger than ``max_bytes`` (default :data:`MAX_OBJECT_BYTES`) or
    malformed (logged, and counted in ``refusals``)."""
    limit = MAX_OBJECT_BYTES if max_bytes is None else max_bytes
    try:
        return loads_bounded(bucket.get_limited(key, limit), what=key, max_bytes=limit)
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
    :meth:`as_dict` into their metrics, and the panels show it.

    Args:
        log: Log each refusal as a warning (off: the owner logs a summary, e.g. once per panel snapshot).
    """

    def __init__(self, log: bool = True) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.last = ""
        self.log = log
        self._lock = threading.Lock()

    def add(self, key: str, reason: str, count: int = 1) -> None:
        """Count ``count`` refused objects (``key`` the first; one warning)."""
        kind = key.split("/", 1)[0]
        with self._lock:
            self.counts[kind] += count
            self.last = f"{key}: {reason}"[:300]
        if self.log:
            logger.warning("refused %s%s: %s", key, f" and {count - 1} more" if count > 1 else "", reason)

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
MAX_REWARD = 1e6


def string_field(doc: dict[str, Any], key: str, limit: int) -> str:
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
    """One completion of one task, as the trainer needs it.

    ``version`` is the policy version that sampled its first token, the oldest: staleness counts from it.
    A completion generated across an update (a server paused with ``keep``, :mod:`rlsync.vllm.versions`)
    also records the version of its last token in ``last_version`` (``None``: one version made it all);
    ``logprobs`` are the sampler's own, token by token, whichever version sampled each.
    """

    task_id: str
    prompt: str
    completion: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    reward: float | None = None
    last_version: int | None = None

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
        last_version = doc.get("last_version")
        if last_version is not None and (type(last_version) is not int or not version <= last_version <= newest):
            raise ValueError(f"last_version must be an integer in [{version}, {newest}] (its first version to the newest "
                             f"published), got {last_version!r}"[:200])  # fmt: skip
        reward = doc.get("reward")
        prompt_ids = _token_ids(doc, "prompt_ids", limits.max_prompt_tokens, limits.vocab_size)
        if limits.max_total_tokens is not None and len(prompt_ids) + len(token_ids) > limits.max_total_tokens:
            raise ValueError(f"prompt and completion hold more than {limits.max_total_tokens} tokens together")
        return cls(
            task_id=string_field(doc, "task_id", 256),
            prompt=string_field(doc, "prompt", limits.max_chars),
            completion=string_field(doc, "completion", limits.max_chars),
            prompt_ids=prompt_ids,
            token_ids=token_ids,
            logprobs=[_finite(x, "a logprob", MIN_SAMPLED_LOGPROB, 0.0) for x in logprobs],
            version=version,
            reward=None if reward is None else _finite(reward, "reward", -MAX_REWARD, MAX_REWARD),
            last_version=last_version,
        )


def parse_samples(doc: Any, limits: SampleLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], list[Sample]]:
    """Check a rollouts or scores document: ``(header fields, samples)``.

    Raises:
        ValueError: not an object, another ``format_version``, too many samples, or any sample invalid
            (see :meth:`Sample.from_dict`).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        raise ValueError("not an object with a samples list")
    if doc.get("format_version", 1) != SAMPLES_FORMAT_VERSION:
        raise ValueError(f"format_version {str(doc.get('format_version'))[:20]!r}, not {SAMPLES_FORMAT_VERSION}")
    if len(doc["samples"]) > limits.max_samples:
        raise ValueError(f"{len(doc['samples'])} samples, more than {limits.max_samples}")
    samples = [Sample.from_dict(s, limits) for s in doc["samples"]]
    header = {k: v for k, v in doc.items()
              if k not in ("samples", "format_version") and isinstance(v, (str, int, float)) and not isinstance(v, bool)}  # fmt: skip
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


def write_samples(bucket: Bucket, key: str, samples: list[Sample], **header: Any) -> None:
    """Write a rollouts or scores object."""
    doc = {**header, "format_version": SAMPLES_FORMAT_VERSION, "written_at": time.time()}
    put_json(bucket, key, {**doc, "samples": [dataclasses.asdict(s) for s in samples]})
