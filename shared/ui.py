"""Shared parts of the Gradio panels: bucket readers, tables, plots and role controls.

Everything a panel shows is read from the bucket (``latest.json``,
``metrics/*.json``, ``status/*.json``, ``control/publisher.json``), so a panel
works the same whether the three roles run in this process or in three Spaces
on different machines. The only in-process objects a panel touches are the
roles it hosts itself, through :class:`RoleRunner` (Start / Stop).

Two layers:

* plain functions turning a :class:`Snapshot` of the bucket into pandas
  DataFrames and values (testable without a browser);
* builders creating Gradio components inside the current ``gr.Blocks`` context,
  refreshed together by a :class:`Live` (one ``gr.Timer`` tick, :data:`REFRESH_S`,
  reads one snapshot and updates every output of a panel). Their ``prefix`` argument is
  prepended to the components' ``elem_id`` so that several panels can share a
  page (the combined app uses ``"trainer-"``, ``"overview-"``, ...).

The Hugging Face token is never shown: bucket URLs carry none, and any text
that reaches the page goes through :func:`redact`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, Self

import pandas as pd

from .bucket import Bucket, BucketError, ObjectNotFoundError, open_bucket
from .errors import FormatError
from .exchange import STATUS_PREFIX, get_json, metrics_key, parse_status
from .protocol import (
    CONTROL_KEY,
    Adaptive,
    AnchorPolicy,
    FixedInterval,
    Manifest,
    policy_from_json,
    policy_to_json,
    read_manifest,
)
from .protocol.policy import DEFAULT_INTERVAL, DEFAULT_MAX_CATCHUP_RATIO, MAX_CONTROL_BYTES

logger = logging.getLogger(__name__)

#: Seconds between panel refreshes.
REFRESH_S = 1.5
#: Seconds a bucket snapshot is reused by the refresh handlers of one process (local folder).
SNAPSHOT_TTL_S = 1.0
#: The same for a remote bucket (``hf://``), where one snapshot costs several HTTP requests.
REMOTE_SNAPSHOT_TTL_S = 3.0
#: Rows of the recent-publishes table.
RECENT_PUBLISHES = 12
#: Colours of the publish kinds in the plots.
KIND_COLORS = {"anchor": "#d62728", "delta": "#1f77b4"}
_REDACTED = "***"

BucketSource = str | Callable[[], str]
"""A bucket URL, or a function returning the current one (a panel's form may change it)."""


# -- reading the bucket ---------------------------------------------------------------------------


def redact(text: str) -> str:
    """Remove the Hugging Face token (``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``) from ``text``."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        secret = os.environ.get(var)
        if secret and len(secret) >= 4:
            text = text.replace(secret, _REDACTED)
    return text


@dataclasses.dataclass
class Snapshot:
    """What a panel shows, read from the bucket at ``read_at`` (missing objects are empty).

    Attributes:
        trainer_rows: Rows of ``metrics/trainer.json`` (kinds ``anchor``, ``delta``, ``train``).
        trainer_extra: The other fields of ``metrics/trainer.json`` (version, opt_steps, ...).
        env_rows: Rows of ``metrics/env.json`` (version, mean_reward, count).
        env_extra: The other fields of ``metrics/env.json`` (env, episodes, tasks_per_s, ...).
        statuses: The ``status/<replica>.json`` objects.
        manifest: The pointer object, or ``None`` (nothing published, or invalid).
        policy: The anchor policy of the control object, or ``None`` if there is none.
        read_at: ``time.time()`` of the read.
        error: A read problem to show (already redacted), or ``""``.
    """

    trainer_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    trainer_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    env_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    statuses: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    manifest: Manifest | None = None
    policy: AnchorPolicy | None = None
    read_at: float = 0.0
    error: str = ""


def _metrics(bucket: Bucket, role: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    doc = get_json(bucket, metrics_key(role))
    if not isinstance(doc, dict):
        return [], {}
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)] if isinstance(doc.get("rows"), list) else []
    return rows, {k: v for k, v in doc.items() if k != "rows"}


def read_snapshot(bucket: Bucket) -> Snapshot:
    """Read everything the panels show from ``bucket``.

    Bucket errors are logged and reported in :attr:`Snapshot.error`; what could
    be read is still returned.
    """
    snap = Snapshot(read_at=time.time())
    try:
        snap.trainer_rows, snap.trainer_extra = _metrics(bucket, "trainer")
        snap.env_rows, snap.env_extra = _metrics(bucket, "env")
        for obj in sorted(bucket.list(STATUS_PREFIX), key=lambda o: o.key):
            try:
                snap.statuses.append(parse_status(get_json(bucket, obj.key)))
            except ValueError as exc:
                logger.warning("ignoring %s: %s", obj.key, exc)
        try:
            snap.manifest = read_manifest(bucket)
        except FormatError as exc:
            logger.warning("invalid pointer object: %s", exc)
            snap.error = f"invalid latest.json: {exc}"
        try:
            snap.policy = policy_from_json(bucket.get_limited(CONTROL_KEY, MAX_CONTROL_BYTES))
        except ObjectNotFoundError:
            pass
        except FormatError as exc:
            logger.warning("invalid control object: %s", exc)
    except BucketError as exc:
        logger.warning("reading %s failed: %s", getattr(bucket, "url", "bucket"), exc)
        snap.error = redact(f"bucket read failed: {exc}")
    return snap


class BucketView:
    """A bucket's snapshots, shared by every refresh handler of a process.

    Snapshots are cached for ``ttl`` seconds so that several plots refreshing
    at once read the bucket once. The view also remembers, per replica, the
    apply time seen in its status at each applied version (the status object
    holds only the latest), to plot apply time per sync.

    Args:
        url: Bucket URL or path.
        ttl: Seconds a snapshot is reused.
    """

    def __init__(self, url: str, ttl: float = SNAPSHOT_TTL_S) -> None:
        self.url = url
        self.ttl = ttl
        self._bucket: Bucket | None = None
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        #: (replica, applied version) -> (apply seconds, idle per sync seconds)
        self.sync_history: dict[tuple[str, int], tuple[float | None, float | None]] = {}

    @property
    def bucket(self) -> Bucket:
        if self._bucket is None:
            self._bucket = open_bucket(self.url)
        return self._bucket

    def snapshot(self) -> Snapshot:
        """A snapshot no older than ``ttl`` seconds."""
        with self._lock:
            now = time.time()
            if self._snapshot is not None and now - self._snapshot.read_at < self.ttl:
                return self._snapshot
            try:
                snap = read_snapshot(self.bucket)
            except BucketError as exc:  # opening the bucket failed
                logger.warning("cannot open bucket %s: %s", self.url, exc)
                snap = Snapshot(read_at=now, error=redact(f"cannot open bucket: {exc}"))
            self._remember_syncs(snap)
            self._snapshot = snap
            return snap

    def _remember_syncs(self, snap: Snapshot) -> None:
        for st in snap.statuses:
            replica, step = st.get("replica_id"), st.get("applied_step")
            if isinstance(replica, str) and isinstance(step, int) and st.get("apply_s") is not None:
                self.sync_history[(replica, step)] = (_num(st.get("apply_s")), _num(st.get("idle_per_sync_s")))
        if len(self.sync_history) > 5000:
            for key in sorted(self.sync_history, key=lambda k: k[1])[: len(self.sync_history) - 5000]:
                del self.sync_history[key]


_VIEWS: dict[str, BucketView] = {}
_VIEWS_LOCK = threading.Lock()


def bucket_view(source: BucketSource) -> BucketView:
    """The process-wide :class:`BucketView` of a bucket URL (or of the URL ``source()`` returns)."""
    url = source() if callable(source) else source
    with _VIEWS_LOCK:
        view = _VIEWS.get(url)
        if view is None:
            remote = "://" in url and not url.startswith("file://")
            view = _VIEWS[url] = BucketView(url, ttl=REMOTE_SNAPSHOT_TTL_S if remote else SNAPSHOT_TTL_S)
        return view


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# -- frames ---------------------------------------------------------------------------------------

PUBLISH_COLUMNS = ["version", "kind", "KB", "changed_pct", "encode_s", "hash_s", "upload_s", "catchup_KB"]


def publish_frame(snap: Snapshot) -> pd.DataFrame:
    """One row per publish: version, kind, KB, changed_pct, encode_s, hash_s, upload_s, catchup_KB."""
    rows = []
    for r in snap.trainer_rows:
        if r.get("kind") in ("anchor", "delta") and isinstance(r.get("version"), int):
            rows.append(
                {
                    "version": r["version"],
                    "kind": r["kind"],
                    "KB": (_num(r.get("nbytes")) or 0) / 1e3,
                    "changed_pct": _num(r.get("changed_pct")),
                    "encode_s": _num(r.get("encode_s")),
                    "hash_s": _num(r.get("hash_s")),
                    "upload_s": _num(r.get("upload_s")),
                    "catchup_KB": (_num(r.get("catchup_bytes")) or 0) / 1e3,
                }
            )
    frame = pd.DataFrame(rows, columns=PUBLISH_COLUMNS)
    frame = frame.drop_duplicates("version", keep="last").sort_values("version", kind="stable")
    return frame.astype({"version": "int64", "kind": "str"}).astype({c: "float64" for c in PUBLISH_COLUMNS[2:]})


def delta_size_frame(snap: Snapshot) -> pd.DataFrame:
    """Size of each published version (KB), anchors and deltas told apart by ``kind``."""
    return publish_frame(snap)[["version", "KB", "kind"]]


def changed_frame(snap: Snapshot) -> pd.DataFrame:
    """Percentage of parameters changed by each delta (anchors, 100 % by definition, left out)."""
    frame = publish_frame(snap)
    return frame[frame["kind"] == "delta"][["version", "changed_pct"]]


def timing_frame(snap: Snapshot) -> pd.DataFrame:
    """Encode, hash and upload seconds per version, long format (version, stage, seconds)."""
    frame = publish_frame(snap)
    stages = frame.melt(
        id_vars=["version"], value_vars=["encode_s", "hash_s", "upload_s"], var_name="stage", value_name="seconds"
    )
    stages["stage"] = stages["stage"].str.removesuffix("_s")
    return stages.dropna().sort_values(["version", "stage"], kind="stable").reset_index(drop=True)


SYNC_SERIES = ("apply", "idle per sync")


def sync_time_frame(view: BucketView, replicas: Iterable[str] | None = None) -> pd.DataFrame:
    """Replica apply time per version, and each replica's mean inference idle per sync so far.

    Returns:
        Long format: version, seconds, series (one of :data:`SYNC_SERIES`), replica.
    """
    wanted = set(replicas) if replicas is not None else None
    rows = []
    for (replica, step), (apply_s, idle_s) in sorted(view.sync_history.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if wanted is not None and replica not in wanted:
            continue
        for series, seconds in zip(SYNC_SERIES, (apply_s, idle_s)):
            if seconds is not None:
                rows.append({"version": step, "seconds": seconds, "series": series, "replica": replica})
    return pd.DataFrame(rows, columns=["version", "seconds", "series", "replica"]).astype(
        {"version": "int64", "seconds": "float64", "series": "str", "replica": "str"}
    )


def reward_frame(snap: Snapshot) -> pd.DataFrame:
    """Mean reward per policy version: from the env's scores and from the trainer's batches.

    Returns:
        Long format: version, mean_reward, source (``"env"`` weighted by sample count, ``"trainer"``).
    """
    rows = []
    totals: dict[int, list[float]] = {}
    for r in snap.env_rows:
        v, m, n = r.get("version"), _num(r.get("mean_reward")), _num(r.get("count")) or 1.0
        if isinstance(v, int) and m is not None:
            acc = totals.setdefault(v, [0.0, 0.0])
            acc[0] += m * n
            acc[1] += n
    rows += [{"version": v, "mean_reward": s / n, "source": "env"} for v, (s, n) in sorted(totals.items()) if n]
    by_version: dict[int, list[float]] = {}
    for r in snap.trainer_rows:
        if r.get("kind") == "train" and isinstance(r.get("version"), int) and _num(r.get("mean_reward")) is not None:
            by_version.setdefault(r["version"], []).append(float(r["mean_reward"]))
    rows += [{"version": v, "mean_reward": sum(x) / len(x), "source": "trainer"} for v, x in sorted(by_version.items())]
    return pd.DataFrame(rows, columns=["version", "mean_reward", "source"]).astype(
        {"version": "int64", "mean_reward": "float64", "source": "str"}
    )


FLEET_COLUMNS = [
    "replica",
    "engine",
    "version",
    "newest",
    "lag",
    "apply s",
    "idle per sync s",
    "MB downloaded",
    "tokens/s",
    "age s",
]


def fleet_frame(snap: Snapshot, replicas: Iterable[str] | None = None) -> pd.DataFrame:
    """One row per replica status object (optionally only ``replicas``)."""
    wanted = set(replicas) if replicas is not None else None

    def fmt(value: Any, digits: int) -> str:
        num = _num(value)
        return "" if num is None else f"{num:.{digits}f}"

    rows = []
    for st in snap.statuses:
        replica = str(st.get("replica_id", "?"))
        if wanted is not None and replica not in wanted:
            continue
        updated = _num(st.get("updated_at"))
        rows.append(
            [
                replica,
                str(st.get("engine", "")),
                fmt(st.get("applied_step"), 0),
                fmt(st.get("newest_step"), 0),
                fmt(st.get("lag"), 0),
                fmt(st.get("apply_s"), 4),
                fmt(st.get("idle_per_sync_s"), 4),
                fmt((_num(st.get("bytes_downloaded")) or 0) / 1e6, 2),
                fmt(st.get("tokens_per_s"), 0),
                fmt(None if updated is None else max(snap.read_at - updated, 0.0), 1),
            ]
        )
    return pd.DataFrame(rows, columns=FLEET_COLUMNS)


def recent_publishes_frame(snap: Snapshot, n: int = RECENT_PUBLISHES) -> pd.DataFrame:
    """The ``n`` newest publishes, newest first: version, kind, bytes, % changed."""
    frame = publish_frame(snap).tail(n).iloc[::-1]
    return pd.DataFrame(
        {
            "version": frame["version"].astype(str),
            "kind": frame["kind"],
            "bytes": [f"{kb * 1e3:,.0f}" for kb in frame["KB"]],
            "% changed": ["" if pd.isna(p) else f"{p:.2f}" for p in frame["changed_pct"]],
        }
    )


def episodes_frame(snap: Snapshot) -> pd.DataFrame:
    """The env's recent scored episodes, newest first: version, prompt, completion, reward."""
    episodes = snap.env_extra.get("episodes")
    rows = [e for e in episodes if isinstance(e, dict)] if isinstance(episodes, list) else []
    frame = pd.DataFrame(rows[::-1], columns=["version", "prompt", "completion", "reward"])
    return frame.fillna("").astype(str)


def current_policy(snap: Snapshot, default: AnchorPolicy | None = None) -> dict[str, Any]:
    """The anchor policy in force at the next publish.

    Returns:
        ``{"policy", "interval", "max_catchup_ratio", "source"}``; ``source`` is
        ``"control object"`` or ``"default"`` (the trainer's own setting applies).
    """
    policy = snap.policy or default or FixedInterval(DEFAULT_INTERVAL)
    return {
        "policy": policy.name,
        "interval": getattr(policy, "interval", DEFAULT_INTERVAL),
        "max_catchup_ratio": getattr(policy, "max_catchup_ratio", DEFAULT_MAX_CATCHUP_RATIO),
        "source": "control object" if snap.policy is not None else "default",
    }


def describe_policy(info: dict[str, Any]) -> str:
    """One line for :func:`current_policy`'s result."""
    if info["policy"] == "adaptive":
        what = f"adaptive, anchor when catch-up would exceed {info['max_catchup_ratio']:g} anchors"
    else:
        what = f"fixed, an anchor every {info['interval']} publishes"
    return f"Anchor policy: **{what}** ({info['source']})"


def make_policy(policy: str, interval: float | None, max_catchup_ratio: float | None) -> AnchorPolicy:
    """Build a policy from form values.

    Raises:
        ValueError: invalid values (interval < 1, ratio <= 1, unknown policy).
    """
    if policy == "adaptive":
        return Adaptive(float(max_catchup_ratio if max_catchup_ratio is not None else DEFAULT_MAX_CATCHUP_RATIO))
    if policy != "fixed":
        raise ValueError(f"unknown anchor policy {policy!r}")
    if interval is None or float(interval) != int(interval):
        raise ValueError(f"anchor interval must be a whole number, got {interval!r}")
    return FixedInterval(int(interval))


def write_policy(bucket: Bucket, policy: AnchorPolicy) -> None:
    """Write the control object; the trainer picks it up at its next publish."""
    bucket.put(CONTROL_KEY, policy_to_json(policy))
    logger.info("anchor policy set to %s in %s", policy.settings(), getattr(bucket, "url", "bucket"))


def trainer_summary(snap: Snapshot) -> str:
    """One line: published version, optimizer steps, buffered groups, newest loss and reward."""
    if snap.manifest is None and not snap.trainer_rows:
        return "Trainer: nothing published yet."
    version = snap.manifest.step if snap.manifest else snap.trainer_extra.get("version")
    parts = [f"version **{version}**"]
    if "opt_steps" in snap.trainer_extra:
        parts.append(f"{snap.trainer_extra['opt_steps']} optimizer steps")
    if "buffered_groups" in snap.trainer_extra:
        parts.append(f"{snap.trainer_extra['buffered_groups']} groups buffered")
    train = [r for r in snap.trainer_rows if r.get("kind") == "train"]
    if train:
        last = train[-1]
        if _num(last.get("loss")) is not None:
            parts.append(f"loss {last['loss']:.4f}")
        if _num(last.get("mean_reward")) is not None:
            parts.append(f"batch reward {last['mean_reward']:.3f}")
    parts += refused_parts(snap.trainer_extra)
    return "Trainer: " + ", ".join(parts)


def refused_parts(extra: dict[str, Any]) -> list[str]:
    """``["N bucket objects refused (last: ...)"]`` from a role's metrics, or nothing."""
    refused = extra.get("refused")
    if not isinstance(refused, dict) or not _num(refused.get("total")):
        return []
    last = refused.get("last") if isinstance(refused.get("last"), str) else ""
    return [f"**{int(refused['total'])} bucket objects refused** (last: `{last[:120]}`)"]


def env_summary(snap: Snapshot) -> str:
    """One line: environment, tasks/s, scores/s, samples scored, newest mean reward."""
    extra = snap.env_extra
    if not extra:
        return "Environment: no figures yet."
    parts = [f"**{extra.get('env', '?')}**"]
    for key, label in (("tasks_per_s", "tasks/s"), ("scores_per_s", "scores/s")):
        if _num(extra.get(key)) is not None:
            parts.append(f"{extra[key]:.1f} {label}")
    if "scored" in extra:
        parts.append(f"{extra['scored']} samples scored")
    rewards = reward_frame(snap)
    env_rewards = rewards[rewards["source"] == "env"]
    if len(env_rewards):
        last = env_rewards.iloc[-1]
        parts.append(f"mean reward {last['mean_reward']:.3f} at version {last['version']}")
    parts += refused_parts(extra)
    return "Environment: " + ", ".join(parts)


# -- running a role -------------------------------------------------------------------------------


class Role(Protocol):
    """What :class:`RoleRunner` needs of a role object (Trainer, Replica, EnvSimulator)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...


_BUILD_LOCK = threading.Lock()


class RoleRunner:
    """Starts and stops the role objects a panel hosts, in background threads.

    Building a role (loading a model) can take a while, so :meth:`start` builds
    and starts it in a thread and returns at once; :attr:`state` tells where it is.

    Args:
        name: Shown in status lines ("trainer", "rollout", "env").
        build: ``build(config) -> list of role objects`` (one, or several replicas).
    """

    def __init__(self, name: str, build: Callable[[Any], Sequence[Role]]) -> None:
        self.name = name
        self._build = build
        self.objects: list[Role] = []
        self.config: Any = None
        self.error = ""
        self._starting = False
        self._stopped = False
        self._stopper: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return any(o.running for o in self.objects)

    @property
    def state(self) -> str:
        if self._starting:
            return "starting"
        if self._stopper is not None and self._stopper.is_alive():
            return "stopping"
        if self.running:
            return "running"
        if self.error:
            return "failed"
        return "finished" if self.objects and not self._stopped else "stopped"

    def start(self, config: Any, wait: bool = False) -> str:
        """Build the role objects from ``config`` and start them (in a background thread).

        Args:
            config: The role's config dataclass.
            wait: Block until started (or failed).

        Returns:
            A status line.
        """
        with self._lock:
            if self._starting or self.running or self.state == "stopping":
                return f"**{self.name}** is {self.state}; not started again."
            self._starting = True
            self._stopped = False
            self.error = ""
            self.config = config
        thread = threading.Thread(target=self._start, args=(config,), name=f"start-{self.name}", daemon=True)
        thread.start()
        if wait:
            thread.join()
        return self.status()

    def _start(self, config: Any) -> None:
        t0 = time.perf_counter()
        try:
            with _BUILD_LOCK:  # one build at a time: transformers' lazy imports are not thread-safe
                objects = list(self._build(config))
            if self._stopped:  # Stop was pressed while building
                logger.info("%s: start cancelled", self.name)
                return
            for obj in objects:
                obj.start()
            self.objects = objects
            logger.info("%s started (%d object(s)) in %.1fs", self.name, len(objects), time.perf_counter() - t0)
        except Exception as exc:  # shown in the panel; the panel keeps working
            logger.exception("%s failed to start", self.name)
            self.error = redact(f"{type(exc).__name__}: {exc}")
        finally:
            self._starting = False

    def stop(self, wait: bool = True) -> str:
        """Stop the role objects; returns a status line.

        Args:
            wait: Wait for their threads to end; otherwise stop them in a background
                thread (the state reads "stopping" meanwhile), as the panel's Stop does.
        """
        self._stopped = True
        objects = list(self.objects)

        def stop_all() -> None:
            for obj in objects:  # close() also releases engines (GPU memory); Start builds new objects
                getattr(obj, "close", obj.stop)()
            logger.info("%s stopped", self.name)

        if wait:
            stop_all()
        else:
            self._stopper = threading.Thread(target=stop_all, name=f"stop-{self.name}", daemon=True)
            self._stopper.start()
        return self.status()

    def status(self) -> str:
        """One status line."""
        line = f"**{self.name}**: {self.state}"
        if self.error:
            line += f": {self.error}"
        return line


# -- settings forms -------------------------------------------------------------------------------


def _base_type(kind: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of a field annotation such as ``int`` or ``int | None``."""
    args = typing.get_args(kind)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return kind, False


def config_form(
    config: Any, overrides: dict[str, Callable[..., Any]] | None = None, skip: Sequence[str] = (), prefix: str = ""
) -> dict[str, Any]:
    """Gradio inputs for each field of a config dataclass, prefilled from ``config``.

    Args:
        config: A config dataclass instance (e.g. ``TrainerConfig.from_env()``).
        overrides: ``field -> factory(value=..., label=..., info=...)`` for special inputs.
        skip: Fields left out of the form (they keep ``config``'s value).

    Returns:
        ``{field name: component}`` in field order.
    """
    import gradio as gr

    hints = typing.get_type_hints(type(config))
    inputs: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if field.name in skip:
            continue
        value, (kind, _) = getattr(config, field.name), _base_type(hints[field.name])
        kw = {
            "value": value,
            "label": field.name,
            "info": field.metadata.get("help"),
            "elem_id": f"{prefix}cfg-{field.name}",
        }
        if overrides and field.name in overrides:
            inputs[field.name] = overrides[field.name](**kw)
        elif kind is bool:
            inputs[field.name] = gr.Checkbox(**kw)
        elif kind is int:
            inputs[field.name] = gr.Number(precision=0, **kw)
        elif kind is float:
            inputs[field.name] = gr.Number(**kw)
        else:
            inputs[field.name] = gr.Textbox(**{**kw, "value": "" if value is None else str(value)})
    return inputs


def config_from_form(base: Any, names: Sequence[str], values: Sequence[Any]) -> Any:
    """``base`` with the form's values (converted to the field types) replacing its fields.

    Raises:
        ValueError: a value does not fit its field's type.
    """
    hints = typing.get_type_hints(type(base))
    changes = {}
    for name, value in zip(names, values, strict=True):
        kind, optional = _base_type(hints[name])
        if optional and value in (None, ""):
            changes[name] = None
            continue
        if kind is int:
            if value is None or float(value) != int(value):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            value = int(value)
        elif kind is float:
            value = float(value)
        elif kind is bool:
            value = bool(value)
        elif kind is str:
            value = "" if value is None else str(value).strip()
        changes[name] = value
    return dataclasses.replace(base, **changes)


# -- Gradio builders ------------------------------------------------------------------------------


class Live:
    """The refreshed outputs of one panel, updated together by one timer tick.

    Each builder below registers its outputs and a render function here; one
    tick (and one page-load event) then reads one bucket snapshot and updates
    them all, which keeps the number of Gradio events per tick at one per panel.
    Use it as a context manager; the events are registered on exit::

        with ui.Live("./runs/bucket") as live:
            ui.sync_plots(live)
            ui.fleet_table(live)

    Args:
        bucket_url: The bucket (or a function returning its current URL).
        timer: The ``gr.Timer`` to refresh on (default: a new one ticking every :data:`REFRESH_S`).
    """

    def __init__(self, bucket_url: BucketSource, timer: Any | None = None) -> None:
        import gradio as gr

        self.source = bucket_url
        self.timer = timer if timer is not None else gr.Timer(REFRESH_S)
        self._outputs: list[Any] = []
        self._renders: list[tuple[int, Callable[[BucketView, Snapshot], Any]]] = []
        self._attached = False

    def add(self, outputs: Any | Sequence[Any], render: Callable[[BucketView, Snapshot], Any]) -> None:
        """Refresh ``outputs`` with ``render(view, snapshot)`` (a tuple for several outputs).

        Raises:
            RuntimeError: the events are already registered.
        """
        if self._attached:
            raise RuntimeError("Live.add after attach()")
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        self._outputs += outputs
        self._renders.append((len(outputs), render))

    def values(self) -> list[Any]:
        """The current values of every output (a failing render leaves its outputs unchanged)."""
        import gradio as gr

        view = bucket_view(self.source)
        snap = view.snapshot()
        out: list[Any] = []
        for n, render in self._renders:
            try:
                got = render(view, snap)
                out += list(got) if n > 1 else [got]
            except Exception:  # one broken figure must not blank the panel
                logger.exception("panel refresh failed")
                out += [gr.skip()] * n
        return out

    def attach(self) -> None:
        """Register the tick and page-load events (once)."""
        import gradio as gr

        if self._attached or not self._outputs:
            return
        self._attached = True
        self.timer.tick(self.values, outputs=self._outputs, show_progress="hidden", queue=True)
        root = gr.context.Context.root_block
        if root is not None:
            root.load(self.values, outputs=self._outputs, show_progress="hidden")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.attach()


def _live(source: BucketSource | Live) -> tuple[Live, bool]:
    """``(live, own)``: the given :class:`Live`, or a new one the builder attaches itself."""
    return (source, False) if isinstance(source, Live) else (Live(source), True)


# Gradio 6.31 plots fix their colour domain to the colour values of the first data they draw
# and keep it on later updates, so a series that appears later (the first delta after the
# first anchor, the trainer's rewards after the env's) is never drawn. Plots therefore start
# as ``None`` and every update carries every series (:func:`with_series`).
KINDS = ("anchor", "delta")
REWARD_SOURCES = ("env", "trainer")
STAGES = ("encode", "hash", "upload")


def with_series(frame: pd.DataFrame, column: str, series: Sequence[str], y: str) -> pd.DataFrame | None:
    """``frame`` plus one row with a missing ``y`` (not drawn) for each absent value of ``column``.

    Returns:
        ``None`` (an empty plot) while ``frame`` has no rows: the plot is laid out with its first data.
    """
    if not len(frame):
        return None
    missing = [name for name in series if name not in set(frame[column])]
    if not missing:
        return frame
    version = int(frame["version"].min())
    extra = pd.DataFrame({"version": [version] * len(missing), y: [float("nan")] * len(missing), column: missing})
    return pd.concat([frame, extra.astype({column: "str"})], ignore_index=True).astype({"version": "int64"})


def size_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Published size per version, anchors and deltas in different colours.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        prefix: Prepended to the plot's ``elem_id``.
    """
    import gradio as gr

    live, own = _live(source)
    plot = gr.ScatterPlot(
        None,
        x="version",
        y="KB",
        color="kind",
        color_map=KIND_COLORS,
        y_lim=[0, None],
        title="Published size per version (anchors red, deltas blue)",
        y_title="KB",
        height=260,
        elem_id=f"{prefix}plot-size",
    )

    def render(view: BucketView, snap: Snapshot) -> Any:
        frame = with_series(delta_size_frame(snap), "kind", KINDS, "KB")
        if frame is None:
            return None
        # Headroom above the anchors (else drawn on the top edge), rounded so it rarely changes.
        top = float(frame["KB"].max()) * 1.1
        step = 10 ** math.floor(math.log10(top)) / 2 if top > 0 else 1.0
        return gr.update(value=frame, y_lim=[0, math.ceil(top / step) * step])

    live.add(plot, render)
    if own:
        live.attach()
    return plot


def apply_plot(
    source: BucketSource | Live, replicas: Callable[[], Iterable[str] | None] | None = None, prefix: str = ""
) -> Any:
    """Replica apply time per version and mean inference idle per sync, from the status objects.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids to plot (``None``: all).
        prefix: Prepended to the plot's ``elem_id``.
    """
    import gradio as gr

    live, own = _live(source)
    plot = gr.ScatterPlot(
        None,
        x="version",
        y="seconds",
        color="series",
        tooltip="all",
        title="Replica apply time and mean inference idle per sync",
        height=260,
        elem_id=f"{prefix}plot-apply",
    )
    live.add(
        plot,
        lambda view, snap: with_series(
            sync_time_frame(view, replicas() if replicas else None), "series", SYNC_SERIES, "seconds"
        ),
    )
    if own:
        live.attach()
    return plot


def sync_plots(
    source: BucketSource | Live, replicas: Callable[[], Iterable[str] | None] | None = None, prefix: str = ""
) -> dict[str, Any]:
    """Plots of the weight sync: size per version (anchors marked), % changed, publish
    stage times, and replica apply time / inference idle per sync.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids whose apply times are plotted (``None``: all).
        prefix: Prepended to the plots' ``elem_id``.

    Returns:
        ``{"size", "changed", "timing", "apply"}`` components.
    """
    import gradio as gr

    live, own = _live(source)
    with gr.Row():
        size = size_plot(live, prefix=prefix)
        changed = gr.LinePlot(
            None,
            x="version",
            y="changed_pct",
            title="Parameters changed per delta",
            y_title="% changed",
            height=260,
            elem_id=f"{prefix}plot-changed",
        )
    with gr.Row():
        timing = gr.LinePlot(
            None,
            x="version",
            y="seconds",
            color="stage",
            title="Publish: encode / hash / upload",
            height=260,
            elem_id=f"{prefix}plot-timing",
        )
        apply = apply_plot(live, replicas, prefix=prefix)
    live.add(
        [changed, timing],
        lambda view, snap: (changed_frame(snap), with_series(timing_frame(snap), "stage", STAGES, "seconds")),
    )
    if own:
        live.attach()
    return {"size": size, "changed": changed, "timing": timing, "apply": apply}


def reward_plot(source: BucketSource | Live, prefix: str = "") -> Any:
    """Mean reward per policy version (env scores and trainer batches).

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        prefix: Prepended to the plot's ``elem_id``.
    """
    import gradio as gr

    live, own = _live(source)
    plot = gr.LinePlot(
        None,
        x="version",
        y="mean_reward",
        color="source",
        title="Mean reward per policy version",
        y_lim=[0, 1],
        height=280,
        elem_id=f"{prefix}plot-reward",
    )
    live.add(plot, lambda view, snap: with_series(reward_frame(snap), "source", REWARD_SOURCES, "mean_reward"))
    if own:
        live.attach()
    return plot


def publishes_table(source: BucketSource | Live, prefix: str = "") -> Any:
    """The recent publishes (version, kind, bytes, % changed), newest first.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        prefix: Prepended to the table's ``elem_id`` (``<prefix>recent-publishes``).
    """
    import gradio as gr

    live, own = _live(source)
    table = gr.Dataframe(
        recent_publishes_frame(Snapshot()),
        label="Recent publishes",
        interactive=False,
        max_height=420,
        elem_id=f"{prefix}recent-publishes",
    )
    live.add(table, lambda view, snap: recent_publishes_frame(snap))
    if own:
        live.attach()
    return table


def fleet_table(
    source: BucketSource | Live,
    replicas: Callable[[], Iterable[str] | None] | None = None,
    label: str = "Rollout fleet",
    prefix: str = "",
) -> Any:
    """One row per replica status object in the bucket.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        replicas: Function returning the replica ids to show (``None``: all).
        label: Table label.
        prefix: Prepended to the table's ``elem_id`` (``<prefix>fleet-table``).
    """
    import gradio as gr

    live, own = _live(source)
    table = gr.Dataframe(fleet_frame(Snapshot()), label=label, interactive=False, elem_id=f"{prefix}fleet-table")
    live.add(table, lambda view, snap: fleet_frame(snap, replicas() if replicas else None))
    if own:
        live.attach()
    return table


def summary_line(source: BucketSource | Live, render: Callable[[Snapshot], str], elem_id: str | None = None) -> Any:
    """A Markdown line computed from the bucket's snapshot (e.g. :func:`trainer_summary`);
    bucket read errors are appended to it."""
    import gradio as gr

    live, own = _live(source)
    line = gr.Markdown(render(Snapshot()), elem_id=elem_id)
    live.add(line, lambda view, snap: render(snap) + (f"  \n:warning: {snap.error}" if snap.error else ""))
    if own:
        live.attach()
    return line


def episodes_table(source: BucketSource | Live, prefix: str = "") -> Any:
    """The environment's recent scored episodes (version, prompt, completion, reward)."""
    import gradio as gr

    live, own = _live(source)
    table = gr.Dataframe(
        episodes_frame(Snapshot()),
        label="Recent episodes",
        interactive=False,
        wrap=True,
        max_height=420,
        elem_id=f"{prefix}episodes",
    )
    live.add(table, lambda view, snap: episodes_frame(snap))
    if own:
        live.attach()
    return table


def anchor_policy_controls(
    source: BucketSource | Live, default: AnchorPolicy | None = None, prefix: str = ""
) -> dict[str, Any]:
    """Controls of the anchor policy: fixed/adaptive, interval, ratio, Apply.

    Apply writes the bucket's control object (:func:`~shared.protocol.policy_to_json`);
    the trainer, wherever it runs, uses it from its next publish. The inputs are
    filled from the control object when the page loads (not on every refresh,
    which would overwrite what the user is typing); the line above them shows
    the policy in force and refreshes.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        default: The policy to show while the bucket has no control object.
        prefix: Prepended to the components' ``elem_id`` (``<prefix>anchor-interval``, ...).

    Returns:
        ``{"current", "policy", "interval", "ratio", "apply", "result"}`` components.
    """
    import gradio as gr

    live, own = _live(source)
    info = current_policy(Snapshot(), default)
    current = gr.Markdown(describe_policy(info), elem_id=f"{prefix}anchor-policy-current")
    with gr.Row():
        policy = gr.Radio(
            ["fixed", "adaptive"], value=info["policy"], label="Anchor policy", elem_id=f"{prefix}anchor-policy"
        )
        interval = gr.Number(
            info["interval"],
            precision=0,
            minimum=1,
            label="Anchor interval (publishes, fixed)",
            elem_id=f"{prefix}anchor-interval",
        )
        ratio = gr.Number(
            info["max_catchup_ratio"],
            minimum=1.0,
            step=0.5,
            label="Max catch-up ratio (anchors, adaptive)",
            elem_id=f"{prefix}anchor-ratio",
        )
        apply = gr.Button("Apply", variant="primary", elem_id=f"{prefix}anchor-apply")
    result = gr.Markdown("", elem_id=f"{prefix}anchor-result")

    def on_apply(kind: str, every: float | None, bound: float | None) -> str:
        try:
            new = make_policy(kind, every, bound)
            write_policy(bucket_view(live.source).bucket, new)
        except (ValueError, BucketError) as exc:
            logger.warning("anchor policy not applied: %s", exc)
            return redact(f":x: not applied: {exc}")
        return f"Applied `{json.dumps(new.settings())}`: takes effect at the next publish."

    def on_load() -> tuple[str, int, float]:
        got = current_policy(bucket_view(live.source).snapshot(), default)
        return got["policy"], got["interval"], got["max_catchup_ratio"]

    apply.click(on_apply, inputs=[policy, interval, ratio], outputs=result)
    live.add(current, lambda view, snap: describe_policy(current_policy(snap, default)))
    root = gr.context.Context.root_block
    if root is not None:
        root.load(on_load, outputs=[policy, interval, ratio], show_progress="hidden")
    if own:
        live.attach()
    return {
        "current": current,
        "policy": policy,
        "interval": interval,
        "ratio": ratio,
        "apply": apply,
        "result": result,
    }


def role_controls(
    runner: RoleRunner,
    make_config: Callable[..., Any],
    inputs: Sequence[Any],
    live: Live,
    on_started: Callable[[Any], None] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Start / Stop buttons and a status line for a :class:`RoleRunner`.

    Args:
        runner: The role this panel hosts.
        make_config: ``make_config(*form values) -> config`` (may raise ``ValueError``).
        inputs: The form components passed to ``make_config``.
        live: Refreshes the status line.
        on_started: Called with the config when Start is pressed (e.g. to follow its bucket).
        prefix: Prepended to the components' ``elem_id`` (``<prefix>start-<name>``, ...).

    Returns:
        ``{"start", "stop", "status"}`` components.
    """
    import gradio as gr

    name = runner.name
    with gr.Row():
        start = gr.Button(f"Start {name}", variant="primary", elem_id=f"{prefix}start-{name}")
        stop = gr.Button(f"Stop {name}", variant="stop", elem_id=f"{prefix}stop-{name}")
    status = gr.Markdown(runner.status(), elem_id=f"{prefix}status-{name}")

    def on_start(*values: Any) -> str:
        try:
            config = make_config(*values)
        except (ValueError, TypeError) as exc:
            return f"**{name}**: invalid settings: {redact(str(exc))}"
        if on_started is not None:
            on_started(config)
        return runner.start(config)

    start.click(on_start, inputs=list(inputs), outputs=status)
    stop.click(lambda: runner.stop(wait=False), outputs=status)
    live.add(status, lambda view, snap: runner.status())
    return {"start": start, "stop": stop, "status": status}


def launch_options() -> dict[str, Any]:
    """``launch()`` keyword arguments from the environment.

    ``GRADIO_SERVER_NAME`` (default ``0.0.0.0``) and ``PORT`` / ``GRADIO_SERVER_PORT``
    (default 7860). When ``SPACE_ID`` is set (running as a Space) and
    ``PANEL_AUTH="user:password"`` is set, the panel asks for that login, which
    protects the Start / Stop and anchor controls.
    """
    options: dict[str, Any] = {
        "server_name": os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
        "server_port": int(os.environ.get("PORT") or os.environ.get("GRADIO_SERVER_PORT") or 7860),
    }
    auth = os.environ.get("PANEL_AUTH", "")
    if os.environ.get("SPACE_ID") and auth:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            raise ValueError("PANEL_AUTH must be 'user:password'")
        options["auth"] = (user, password)
    return options
