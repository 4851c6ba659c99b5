"""The soak test's figures and its ``soak.md``, from the records ``benchmarks.soak`` gathers."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["leftovers", "rss_growth_percent", "rss_slope_mb_per_100", "to_markdown"]

LEFTOVER_COUNTS = ("open_files", "threads", "asyncio_tasks")
_LABELS = {
    "open_files": "open files",
    "threads": "OS threads",
    "asyncio_tasks": "asyncio tasks",
    "python_threads": "Python threads",
}


def rss_growth_percent(baseline: dict[str, Any], final: dict[str, Any]) -> float:
    """How much the resident memory grew from ``baseline`` to ``final`` (``/healthz``'s
    ``process``), in percent of the baseline."""
    return (float(final["rss_mb"]) - float(baseline["rss_mb"])) / float(baseline["rss_mb"]) * 100


def leftovers(baseline: dict[str, Any], final: dict[str, Any]) -> dict[str, int]:
    """Open files, OS threads and asyncio tasks above the baseline (negative: below)."""
    return {name: int(final[name]) - int(baseline[name]) for name in LEFTOVER_COUNTS}


def rss_slope_mb_per_100(samples: Sequence[dict[str, Any]]) -> float | None:
    """The least-squares trend of RSS over the second half of the calls one after another, in MB
    per 100 calls (None with fewer than three samples there): a leak too slow to reach the growth
    goal shows here, while the allocators' one-off growth of the first calls does not."""
    points = [(s["calls"], s["rss_mb"]) for s in samples if s["phase"] == "sequential"]
    points = points[len(points) // 2 :]
    if len(points) < 3:
        return None
    slope, _ = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
    return round(slope * 100, 2)


def to_markdown(run: dict[str, Any]) -> str:
    plan = run["plan"]
    failed = run["failed_calls"]
    lines = [
        "# Soak test",
        "",
        f"`{run['command']}` at commit `{run['git_commit']}`, {run['started_at']}; "
        f"{run['machine']['cpu']}, {run['machine']['cores']} cores, "
        f"Python {run['machine']['python']}.",
        "",
        "**All goals met.**" if not run["misses"] else "**Goals missed:**",
        *[f"- {miss}" for miss in run["misses"]],
        "",
        *_footprint_table(run),
        "",
        *_summary(run, plan),
        *_changes(run["open_files_by_kind"]),
    ]
    if failed:
        lines += ["", "| call | phase | step | error |", "|---:|---|---|---|"]
        lines += [f"| {r['call']} | {r['phase']} | {r['step']} | {r['error']} |" for r in failed]
    return "\n".join(lines) + "\n"


def _footprint_table(run: dict[str, Any]) -> list[str]:
    baseline, final = run["baseline"], run["final"]
    tolerance = run["leftover_tolerance"]
    rows = [
        "| server process | baseline | final | change | goal |",
        "|---|---:|---:|---:|---|",
        f"| RSS (MB) | {baseline['rss_mb']:.1f} | {final['rss_mb']:.1f} "
        f"| {run['rss_growth_percent']:+.1f} % | under +{run['plan']['rss_limit_percent']:g} % |",
    ]
    for name, label in _LABELS.items():
        goal = f"at most +{tolerance[name]}" if name in tolerance else "(not a goal)"
        change = int(final[name]) - int(baseline[name])
        rows.append(f"| {label} | {baseline[name]} | {final[name]} | {change:+d} | {goal} |")
    return rows


def _summary(run: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    calls = run["calls"]
    measured = [c for c in calls if c["phase"] in ("sequential", "concurrent")]
    slope = run["rss_slope_mb_per_100_calls"]
    trend = "n/a" if slope is None else f"{slope:+.2f} MB per 100 calls"
    ways = {how: sum(c["hang_up"] == how for c in calls) for how in ("message", "delete", "drop")}
    rss = ", ".join(f"{s['rss_mb']:.0f}" for s in run["samples"])
    return [
        f"{len(measured)} measured calls ({plan['sequential']} one after another, then "
        f"{plan['rounds']} rounds of {plan['concurrent']} at once; besides them "
        f"{len(calls) - len(measured)} warm-up and cool-down calls): "
        f"{len(run['failed_calls'])} of {len(calls)} failed. "
        f"Baseline to final: {run['wall_s'] / 60:.1f} min; the server settled "
        f"{run['settle_s']:g} s after the last call (no call live, counts still for 3 s).",
        "",
        f"Calls: {sum(c['spoken'] for c in calls)} spoken (VAD + Whisper), "
        f"{sum(not c['spoken'] for c in calls)} typed; hung up by message {ways['message']}, "
        f"by `DELETE /sessions` {ways['delete']}, by dropping the connection {ways['drop']}; "
        f"{sum(c['early'] for c in calls)} while the answer was playing. "
        f"Median call {statistics.median(c['seconds'] for c in calls):.1f} s.",
        "",
        f"RSS trend over the second half of the calls one after another: {trend}; peak RSS "
        f"{run['final']['peak_rss_mb']:.0f} MB. RSS (MB) at each sample: {rss}.",
    ]


def _changes(by_kind: dict[str, dict[str, int]]) -> list[str]:
    """Open files by kind whose numbers differ, baseline to final."""
    before, after = by_kind["baseline"], by_kind["final"]
    changed = [
        f"{kind} {before.get(kind, 0)} -> {after.get(kind, 0)}"
        for kind in sorted(before.keys() | after.keys())
        if before.get(kind, 0) != after.get(kind, 0)
    ]
    if not changed:
        return []
    return ["", f"Open files by kind that changed (read just after): {', '.join(changed)}."]
