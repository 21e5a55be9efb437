"""Demand-driven work: the trainer says how many samples it can use; the env and replicas follow.

Without it the env keeps ``queue_depth`` task batches waiting whatever the trainer
consumes, and on the CPU demo about 80% of the generated samples never reach the
loss. With it, the trainer writes one small object per optimizer step::

    control/demand.json   trainer -> env, replicas: {"version", "max_staleness",
                          "read_batch", "want_samples", "step_s", "latency_s", "buffered_steps", "written_at"}

- ``read_batch``: the newest task batch whose scores the trainer has read; batches
  after it are in flight (issued, being generated, scored but unread).
- ``want_samples``: samples the trainer wants in flight beyond what it already holds,
  sized by :func:`target_in_flight` from its measured step time and the measured
  latency from issuing a batch to reading its scores.
- The env issues a batch only while the batches in flight hold fewer samples than
  ``want_samples`` and are fewer than the batches it keeps (:func:`batches_to_issue`), and
  cancels rollouts that are already stale for ``version`` instead of scoring them; a
  ``version`` newer than the newest published one is refused (:func:`read_demand`).
- A replica takes work for the newest version it holds and does not start a batch
  that would be stale by the time it is trained (:func:`would_be_stale`).

No demand object (a trainer with ``pacing="queue"``, or none yet): the env keeps
``queue_depth`` batches waiting, as before. The object is untrusted like every other:
:func:`parse_demand` checks every field and bounds it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Any

from ..bucket import Bucket
from ..errors import BucketError, FormatError
from ..layout import DEMAND_KEY
from .exchange import Refusals, get_json, put_json

_MAX_SAMPLES = 1 << 20
_MAX_SECONDS = 86400.0


class Pacing(str, enum.Enum):
    """How task batches are issued."""

    QUEUE = "queue"  #: the env keeps ``queue_depth`` batches waiting (no demand object)
    DEMAND = "demand"  #: the trainer writes ``control/demand.json``; the env issues at its rate


@dataclasses.dataclass(frozen=True)
class Demand:
    """What the trainer can use (see the module docstring for the fields)."""

    version: int
    max_staleness: int
    read_batch: int
    want_samples: int
    step_s: float = 0.0
    latency_s: float = 0.0
    buffered_steps: float = 0.0
    written_at: float = 0.0

    @property
    def min_version(self) -> int:
        """The oldest policy version whose samples the trainer still takes."""
        return self.version - self.max_staleness


def target_in_flight(batch_size: int, max_staleness: int, step_s: float | None, latency_s: float | None) -> int:
    """Samples to keep in flight: the next batch is ready when a step ends, and none goes stale.

    A batch issued now is read ``latency_s`` later, ``latency_s / step_s`` steps on; one more
    step's worth covers the step in progress. More than ``max_staleness`` steps' worth would be
    stale before the trainer reaches it.

    Args:
        batch_size: Samples per optimizer step.
        max_staleness: Versions a sample may lag when trained.
        step_s: Measured seconds per step (``None``: not measured yet).
        latency_s: Measured seconds from issuing a task batch to reading its scores (``None``: not yet).

    Returns:
        The number of samples, between one step's worth and ``max(1, max_staleness)`` steps' worth.
    """
    most = max(1, max_staleness)
    if not step_s or latency_s is None:
        return most * batch_size
    steps = math.ceil(latency_s / max(step_s, 1e-3)) + 1
    return min(max(steps, 1), most) * batch_size


def batches_wanted(demand: Demand, samples_per_batch: float) -> int:
    """The task batches in flight that ``want_samples`` asks for, at ``samples_per_batch`` each."""
    return math.ceil(demand.want_samples / max(samples_per_batch, 1.0))


def batches_to_issue(
    demand: Demand, issued: list[int], scored: set[int], closed: set[int], samples_per_batch: float, max_in_flight: int
) -> int:
    """How many new task batches the env should issue now.

    A batch is in flight until its scores are written and the trainer has read past it. Unscored
    batches count whatever ``read_batch`` says, so a wrong ``read_batch`` cannot make the env issue
    more than ``want_samples`` worth of unscored work, and never more than ``max_in_flight`` batches
    are in flight, whatever ``want_samples`` says.

    Args:
        demand: The trainer's demand.
        issued: Task batches in the bucket.
        scored: Batches with scores written.
        closed: Batches that will yield nothing more (their rollouts were cancelled or refused).
        samples_per_batch: Measured scored samples per batch (all replicas together).
        max_in_flight: The most batches in flight (the env's ``keep_batches``: more would be pruned unread).
    """
    in_flight = [b for b in issued if b not in closed and (b not in scored or b > demand.read_batch)]
    need = min(batches_wanted(demand, samples_per_batch), max_in_flight)
    return max(0, need - len(in_flight))


def would_be_stale(demand: Demand, version: int, generate_s: float) -> bool:
    """Whether samples a replica starts now at ``version`` would be too stale once trained.

    The trainer moves on about ``generate_s / step_s`` versions while the replica generates, but only
    as far as the samples it already holds take it (``buffered_steps``): a starving trainer does not
    move on, so nothing it is waiting for can go stale.
    """
    ahead = min(generate_s / demand.step_s, demand.buffered_steps) if demand.step_s > 0 else 0.0
    return demand.version + ahead - version > demand.max_staleness


def _int(doc: dict[str, Any], key: str, low: int, high: int) -> int:
    value = doc.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r}"[:200])
    return value


def _seconds(doc: dict[str, Any], key: str) -> float:
    value = doc.get(key, 0.0)
    if type(value) not in (int, float) or not math.isfinite(value) or not 0.0 <= value <= _MAX_SECONDS * 1e6:
        raise ValueError(f"{key} must be a finite non-negative number, got {value!r}"[:200])
    return float(value)


def parse_demand(doc: Any) -> Demand:
    """Check a demand document.

    Raises:
        ValueError: not an object, or a field missing, of the wrong type or out of range.
    """
    if not isinstance(doc, dict):
        raise ValueError("a demand must be a JSON object")
    step_s, latency_s, buffered = _seconds(doc, "step_s"), _seconds(doc, "latency_s"), _seconds(doc, "buffered_steps")
    if step_s > _MAX_SECONDS or latency_s > _MAX_SECONDS or buffered > _MAX_SAMPLES:
        raise ValueError(f"step_s and latency_s must be at most {_MAX_SECONDS:g}, buffered_steps at most {_MAX_SAMPLES}")
    return Demand(
        version=_int(doc, "version", 0, 1 << 62), max_staleness=_int(doc, "max_staleness", 0, 1 << 20),
        read_batch=_int(doc, "read_batch", -1, 10**10 - 1), want_samples=_int(doc, "want_samples", 0, _MAX_SAMPLES),
        step_s=step_s, latency_s=latency_s, buffered_steps=buffered, written_at=_seconds(doc, "written_at"),
    )  # fmt: skip


def read_demand(bucket: Bucket, refusals: Refusals | None = None, *, newest_version: int | None = None) -> Demand | None:
    """The trainer's demand, or ``None`` if there is none or it is refused (logged, counted in ``refusals``).

    Args:
        bucket: The run's bucket.
        refusals: Where refused demands are counted.
        newest_version: The newest version published (read after the demand: the trainer writes its
            demand after the pointer it names). A demand for a newer version is refused: it would make
            the env cancel every honest rollout as stale.
    """
    try:
        doc = get_json(bucket, DEMAND_KEY, refusals)
    except BucketError:
        return None
    if doc is None:
        return None
    try:
        demand = parse_demand(doc)
        if newest_version is not None and demand.version > newest_version:
            raise ValueError(f"version {demand.version} is newer than the newest published version {newest_version}"[:200])
        return demand
    except ValueError as exc:
        if refusals is not None:
            refusals.add(DEMAND_KEY, str(exc))
        return None


def newest_version(bucket: Bucket) -> int:
    """The newest version published: the adapter chain's in a LoRA run, else the weights'; 0 before
    the first publish or while the pointer is unreadable."""
    from ..adapters import adapter_bucket
    from ..protocol import read_manifest

    try:
        manifest = read_manifest(adapter_bucket(bucket)) or read_manifest(bucket)
    except FormatError:
        manifest = None
    return manifest.step if manifest is not None else 0


def write_demand(bucket: Bucket, demand: Demand) -> None:
    """Write the demand object (one small object per optimizer step)."""
    put_json(bucket, DEMAND_KEY, {**dataclasses.asdict(demand), "written_at": time.time()})
