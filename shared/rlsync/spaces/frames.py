"""Plot and table data: pandas DataFrames and summary lines computed from a :class:`~.snapshots.Snapshot`.

Plain functions, testable without a browser; the Gradio components in
:mod:`.plots` and :mod:`.tables` draw what they return.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import pandas as pd

from ..roles import Role
from .charts import Chart
from .metrics import EnvMetrics, RefusalCounts, ReplicaStatus, TrainRow
from .snapshots import BucketView, Snapshot

#: Rows of the recent-publishes table.
RECENT_PUBLISHES = 12

PUBLISH_COLUMNS = ["version", "kind", "KB", "changed_pct", "encode_s", "hash_s", "upload_s", "catchup_KB"]


def publish_frame(snap: Snapshot) -> pd.DataFrame:
    """One row per publish: version, kind, KB, changed_pct, encode_s, hash_s, upload_s, catchup_KB."""
    rows = [
        [r.version, r.kind, r.nbytes / 1e3, r.changed_pct, r.encode_s, r.hash_s, r.upload_s, r.catchup_bytes / 1e3]
        for r in snap.trainer.publishes
    ]
    frame = pd.DataFrame(rows, columns=PUBLISH_COLUMNS)
    frame = frame.drop_duplicates("version", keep="last").sort_values("version", kind="stable")
    return frame.astype({"version": "int64", "kind": "str"}).astype({c: "float64" for c in PUBLISH_COLUMNS[2:]})


def expert_change_frame(snap: Snapshot) -> pd.DataFrame:
    """A MoE run's changed percentage of each expert (``"<layer>.<expert>"``) per delta."""
    rows = [
        {"version": r.version, "expert": expert, "changed_pct": pct}
        for r in snap.trainer.publishes
        if r.kind == "delta"
        for expert, pct in r.experts_changed_pct.items()
    ]
    frame = pd.DataFrame(rows, columns=["version", "expert", "changed_pct"])
    return frame.astype({"version": "int64", "expert": "str", "changed_pct": "float64"})


def delta_size_frame(snap: Snapshot) -> pd.DataFrame:
    """Size of each published version (KB), anchors and deltas told apart by ``kind``."""
    return publish_frame(snap)[["version", "KB", "kind"]]


def changed_frame(snap: Snapshot) -> pd.DataFrame:
    """Percentage of parameters changed by each delta (anchors, 100 % by definition, left out)."""
    frame = publish_frame(snap)
    return frame[frame["kind"] == "delta"][["version", "changed_pct"]]


#: Series of :func:`delta_ratio_frame`.
RATIO_SERIES = ("vs anchor", "vs TRL layout")


def delta_ratio_frame(snap: Snapshot) -> pd.DataFrame:
    """Each delta's size as a percentage of the newest anchor before it and of the same changes in
    TRL's plain layout (6 bytes per changed bf16 element plus the header, ``trl_nbytes``).

    Returns:
        Long format: version, percent, against (one of :data:`RATIO_SERIES`).
    """
    rows, anchor = [], None
    for r in sorted(snap.trainer.publishes, key=lambda r: r.version):
        if r.kind == "anchor":
            anchor = r.nbytes
        else:
            for against, base in zip(RATIO_SERIES, (anchor, r.trl_nbytes)):
                if base:
                    rows.append({"version": r.version, "percent": 100 * r.nbytes / base, "against": against})
    frame = pd.DataFrame(rows, columns=["version", "percent", "against"])
    return frame.astype({"version": "int64", "percent": "float64", "against": "str"})


#: The figures of a :class:`~.metrics.TrainRow` that :func:`train_frame` holds (each a float column).
TRAIN_FIGURES = tuple(f.name for f in dataclasses.fields(TrainRow) if f.name not in ("kind", "opt_step"))


def training_charts(row: type[TrainRow] = TrainRow) -> tuple[Chart, ...]:
    """A chart per optimizer step of every figure of ``row`` that names one (``_log(..., chart=TITLE)``)."""
    return tuple(
        Chart(f.metadata["chart"], x="opt_step", y=f.name, x_title="optimizer step",
              formats={f.name: f.metadata["format"]} if f.metadata.get("format") else {})
        for f in dataclasses.fields(row) if f.metadata.get("chart")
    )  # fmt: skip


#: The trainer panel's plots of its per-step figures, in field order: each draws a field of
#: :class:`~.metrics.TrainRow` (a column of :func:`train_frame`) against the optimizer step. A new
#: plot of a TRL figure is one ``TrainRow`` field naming its log entry and its chart's title.
TRAINING_CHARTS = training_charts()


def train_frame(snap: Snapshot) -> pd.DataFrame:
    """One row per optimizer step: ``opt_step`` and every figure of a :class:`~.metrics.TrainRow`
    (:data:`TRAIN_FIGURES`, ``NaN`` where the step logged none); what :func:`~.plots.training_plots` draw."""
    rows = [dataclasses.asdict(r) for r in snap.trainer.steps if r.opt_step is not None]
    frame = pd.DataFrame(rows, columns=["opt_step", *TRAIN_FIGURES])
    return frame.astype({"opt_step": "int64", **dict.fromkeys(TRAIN_FIGURES, "float64")})


def timing_frame(snap: Snapshot) -> pd.DataFrame:
    """Encode, hash and upload seconds per version, long format (version, stage, seconds)."""
    frame = publish_frame(snap)
    stages = frame.melt(
        id_vars=["version"], value_vars=["encode_s", "hash_s", "upload_s"], var_name="stage", value_name="seconds"
    )
    stages["stage"] = stages["stage"].str.removesuffix("_s")
    return stages.dropna().sort_values(["version", "stage"], kind="stable").reset_index(drop=True)


def sync_time_frame(view: BucketView, replicas: Iterable[str] | None = None) -> pd.DataFrame:
    """Every version each replica applied (as far as its status objects' ``recent_syncs`` reached the view),
    with the seconds inference paused to apply it.

    Returns:
        version, seconds, replica, kind.
    """
    wanted = set(replicas) if replicas is not None else None
    rows = [
        {"version": step, "seconds": sync.idle_s, "replica": replica, "kind": sync.kind}
        for (replica, step), sync in sorted(view.sync_history.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        if wanted is None or replica in wanted
    ]
    return pd.DataFrame(rows, columns=["version", "seconds", "replica", "kind"]).astype(
        {"version": "int64", "seconds": "float64", "replica": "str", "kind": "str"}
    )


def fleet_lag_frame(view: BucketView, snap: Snapshot) -> pd.DataFrame:
    """Seconds from each publish until every replica that was following then held that version or a newer one.

    A replica counts for a version once its remembered syncs reach back to it (one that joined later is
    not waited for); a version some replica has not reached yet is left out.

    Returns:
        version, seconds, kind.
    """
    applied: dict[str, list[tuple[int, float]]] = {}
    for (replica, step), sync in view.sync_history.items():
        applied.setdefault(replica, []).append((step, sync.time))
    for syncs in applied.values():
        syncs.sort()
    rows = []
    for r in snap.trainer.publishes:
        version, published = r.version, r.time
        if published is None:
            continue
        reached = []
        for syncs in applied.values():
            if syncs[0][0] > version:
                continue  # joined after this version
            later = [t for step, t in syncs if step >= version]
            if not later:
                break  # a replica that has not reached it yet
            reached.append(min(later))
        else:
            if reached:
                rows.append({"version": version, "seconds": max(max(reached) - published, 0.0), "kind": r.kind})
    frame = pd.DataFrame(rows, columns=["version", "seconds", "kind"]).drop_duplicates("version", keep="last")
    return frame.astype({"version": "int64", "seconds": "float64", "kind": "str"})


def reward_frame(snap: Snapshot) -> pd.DataFrame:
    """Mean reward per policy version: from the env's scores and from the trainer's batches.

    Returns:
        Long format: version, mean_reward, source (``"env"`` weighted by sample count, ``"trainer"``).
    """
    rows = []
    totals: dict[int, list[float]] = {}
    for r in snap.env.rows:
        acc = totals.setdefault(r.version, [0.0, 0.0])
        acc[0] += r.mean_reward * r.count
        acc[1] += r.count
    rows += [{"version": v, "mean_reward": s / n, "source": "env"} for v, (s, n) in sorted(totals.items()) if n]
    by_version: dict[int, list[float]] = {}
    for t in snap.trainer.steps:
        if t.version is not None and t.mean_reward is not None:
            by_version.setdefault(t.version, []).append(t.mean_reward)
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
    "catch-up",
    "apply s",
    "idle per sync s",
    "MB downloaded",
    "tokens/s",
    "age s",
]


def fleet_frame(snap: Snapshot, replicas: Iterable[str] | None = None) -> pd.DataFrame:
    """One row per replica status object (optionally only ``replicas``)."""
    wanted = set(replicas) if replicas is not None else None

    def fmt(value: float | None, digits: int) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    rows = []
    for st in snap.statuses:
        if wanted is not None and st.replica_id not in wanted:
            continue
        updated = st.updated_at
        rows.append(
            [
                st.replica_id,
                st.engine,
                fmt(st.applied_step, 0),
                fmt(st.newest_step, 0),
                fmt(st.lag, 0),
                catch_up(st),
                fmt(st.apply_s, 4),
                fmt(st.idle_per_sync_s, 4),
                fmt(st.bytes_downloaded / 1e6, 2),
                fmt(st.tokens_per_s, 0),
                fmt(None if updated is None else max(snap.read_at - updated, 0.0), 1),
            ]
        )
    return pd.DataFrame(rows, columns=FLEET_COLUMNS)


def catch_up(status: ReplicaStatus) -> str:
    """How far a replica has caught up with the newest version: ``loading`` before its first version,
    ``caught up``, or the share of the versions since its first one that it holds, and how many it lags."""
    applied, newest = status.applied_step, status.newest_step
    if applied is None:
        return "loading"
    if newest is None or newest <= applied:
        return "caught up"
    syncs = status.syncs
    start = syncs[0].step if syncs and syncs[0].kind == "anchor" and syncs[0].step <= applied else None
    share = "" if start is None or newest == start else f"{100 * (applied - start) / (newest - start):.0f}%, "
    return f"{share}{newest - applied} behind"


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
    """The env's recent scored episodes, newest first: version, task type, prompt, completion, reward."""
    rows = [dataclasses.asdict(e) for e in snap.env.episodes[::-1]]
    frame = pd.DataFrame(rows, columns=["version", "type", "prompt", "completion", "reward"])
    return frame.fillna("").astype(str)


def task_type_frame(snap: Snapshot) -> pd.DataFrame:
    """Mean reward and count per source and task type (``metrics/env.json`` -> ``by_type``), largest count first."""
    rows = []
    for key, value in snap.env.by_type.items():
        source, _, kind = key.partition(" / ")
        mean = "" if value.mean_reward is None else f"{value.mean_reward:.3f}"
        rows.append({"source": source, "task type": kind, "mean reward": mean, "count": value.count})
    frame = pd.DataFrame(rows, columns=["source", "task type", "mean reward", "count"])
    return frame.sort_values(["count", "source", "task type"], ascending=[False, True, True], kind="stable")


def failures_frame(snap: Snapshot) -> pd.DataFrame:
    """Scoring failures by reason (``metrics/env.json`` -> ``failures``), most frequent first."""
    rows = [{"reason": k, "count": v} for k, v in snap.env.failures.items()]
    return pd.DataFrame(rows, columns=["reason", "count"]).sort_values(["count", "reason"], ascending=[False, True])


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>:@$=])")


def plain(value: Any) -> str:
    """A bucket-sourced value as literal text inside a Markdown line: every Markdown character is
    backslash-escaped (``:`` and ``@`` too, so no bare URL or address is auto-linked) and ``<``/``&``
    become entities, so no link, image or HTML tag is ever rendered."""
    text = str(value).replace("&", "&amp;").replace("<", "&lt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def trainer_summary(snap: Snapshot) -> str:
    """One line: published version, optimizer steps, buffered groups, newest loss and reward, versions coalesced."""
    trainer = snap.trainer
    if snap.manifest is None and not trainer.rows:
        return "Trainer: nothing published yet."
    version = snap.manifest.step if snap.manifest else trainer.version
    parts = [f"version **{plain(version)}**"]
    if trainer.opt_steps is not None:
        parts.append(f"{trainer.opt_steps} optimizer steps")
    if trainer.queued_samples is not None:
        parts.append(f"{trainer.queued_samples} samples queued")
    if trainer.checkpoint_step is not None:
        parts.append(f"checkpoint at step {trainer.checkpoint_step}")
    if trainer.steps:
        last = trainer.steps[-1]
        if last.loss is not None:
            parts.append(f"loss {last.loss:.4f}")
        if last.mean_reward is not None:
            parts.append(f"batch reward {last.mean_reward:.3f}")
    if trainer.publish is not None and trainer.publish.coalesced:
        coalesced = trainer.publish.coalesced
        parts.append(f"**{coalesced} version(s) coalesced** (the background publisher fell behind the steps)")
    parts += refused_parts(trainer.refused)
    return "Trainer: " + ", ".join(parts) + (f" ({plain(trainer.notice)})" if trainer.notice else "")


def refused_parts(refused: RefusalCounts | None) -> list[str]:
    """``["N bucket objects refused (last: ...)"]`` from a role's metrics, or nothing: also when the claimed
    ``total`` is not the sum of its ``by_kind`` counts (:attr:`~.metrics.RefusalCounts.consistent`)."""
    if refused is None or not refused.consistent:
        return []
    return [f"**{refused.total} bucket objects refused** (last: {plain(refused.last[:120])})"]


def env_summary(snap: Snapshot) -> str:
    """One line: environment, tasks/s, scores/s, samples scored, newest mean reward."""
    env = snap.env
    if env == EnvMetrics():
        return "Environment: no figures yet."
    parts = [f"**{plain(env.env or '?')}**"]
    for value, label in ((env.tasks_per_s, "tasks/s"), (env.scores_per_s, "scores/s")):
        if value is not None:
            parts.append(f"{value:.1f} {label}")
    if env.scored is not None:
        parts.append(f"{env.scored} samples scored")
    if env.failures:
        parts.append(f"{sum(env.failures.values())} scoring failures")
    rewards = reward_frame(snap)
    env_rewards = rewards[rewards["source"] == "env"]
    if len(env_rewards):
        last = env_rewards.iloc[-1]
        parts.append(f"mean reward {last['mean_reward']:.3f} at version {last['version']}")
    parts += refused_parts(env.refused)
    return "Environment: " + ", ".join(parts)


#: Staleness values drawn in the histogram (versions behind when trained).
MAX_STALENESS_BARS = 64


def staleness_frame(snap: Snapshot) -> pd.DataFrame:
    """Samples TRL took in time, by staleness (``metrics/trainer.json`` -> ``flow.staleness``)."""
    histogram = snap.trainer.flow.staleness if snap.trainer.flow is not None else {}
    rows = [{"staleness": int(k), "samples": v} for k, v in histogram.items()
            if k.isascii() and k.isdigit() and int(k) < MAX_STALENESS_BARS]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["staleness", "samples"]).sort_values("staleness")
    return frame.astype({"staleness": "int64", "samples": "int64"})


def flow_summary(snap: Snapshot) -> str:
    """One line: the share of scored samples trained on, the trainer's waiting, and what was dropped."""
    flow = snap.trainer.flow
    if flow is None:
        return "Flow: no figures yet."
    trained, scored = flow.trained, snap.env.scored
    parts = [f"pacing {flow.pacing.value}"] if flow.pacing is not None else []
    if trained is not None and scored:
        parts.append(f"**{100 * trained / scored:.0f}%** of {scored} scored samples trained on ({trained})")
    if flow.wait_s_total is not None and flow.wait_share is not None:
        parts.append(f"trainer waited **{flow.wait_s_total:.0f} s** ({100 * flow.wait_share:.0f}% of its wall time)")
    if flow.wait_s_last is not None:
        parts.append(f"{flow.wait_s_last:.2f} s before the last step")
    counts = [(flow.dropped_stale, "dropped stale"), (flow.expired_unread, "expired unread"),
              (flow.dropped_degenerate, "in degenerate groups"), (snap.env.cancelled_stale, "cancelled stale")]  # fmt: skip
    parts += [f"{n} {label}" for n, label in counts if n]
    return "Flow: " + ", ".join(parts)


def adapter_summary(snap: Snapshot) -> str:
    """The LoRA adapter chain, when the run has one ('' otherwise): its version, what it retains and what a
    joining replica downloads, and the adapter version each replica serves."""
    chain = snap.adapters
    if chain is None:
        return ""
    parts = [
        f"LoRA adapter chain: version **{chain.step}**", f"{len(chain.anchors)} anchors and {len(chain.deltas)} deltas retained",
        f"{chain.catchup_bytes() / 1e3:,.0f} KB to catch up",  # a valid pointer holds an anchor
    ]  # fmt: skip
    base = chain.metadata.get("base_hash")
    if isinstance(base, str) and base:
        parts.append(f"on base weights {plain(base[:12])}")
    served = [f"{plain(st.replica_id)} serves {st.adapter_step}" for st in snap.statuses if st.adapter_step is not None]
    return ", ".join(parts) + ("; " + ", ".join(served) if served else "")


def hub_requests_summary(snap: Snapshot) -> str:
    """"Hub requests, last 5 min: X of Y (tier)" per role and for the whole run, with each role's
    pacing notice ('' when no role runs on the Hub)."""
    roles = [(Role.TRAINER, snap.trainer.hub), (Role.ENV, snap.env.hub)]
    roles += [(st.replica_id, st.hub) for st in snap.statuses]
    hubs = [(name, hub) for name, hub in roles if hub is not None]
    if not hubs:
        return ""
    first = hubs[0][1]
    minutes = f"{first.window_s / 60:g} min"
    total_api = sum(h.api for _, h in hubs)
    total_res = sum(h.resolver for _, h in hubs)
    lines = [
        f"**Hub requests, last {minutes}: {total_api} of {first.api_limit} API, "
        f"{total_res} of {first.resolver_limit} resolver ({first.tier.value} tier, whole run)**"
    ]
    for name, hub in hubs:
        share = hub.share or 1
        line = (f"{name}: {hub.api} of {int(hub.api_limit / share)} API, "
                f"{hub.resolver} resolver ({hub.tier.value}, 1/{share:g} share)")  # fmt: skip
        if hub.throttled:
            line += f", {hub.throttled} answered 429"
        if hub.pacing:
            line += f"; {plain(hub.pacing)}"
        lines.append(line)
    return "  \n".join(lines)
