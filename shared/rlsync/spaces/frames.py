"""Plot and table data: pandas DataFrames and summary lines computed from a :class:`~.snapshots.Snapshot`.

Plain functions, testable without a browser; the Gradio components in
:mod:`.components` draw what they return.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import pandas as pd

from .snapshots import BucketView, Snapshot, as_number, recent_syncs

#: Rows of the recent-publishes table.
RECENT_PUBLISHES = 12

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
                    "KB": (as_number(r.get("nbytes")) or 0) / 1e3,
                    "changed_pct": as_number(r.get("changed_pct")),
                    "encode_s": as_number(r.get("encode_s")),
                    "hash_s": as_number(r.get("hash_s")),
                    "upload_s": as_number(r.get("upload_s")),
                    "catchup_KB": (as_number(r.get("catchup_bytes")) or 0) / 1e3,
                }
            )
    frame = pd.DataFrame(rows, columns=PUBLISH_COLUMNS)
    frame = frame.drop_duplicates("version", keep="last").sort_values("version", kind="stable")
    return frame.astype({"version": "int64", "kind": "str"}).astype({c: "float64" for c in PUBLISH_COLUMNS[2:]})


def expert_change_frame(snap: Snapshot) -> pd.DataFrame:
    """A MoE run's changed percentage of each expert (``"<layer>.<expert>"``) per delta."""
    rows = [
        {"version": r["version"], "expert": str(expert), "changed_pct": as_number(pct)}
        for r in snap.trainer_rows
        if r.get("kind") == "delta" and isinstance(r.get("version"), int) and isinstance(r.get("experts_changed_pct"), dict)
        for expert, pct in r["experts_changed_pct"].items()
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
    for r in sorted((r for r in snap.trainer_rows if isinstance(r.get("version"), int)), key=lambda r: r["version"]):
        nbytes = as_number(r.get("nbytes"))
        if r.get("kind") == "anchor":
            anchor = nbytes
        elif r.get("kind") == "delta" and nbytes is not None:
            for against, base in zip(RATIO_SERIES, (anchor, as_number(r.get("trl_nbytes")))):
                if base:
                    rows.append({"version": r["version"], "percent": 100 * nbytes / base, "against": against})
    frame = pd.DataFrame(rows, columns=["version", "percent", "against"])
    return frame.astype({"version": "int64", "percent": "float64", "against": "str"})


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
    for r in snap.trainer_rows:
        version, published = r.get("version"), as_number(r.get("time"))
        if r.get("kind") not in ("anchor", "delta") or type(version) is not int or published is None:
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
                rows.append({"version": version, "seconds": max(max(reached) - published, 0.0), "kind": r["kind"]})
    frame = pd.DataFrame(rows, columns=["version", "seconds", "kind"]).drop_duplicates("version", keep="last")
    return frame.astype({"version": "int64", "seconds": "float64", "kind": "str"})


def reward_frame(snap: Snapshot) -> pd.DataFrame:
    """Mean reward per policy version: from the env's scores and from the trainer's batches.

    Returns:
        Long format: version, mean_reward, source (``"env"`` weighted by sample count, ``"trainer"``).
    """
    rows = []
    totals: dict[int, list[float]] = {}
    for r in snap.env_rows:
        v, m, n = r.get("version"), as_number(r.get("mean_reward")), as_number(r.get("count")) or 1.0
        if isinstance(v, int) and m is not None:
            acc = totals.setdefault(v, [0.0, 0.0])
            acc[0] += m * n
            acc[1] += n
    rows += [{"version": v, "mean_reward": s / n, "source": "env"} for v, (s, n) in sorted(totals.items()) if n]
    by_version: dict[int, list[float]] = {}
    for r in snap.trainer_rows:
        if (
            r.get("kind") == "train"
            and isinstance(r.get("version"), int)
            and as_number(r.get("mean_reward")) is not None
        ):
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

    def fmt(value: Any, digits: int) -> str:
        num = as_number(value)
        return "" if num is None else f"{num:.{digits}f}"

    rows = []
    for st in snap.statuses:
        replica = str(st.get("replica_id", "?"))
        if wanted is not None and replica not in wanted:
            continue
        updated = as_number(st.get("updated_at"))
        rows.append(
            [
                replica,
                str(st.get("engine", "")),
                fmt(st.get("applied_step"), 0),
                fmt(st.get("newest_step"), 0),
                fmt(st.get("lag"), 0),
                catch_up(st),
                fmt(st.get("apply_s"), 4),
                fmt(st.get("idle_per_sync_s"), 4),
                fmt((as_number(st.get("bytes_downloaded")) or 0) / 1e6, 2),
                fmt(st.get("tokens_per_s"), 0),
                fmt(None if updated is None else max(snap.read_at - updated, 0.0), 1),
            ]
        )
    return pd.DataFrame(rows, columns=FLEET_COLUMNS)


def catch_up(status: dict[str, Any]) -> str:
    """How far a replica has caught up with the newest version: ``loading`` before its first version,
    ``caught up``, or the share of the versions since its first one that it holds, and how many it lags."""
    applied, newest = status.get("applied_step"), status.get("newest_step")
    if type(applied) is not int:
        return "loading"
    if type(newest) is not int or newest <= applied:
        return "caught up"
    syncs = recent_syncs(status)
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
    episodes = snap.env_extra.get("episodes")
    rows = [e for e in episodes if isinstance(e, dict)] if isinstance(episodes, list) else []
    frame = pd.DataFrame(rows[::-1], columns=["version", "type", "prompt", "completion", "reward"])
    return frame.fillna("").astype(str)


def _count(value: Any) -> int | None:
    """A finite number as an int (counts read from the bucket are untrusted), else ``None``."""
    number = as_number(value)
    return int(number) if number is not None and math.isfinite(number) else None


def task_type_frame(snap: Snapshot) -> pd.DataFrame:
    """Mean reward and count per source and task type (``metrics/env.json`` -> ``by_type``), largest count first."""
    by_type = snap.env_extra.get("by_type")
    rows = []
    for key, value in by_type.items() if isinstance(by_type, dict) else ():
        if isinstance(key, str) and isinstance(value, dict) and _count(value.get("count")) is not None:
            source, _, kind = key.partition(" / ")
            mean = as_number(value.get("mean_reward"))
            rows.append({"source": source, "task type": kind, "mean reward": "" if mean is None else f"{mean:.3f}",
                         "count": _count(value["count"])})  # fmt: skip
    frame = pd.DataFrame(rows, columns=["source", "task type", "mean reward", "count"])
    return frame.sort_values(["count", "source", "task type"], ascending=[False, True, True], kind="stable")


def failures_frame(snap: Snapshot) -> pd.DataFrame:
    """Scoring failures by reason (``metrics/env.json`` -> ``failures``), most frequent first."""
    failures = snap.env_extra.get("failures")
    rows = [{"reason": k, "count": _count(v)} for k, v in (failures.items() if isinstance(failures, dict) else ())
            if isinstance(k, str) and _count(v) is not None]  # fmt: skip
    return pd.DataFrame(rows, columns=["reason", "count"]).sort_values(["count", "reason"], ascending=[False, True])


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>:@$=])")


def plain(value: Any) -> str:
    """A bucket-sourced value as literal text inside a Markdown line: every Markdown character is
    backslash-escaped (``:`` and ``@`` too, so no bare URL or address is auto-linked) and ``<``/``&``
    become entities, so no link, image or HTML tag is ever rendered."""
    text = str(value).replace("&", "&amp;").replace("<", "&lt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def trainer_summary(snap: Snapshot) -> str:
    """One line: published version, optimizer steps, buffered groups, newest loss and reward."""
    if snap.manifest is None and not snap.trainer_rows:
        return "Trainer: nothing published yet."
    version = snap.manifest.step if snap.manifest else snap.trainer_extra.get("version")
    parts = [f"version **{plain(version)}**"]
    if "opt_steps" in snap.trainer_extra:
        parts.append(f"{plain(snap.trainer_extra['opt_steps'])} optimizer steps")
    if "queued_samples" in snap.trainer_extra:
        parts.append(f"{plain(snap.trainer_extra['queued_samples'])} samples queued")
    if snap.trainer_extra.get("checkpoint_step") is not None:
        parts.append(f"checkpoint at step {plain(snap.trainer_extra['checkpoint_step'])}")
    train = [r for r in snap.trainer_rows if r.get("kind") == "train"]
    if train:
        last = train[-1]
        if as_number(last.get("loss")) is not None:
            parts.append(f"loss {last['loss']:.4f}")
        if as_number(last.get("mean_reward")) is not None:
            parts.append(f"batch reward {last['mean_reward']:.3f}")
    parts += refused_parts(snap.trainer_extra)
    notice = snap.trainer_extra.get("notice")
    return "Trainer: " + ", ".join(parts) + (f" ({plain(notice)})" if isinstance(notice, str) and notice else "")


def refused_parts(extra: dict[str, Any]) -> list[str]:
    """``["N bucket objects refused (last: ...)"]`` from a role's metrics, or nothing: also when the claimed
    ``total`` is not the sum of its ``by_kind`` counts (:meth:`~rlsync.spaces.exchange.Refusals.as_dict`)."""
    refused = extra.get("refused")
    if not isinstance(refused, dict) or not isinstance(refused.get("by_kind"), dict):
        return []
    counts, total = list(refused["by_kind"].values()), refused.get("total")
    if not all(type(c) is int and c >= 0 for c in counts) or type(total) is not int or not 0 < total == sum(counts):
        return []
    last = refused.get("last") if isinstance(refused.get("last"), str) else ""
    return [f"**{int(refused['total'])} bucket objects refused** (last: {plain(last[:120])})"]


def env_summary(snap: Snapshot) -> str:
    """One line: environment, tasks/s, scores/s, samples scored, newest mean reward."""
    extra = snap.env_extra
    if not extra:
        return "Environment: no figures yet."
    parts = [f"**{plain(extra.get('env', '?'))}**"]
    for key, label in (("tasks_per_s", "tasks/s"), ("scores_per_s", "scores/s")):
        if as_number(extra.get(key)) is not None:
            parts.append(f"{extra[key]:.1f} {label}")
    if "scored" in extra:
        parts.append(f"{extra['scored']} samples scored")
    failures = extra.get("failures")
    if isinstance(failures, dict) and failures:
        parts.append(f"{sum(_count(v) or 0 for v in failures.values())} scoring failures")
    rewards = reward_frame(snap)
    env_rewards = rewards[rewards["source"] == "env"]
    if len(env_rewards):
        last = env_rewards.iloc[-1]
        parts.append(f"mean reward {last['mean_reward']:.3f} at version {last['version']}")
    parts += refused_parts(extra)
    return "Environment: " + ", ".join(parts)


#: Staleness values drawn in the histogram (versions behind when trained).
MAX_STALENESS_BARS = 64


def staleness_frame(snap: Snapshot) -> pd.DataFrame:
    """Samples TRL took in time, by staleness (``metrics/trainer.json`` -> ``flow.staleness``)."""
    flow = snap.trainer_extra.get("flow")
    histogram = flow.get("staleness") if isinstance(flow, dict) else None
    rows = [{"staleness": int(k), "samples": _count(v)} for k, v in (histogram.items() if isinstance(histogram, dict) else ())
            if isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < MAX_STALENESS_BARS and _count(v) is not None]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["staleness", "samples"]).sort_values("staleness")
    return frame.astype({"staleness": "int64", "samples": "int64"})


def flow_summary(snap: Snapshot) -> str:
    """One line: the share of scored samples trained on, the trainer's waiting, and what was dropped."""
    flow = snap.trainer_extra.get("flow")
    if not isinstance(flow, dict):
        return "Flow: no figures yet."
    trained, scored = _count(flow.get("trained")), _count(snap.env_extra.get("scored"))
    parts = [f"pacing {flow['pacing']}"] if flow.get("pacing") in ("queue", "demand") else []
    if trained is not None and scored:
        parts.append(f"**{100 * trained / scored:.0f}%** of {scored} scored samples trained on ({trained})")
    wait, share, last = (as_number(flow.get(k)) for k in ("wait_s_total", "wait_share", "wait_s_last"))
    if wait is not None and share is not None:
        parts.append(f"trainer waited **{wait:.0f} s** ({100 * share:.0f}% of its wall time)")
    if last is not None:
        parts.append(f"{last:.2f} s before the last step")
    counts = [(flow.get("dropped_stale"), "dropped stale"), (flow.get("expired_unread"), "expired unread"),
              (flow.get("dropped_degenerate"), "in degenerate groups"), (snap.env_extra.get("cancelled_stale"), "cancelled stale")]  # fmt: skip
    parts += [f"{_count(n)} {label}" for n, label in counts if _count(n)]
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
    served = [f"{plain(st.get('replica_id', '?'))} serves {plain(st['adapter_step'])}" for st in snap.statuses
              if type(st.get("adapter_step")) is int]  # fmt: skip
    return ", ".join(parts) + ("; " + ", ".join(served) if served else "")


def hub_requests_summary(snap: Snapshot) -> str:
    """"Hub requests, last 5 min: X of Y (tier)" per role and for the whole run, with each role's
    pacing notice ('' when no role runs on the Hub)."""
    from .exchange import parse_hub

    roles = [("trainer", parse_hub(snap.trainer_extra.get("hub"))), ("env", parse_hub(snap.env_extra.get("hub")))]
    roles += [(str(st.get("replica_id", "?")), st.get("hub")) for st in snap.statuses]
    roles = [(name, hub) for name, hub in roles if hub]
    if not roles:
        return ""
    tier, window = roles[0][1]["tier"], roles[0][1].get("window_s", 300)
    minutes = f"{window / 60:g} min"
    total_api = sum(int(h.get("api", 0)) for _, h in roles)
    total_res = sum(int(h.get("resolver", 0)) for _, h in roles)
    lines = [
        f"**Hub requests, last {minutes}: {total_api} of {roles[0][1].get('api_limit', '?')} API, "
        f"{total_res} of {roles[0][1].get('resolver_limit', '?')} resolver ({tier} tier, whole run)**"
    ]
    for name, hub in roles:
        share = hub.get("share") or 1
        line = (f"{name}: {int(hub.get('api', 0))} of {int(hub.get('api_limit', 0) / share)} API, "
                f"{int(hub.get('resolver', 0))} resolver ({hub['tier']}, 1/{share:g} share)")  # fmt: skip
        if hub.get("throttled"):
            line += f", {int(hub['throttled'])} answered 429"
        if hub.get("pacing"):
            line += f"; {hub['pacing']}"
        lines.append(line)
    return "  \n".join(lines)
