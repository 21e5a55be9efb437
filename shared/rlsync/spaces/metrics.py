"""The metrics and status objects the roles write for the panels, one :class:`~.records.Record` type each.

- ``metrics/trainer.json``, :class:`TrainerMetrics`: the trainer's rows, one per publish (:class:`PublishRow`)
  and per optimizer step (:class:`TrainRow`), and its state now (versions, flow, refusals, Hub requests);
- ``metrics/env.json``, :class:`EnvMetrics`: the env's rows, one per policy version scored in a step
  (:class:`RewardRow`), recent episodes, rates, scoring failures;
- ``status/<replica>.json``, :class:`ReplicaStatus`: a replica's versions, recent syncs, throughput, hashes.

The role builds the dataclass and writes :meth:`~.records.Record.to_json`; the panels read the object
back through the same type (:func:`read_metrics`, :func:`read_status`), so a figure is declared once,
here. Each object carries ``format_version``: a reader refuses another version, a document that is not
an object, a required field missing or invalid, or one too large or malformed
(:func:`~rlsync.scores.get_json`); a bad optional figure falls back to its default. The scored samples
are the library's format (:mod:`rlsync.scores`).

A new plot of a figure TRL logs is one :class:`TrainRow` field naming its log entry and its plot's title
(``_log("grad_norm", chart="Gradient norm per optimizer step")``): the trainer copies it
(:meth:`TrainRow.from_logs`), and the trainer panel draws every field with a chart
(:func:`~.frames.training_charts`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Literal, TypeVar

from ..bucket import Bucket
from ..bucket.budget import Tier
from ..errors import BucketError
from ..layout import is_id, metrics_key
from ..limits import MAX_STATUS_BYTES
from ..roles import Role
from ..scores import Refusals, get_json, put_json
from .demand import Pacing
from .records import Record, limits

#: Rows a role's metrics object keeps.
MAX_ROWS = 1000
#: Recent syncs a replica's status object carries (a reader keeps at most :data:`MAX_SYNCS_READ`).
STATUS_SYNCS = 50
MAX_SYNCS_READ = 200
#: Recent episodes the env's metrics object carries.
EPISODES = 20
#: Most experts in a MoE delta's per-expert figures.
MAX_EXPERTS = 100_000
_COUNT = limits(minimum=0)
_HASH = limits(max_chars=128)

logger = logging.getLogger(__name__)

PublishKind = Literal["anchor", "delta"]


# -- shared parts --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HubCounts(Record):
    """A role's Hub request counts (:meth:`~rlsync.bucket.budget.RequestMeter.snapshot`): this window's
    requests per class and their limits, whole-run totals by request kind, 429s, waiting, pacing notice."""

    tier: Tier
    share: float = 1.0
    window_s: float = 300.0
    api: int = dataclasses.field(default=0, metadata=_COUNT)
    resolver: int = dataclasses.field(default=0, metadata=_COUNT)
    api_limit: int = dataclasses.field(default=0, metadata=_COUNT)
    resolver_limit: int = dataclasses.field(default=0, metadata=_COUNT)
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict, metadata=limits(max_key_chars=64, minimum=0))
    throttled: int = dataclasses.field(default=0, metadata=_COUNT)
    waited_s: float = 0.0
    short: bool = False
    pacing: str = dataclasses.field(default="", metadata=limits(max_chars=200))


@dataclasses.dataclass(frozen=True)
class RefusalCounts(Record):
    """Bucket objects a role refused (:class:`~rlsync.scores.Refusals`): per top-level prefix, and the last reason."""

    total: int = dataclasses.field(default=0, metadata=_COUNT)
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict, metadata=_COUNT)
    last: str = ""

    @classmethod
    def of(cls, refusals: Refusals) -> RefusalCounts:
        """The counts of ``refusals`` now."""
        counts = refusals.as_dict()
        return cls(total=counts["total"], by_kind=counts["by_kind"], last=counts["last"])

    @property
    def consistent(self) -> bool:
        """Whether some objects were refused and ``total`` is the sum of ``by_kind`` (a planted object may
        claim anything)."""
        return 0 < self.total == sum(self.by_kind.values())


# -- metrics/trainer.json --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishRow(Record):
    """One published version: its size, changes, stage times and what a joining replica downloads."""

    kind: PublishKind
    version: int
    nbytes: int = dataclasses.field(default=0, metadata=_COUNT)
    changed: int | None = None
    total: int | None = None
    changed_pct: float | None = None
    #: the same changes in TRL's plain layout (:func:`~rlsync.trl.metrics.trl_layout_bytes`)
    trl_nbytes: int | None = None
    encode_s: float | None = None
    hash_s: float | None = None
    upload_s: float | None = None
    catchup_bytes: int = dataclasses.field(default=0, metadata=_COUNT)
    #: a MoE delta's changed percentage per expert (``"<layer>.<expert>"``)
    experts_changed_pct: dict[str, float] = dataclasses.field(
        default_factory=dict, metadata=limits(max_items=MAX_EXPERTS)
    )
    time: float | None = None


def _log(name: str, chart: str | None = None, format: str | None = None) -> Any:
    """An optional figure copied from TRL's log entry ``name`` (:meth:`TrainRow.from_logs`), drawn per optimizer
    step on the trainer panel under the title ``chart`` (``None``: not drawn), its values shown with ``format``."""
    return dataclasses.field(default=None, metadata={"log": name, "chart": chart, "format": format})


@dataclasses.dataclass(frozen=True)
class TrainRow(Record):
    """One optimizer step: the figures TRL logged for it (each field's ``log`` names its TRL log entry)."""

    kind: Literal["train"]
    opt_step: int | None = None
    version: int | None = None  #: the newest published version when the step ran
    loss: float | None = _log("loss", chart="Loss per optimizer step", format=".4f")
    mean_reward: float | None = _log("reward")
    samples: float | None = _log("batch/samples_per_step")
    groups: float | None = _log("batch/groups_per_step")
    clipped: float | None = _log("clip_ratio/region_mean")
    ratio: float | None = _log("ratio")
    kl: float | None = _log("kl", chart="KL to the sampler per optimizer step", format=".4g")
    entropy: float | None = _log("entropy")
    staleness: float | None = _log("sample/staleness_mean")
    step_s: float | None = _log("perf/step_s")
    wait_s: float | None = _log("perf/rollout_wait_s")
    dropped_stale: int | None = None
    time: float | None = None

    @classmethod
    def from_logs(cls, logs: Mapping[str, Any], **figures: Any) -> TrainRow:
        """The row of one of TRL's log entries: every field with a ``log`` name, plus ``figures``
        (``opt_step``, ``version``, ...); a logged value that is not a number is left out."""
        logged = {f.name: logs.get(f.metadata["log"]) for f in dataclasses.fields(cls) if "log" in f.metadata}
        numbers = {k: v for k, v in logged.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return cls(kind="train", **numbers, **figures)


@dataclasses.dataclass(frozen=True)
class FlowFigures(Record):
    """The trainer's flow (``flow``): cumulative counts of the rollout worker, the staleness histogram
    of samples TRL took (versions behind -> samples), waiting time (:meth:`trainer_space.flow.FlowControl.figures`)."""

    pacing: Pacing | None = None
    read: int | None = None
    queued: int | None = None
    trained: int | None = None
    steps: int | None = None
    invalid: int | None = None
    dropped_stale: int | None = None
    unreadable: int | None = None
    dropped_degenerate: int | None = None
    degenerate_groups: int | None = None
    expired_unread: int | None = None
    staleness: dict[str, int] = dataclasses.field(default_factory=dict, metadata=_COUNT)
    newest_batch: int | None = None
    latency_s: float | None = None
    wait_s_total: float | None = None
    wait_s_last: float | None = None
    wait_share: float | None = None
    wait_s_first_step: float | None = None
    wait_share_after_first_step: float | None = None
    wall_s: float | None = None
    step_compute_s: float | None = None


@dataclasses.dataclass(frozen=True)
class BackgroundPublishFigures(Record):
    """The background publisher (``publish``): the last send's stall, versions coalesced, failed publishes."""

    stall_s: float | None = None
    coalesced: int = 0
    errors: int = 0


@dataclasses.dataclass(frozen=True)
class TrainerMetrics(Record):
    """``metrics/trainer.json``: the trainer's rows and its state now."""

    FORMAT_VERSION = 1
    ROLE: ClassVar[Role] = Role.TRAINER

    rows: list[PublishRow | TrainRow] = dataclasses.field(default_factory=list, metadata=limits(max_items=MAX_ROWS))
    version: int | None = None  #: the newest published version
    opt_steps: int | None = None
    queued_samples: int | None = None
    checkpoint_step: int | None = None
    notice: str = ""  #: what the last resume found worth telling
    refused: RefusalCounts | None = None
    non_finite_refused: int = 0
    checkpoints_skipped: int = 0
    bucket_refused: dict[str, int] = dataclasses.field(default_factory=dict, metadata=_COUNT)
    non_finite_steps_skipped: int = 0
    version_corrections: int = 0
    flow: FlowFigures | None = None
    publish: BackgroundPublishFigures | None = None
    hub: HubCounts | None = None
    coalescing: str = ""  #: the notice while publishes are coalesced (a short request budget)

    @property
    def publishes(self) -> list[PublishRow]:
        """The rows of published versions."""
        return [r for r in self.rows if isinstance(r, PublishRow)]

    @property
    def steps(self) -> list[TrainRow]:
        """The rows of optimizer steps."""
        return [r for r in self.rows if isinstance(r, TrainRow)]


# -- metrics/env.json ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardRow(Record):
    """Samples of one policy version scored in one env step, and their mean reward."""

    version: int
    mean_reward: float
    count: int = dataclasses.field(default=1, metadata=limits(minimum=1))
    time: float | None = None


@dataclasses.dataclass(frozen=True)
class Episode(Record):
    """A recent scored sample, cut for the panel (the prompt's tail, the completion's head)."""

    version: int | None = None
    type: str = ""
    prompt: str = ""
    completion: str = ""
    reward: float | None = None


@dataclasses.dataclass(frozen=True)
class TypeReward(Record):
    """Mean reward and count of one ``"<source> / <task type>"``."""

    count: int = dataclasses.field(metadata=_COUNT)
    mean_reward: float | None = None


@dataclasses.dataclass(frozen=True)
class EnvMetrics(Record):
    """``metrics/env.json``: the env's rows and its state now."""

    FORMAT_VERSION = 1
    ROLE: ClassVar[Role] = Role.ENV

    rows: list[RewardRow] = dataclasses.field(default_factory=list, metadata=limits(max_items=MAX_ROWS))
    env: str = dataclasses.field(default="", metadata=limits(max_chars=200))
    episodes: list[Episode] = dataclasses.field(default_factory=list, metadata=limits(max_items=EPISODES))
    tasks_per_s: float | None = None
    scores_per_s: float | None = None
    scored: int | None = None
    cancelled_stale: int = 0
    pacing: Pacing | None = None
    refused: RefusalCounts | None = None
    failures: dict[str, int] = dataclasses.field(default_factory=dict, metadata=limits(max_items=256, minimum=0))
    by_type: dict[str, TypeReward] = dataclasses.field(default_factory=dict, metadata=limits(max_items=256))
    hub: HubCounts | None = None


# -- status/<replica>.json -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sync(Record):
    """One version a replica applied, and the seconds its inference paused for it (``idle_s``)."""

    step: int
    kind: PublishKind
    nbytes: int | None = None
    download_s: float | None = None
    idle_s: float | None = None
    time: float | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaStatus(Record):
    """``status/<replica>.json``: what a replica holds and how it runs (the ``adapter_*`` fields: a LoRA run)."""

    FORMAT_VERSION = 1

    replica_id: str = dataclasses.field(metadata=limits(check=is_id))
    host: str = dataclasses.field(default="", metadata=_HASH)  #: the writer (its Space id, else its host name)
    engine: str = dataclasses.field(default="", metadata=_HASH)
    applied_step: int | None = None
    newest_step: int | None = None
    lag: int | None = None
    apply_s: float | None = None
    idle_per_sync_s: float | None = None
    bytes_downloaded: int = 0
    reads: int = 0
    refused: int = 0
    refused_objects: int = 0
    thread_crashes: int = 0
    tokens_per_s: float = 0.0
    completions: int = 0
    skipped_stale: int = 0
    claims_lost: int = 0
    state_hash: str | None = dataclasses.field(default=None, metadata=_HASH)
    engine_state_hash: str | None = dataclasses.field(default=None, metadata=_HASH)  #: the weights' own, re-hashed
    engine_verified_step: int | None = None
    rehashes: int = 0
    rehash_mismatches: int = 0
    last_rehash_s: float | None = None
    recent_syncs: list[Sync] = dataclasses.field(default_factory=list, metadata=limits(max_items=MAX_SYNCS_READ))
    hub: HubCounts | None = None
    adapter_step: int | None = None
    adapter_hash: str | None = dataclasses.field(default=None, metadata=_HASH)
    engine_adapter_hash: str | None = dataclasses.field(default=None, metadata=_HASH)
    adapters_served: list[int] = dataclasses.field(default_factory=list)
    adapter_refused: int = 0
    adapter_bytes_downloaded: int = 0
    updated_at: float | None = None

    @property
    def syncs(self) -> list[Sync]:
        """The recent syncs with a pause and a time (the ones the panels plot)."""
        return [s for s in self.recent_syncs if s.idle_s is not None and s.time is not None]


# -- reading and writing ---------------------------------------------------------------------------------


M = TypeVar("M", TrainerMetrics, EnvMetrics)


def read_metrics(bucket: Bucket, kind: type[M], refusals: Refusals | None = None) -> M | None:
    """A role's metrics object, or ``None`` when missing or refused (logged, and counted in ``refusals``:
    a bad object never stops a reader).

    Args:
        bucket: Where to read.
        kind: :class:`TrainerMetrics` or :class:`EnvMetrics`.
        refusals: Where a refused object is counted.
    """
    return _read(bucket, metrics_key(kind.ROLE), kind, refusals)


def read_status(
    bucket: Bucket, key: str, refusals: Refusals | None = None, max_bytes: int = MAX_STATUS_BYTES
) -> ReplicaStatus | None:
    """The replica status object at ``key``, or ``None`` when missing, larger than ``max_bytes`` or refused
    (logged, and counted in ``refusals``)."""
    return _read(bucket, key, ReplicaStatus, refusals, max_bytes)


def _read(bucket: Bucket, key: str, kind: type[Any], refusals: Refusals | None, max_bytes: int | None = None) -> Any:
    doc = get_json(bucket, key, refusals, max_bytes)
    try:
        return None if doc is None else kind.from_json(doc)
    except ValueError as exc:  # Record.from_json refuses any other JSON value with this one error
        if refusals is not None:
            refusals.add(key, str(exc))
        else:
            logger.warning("ignoring %s: %s", key, exc)
        return None


class MetricsLog(Generic[M]):
    """A role's metrics object: recent rows and its state now, mirrored to ``metrics/<role>.json`` for any panel.

    The role adds rows (:meth:`add`) and sets :attr:`state` (its figures now, ``rows`` left empty);
    :meth:`flush` writes the state with the rows.

    Args:
        bucket: Where to mirror (``None``: keep in memory only).
        kind: :class:`TrainerMetrics` or :class:`EnvMetrics` (the object under ``metrics/``).
        keep: Rows kept.
        every_s: Least seconds between two writes (a flush in between is skipped, the rows kept for
            the next); roles on the Hub pass their setting, as every write is a request. With it set,
            a flush also writes only when a row was added since the last write.
    """

    def __init__(self, bucket: Bucket | None, kind: type[M], keep: int = MAX_ROWS, every_s: float = 0.0) -> None:
        self.bucket = bucket
        self.every_s = every_s
        self._flushed_at = -math.inf
        self._dirty = True
        self.key = metrics_key(kind.ROLE)
        self.keep = keep
        self.state: M = kind()
        previous = read_metrics(bucket, kind) if bucket is not None else None
        # a restarted role keeps its history
        self.rows: list[Any] = list(previous.rows[-keep:]) if previous is not None else []

    def add(self, row: PublishRow | TrainRow | RewardRow) -> None:
        """Append a row, stamped with the time now unless it has one."""
        self.rows.append(row if row.time is not None else dataclasses.replace(row, time=time.time()))
        del self.rows[: -self.keep]
        self._dirty = True

    def flush(self, force: bool = False) -> None:
        """Write :attr:`state` with the rows to the bucket (errors are logged, not raised); skipped within
        ``every_s`` of the last write unless `force`."""
        if self.bucket is None:
            return
        if not force and self.every_s and (time.monotonic() - self._flushed_at < self.every_s or not self._dirty):
            return
        self._flushed_at, self._dirty = time.monotonic(), False
        try:
            put_json(self.bucket, self.key, dataclasses.replace(self.state, rows=list(self.rows)).to_json())
        except BucketError as exc:
            logger.warning("could not write %s: %s", self.key, exc)
