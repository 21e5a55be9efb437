"""The soak summary: totals by trial kind, and the table printed at the end."""

from __future__ import annotations

import collections
from typing import Any

from .invariants import TrialResult


def summarize(results: list[TrialResult]) -> dict[str, Any]:
    """Totals by kind: trials, faults injected by name, states lost, invariant checks and violations."""
    out: dict[str, Any] = {"kinds": {}, "trials": len(results), "lost": 0, "violations": 0, "checks": 0}
    for r in results:
        k = out["kinds"].setdefault(
            r.kind,
            {
                "trials": 0,
                "faults": collections.Counter(),
                "notes": collections.Counter(),
                "lost": 0,
                "violations": [],
                "checks": 0,
                "seconds": 0.0,
            },
        )
        k["trials"] += 1
        k["faults"].update(r.faults)
        k["notes"].update(r.notes)
        k["lost"] += r.lost
        k["violations"] += r.violations
        k["checks"] += r.checks
        k["seconds"] += r.seconds
        out["lost"] += r.lost
        out["violations"] += len(r.violations)
        out["checks"] += r.checks
    for k in out["kinds"].values():
        k["faults"] = dict(sorted(k["faults"].items()))
        k["notes"] = dict(sorted(k["notes"].items()))
    return out


def format_table(summary: dict[str, Any], wall_s: float) -> str:
    lines = [f"{'kind':<16} {'trials':>6} {'faults':>7} {'lost':>5} {'violations':>10} {'checks':>7} {'s/trial':>8}"]
    for kind, k in summary["kinds"].items():
        lines.append(
            f"{kind:<16} {k['trials']:>6} {sum(k['faults'].values()):>7} {k['lost']:>5} {len(k['violations']):>10} "
            f"{k['checks']:>7} {k['seconds'] / max(k['trials'], 1):>8.2f}"
        )
    lines.append(f"{'total':<16} {summary['trials']:>6} {sum(sum(k['faults'].values()) for k in summary['kinds'].values()):>7} "
                 f"{summary['lost']:>5} {summary['violations']:>10} {summary['checks']:>7}   wall {wall_s:.0f}s")  # fmt: skip
    lines.append("")
    lines.append("faults injected, by kind:")
    for kind, k in summary["kinds"].items():
        for name, n in k["faults"].items():
            lines.append(f"  {kind:<16} {name:<48} {n:>6}")
    notes = [(kind, name, n) for kind, k in summary["kinds"].items() for name, n in k["notes"].items()]
    if notes:
        lines.append("")
        lines.append("observed (not faults, not violations):")
        lines += [f"  {kind:<16} {name:<48} {n:>6}" for kind, name, n in notes]
    violations = [(kind, v) for kind, k in summary["kinds"].items() for v in k["violations"]]
    if violations:
        lines.append("")
        lines.append("violations:")
        lines += [f"  {kind}: {v.splitlines()[0][:300]}" for kind, v in violations[:50]]
    return "\n".join(lines)
