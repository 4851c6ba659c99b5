"""The side-by-side report of ``python -m benchmarks.compare``: per-side summaries, the ratios, and
the Markdown. Pure functions of the run's records (no audio, no network), so they are unit-tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .report import percentile

__all__ = ["SIDES", "ratio", "summarize_side", "to_markdown"]

SIDES = ("vocable", "pipecat")
"""The two servers, in the order they run in each round."""

LABELS = {"vocable": "Vocable", "pipecat": "pipecat"}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def summarize_side(sessions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles and counts over every session (round) of one side.

    A question turn counts as failed unless the caller heard an answer start after its last
    voiced sample and end (``ok``); barge-ins likewise. CPU is the whole server's (its process
    group's) CPU time over the sessions' wall time, in % of one core; RSS the highest sample.
    """
    turns = [t for s in sessions for t in s["turns"]]
    barges = [b for s in sessions for b in s["barge_ins"]]
    answered = [t for t in turns if t.get("ok")]
    v2v = [t["v2v_ms"] for t in answered]
    silence = [b["silence_ms"] for b in barges if b.get("ok")]
    cpu_s = sum(s["usage"]["cpu_s"] for s in sessions)
    wall_s = sum(s["usage"]["wall_s"] for s in sessions)
    requests = [t["llm_requests"] for t in answered if t.get("llm_requests") is not None]
    firsts = [
        w.get("v2v_ms") if w.get("ok") else None for s in sessions for w in s.get("warmups", [])
    ]
    return {
        "warmup_v2v_ms": firsts,
        "turns": len(turns),
        "failed_turns": len(turns) - len(answered),
        "v2v_ms": {
            "n": len(v2v),
            "p50": percentile(v2v, 50),
            "p95": percentile(v2v, 95),
            "min": min(v2v) if v2v else None,
            "max": max(v2v) if v2v else None,
        },
        "barge_ins": len(barges),
        "failed_barge_ins": len(barges) - len(silence),
        "barge_in_silence_ms": {
            "n": len(silence),
            "p50": percentile(silence, 50),
            "p95": percentile(silence, 95),
        },
        "cpu_percent": _round(cpu_s / wall_s * 100) if wall_s > 0 else None,
        "rss_mb_peak": max((s["usage"]["rss_mb_peak"] for s in sessions), default=None),
        "rss_mb_ready": max((s["usage"]["rss_mb_ready"] for s in sessions), default=None),
        "llm_requests_per_turn": _round(sum(requests) / len(requests), 2) if requests else None,
    }


def ratio(pipecat: float | None, vocable: float | None) -> float | None:
    """pipecat's figure over Vocable's (above 1: pipecat is slower / uses more); None when a
    side has no figure or Vocable's is 0."""
    if pipecat is None or vocable is None or vocable == 0:
        return None
    return round(pipecat / vocable, 2)


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    vocable, pipecat = summary["vocable"], summary["pipecat"]
    return {
        "v2v_p50": ratio(pipecat["v2v_ms"]["p50"], vocable["v2v_ms"]["p50"]),
        "v2v_p95": ratio(pipecat["v2v_ms"]["p95"], vocable["v2v_ms"]["p95"]),
        "barge_in_p50": ratio(
            pipecat["barge_in_silence_ms"]["p50"], vocable["barge_in_silence_ms"]["p50"]
        ),
        "barge_in_p95": ratio(
            pipecat["barge_in_silence_ms"]["p95"], vocable["barge_in_silence_ms"]["p95"]
        ),
        "cpu": ratio(pipecat["cpu_percent"], vocable["cpu_percent"]),
        "rss_peak": ratio(pipecat["rss_mb_peak"], vocable["rss_mb_peak"]),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def summary_table(summary: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table (also the README's)."""
    v, p = summary["vocable"], summary["pipecat"]
    r = ratios(summary)
    rows = [
        ("voice-to-voice p50", _ms(v["v2v_ms"]["p50"]), _ms(p["v2v_ms"]["p50"]), _x(r["v2v_p50"])),
        ("voice-to-voice p95", _ms(v["v2v_ms"]["p95"]), _ms(p["v2v_ms"]["p95"]), _x(r["v2v_p95"])),
        (
            "first turn of the call (warm-up, not in the percentiles)",
            _list_ms(v["warmup_v2v_ms"]),
            _list_ms(p["warmup_v2v_ms"]),
            "",
        ),
        (
            "failed turns",
            f"{v['failed_turns']} of {v['turns']}",
            f"{p['failed_turns']} of {p['turns']}",
            "",
        ),
        (
            "barge-in to silence p50",
            _ms(v["barge_in_silence_ms"]["p50"]),
            _ms(p["barge_in_silence_ms"]["p50"]),
            _x(r["barge_in_p50"]),
        ),
        (
            "barge-in to silence p95",
            _ms(v["barge_in_silence_ms"]["p95"]),
            _ms(p["barge_in_silence_ms"]["p95"]),
            _x(r["barge_in_p95"]),
        ),
        (
            "failed barge-ins",
            f"{v['failed_barge_ins']} of {v['barge_ins']}",
            f"{p['failed_barge_ins']} of {p['barge_ins']}",
            "",
        ),
        (
            "server CPU during the call (% of one core)",
            _num(v["cpu_percent"], " %"),
            _num(p["cpu_percent"], " %"),
            _x(r["cpu"]),
        ),
        (
            "server RSS, peak",
            _num(v["rss_mb_peak"], " MB"),
            _num(p["rss_mb_peak"], " MB"),
            _x(r["rss_peak"]),
        ),
        (
            "LLM requests per answered turn",
            _num_or_dash(v["llm_requests_per_turn"]),
            _num_or_dash(p["llm_requests_per_turn"]),
            "",
        ),
    ]
    lines = [
        "| | Vocable | pipecat | pipecat / Vocable |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
    ]
    return "\n".join(lines)


def _list_ms(values: Sequence[float | None]) -> str:
    return ", ".join("failed" if v is None else _ms(v) for v in values) or "-"


def _num_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _turn_rows(side: str, sessions: Sequence[dict[str, Any]]) -> list[str]:
    rows = []
    for n, session in enumerate(sessions, 1):
        for turn in [*session.get("warmups", []), *session["turns"]]:
            heard = turn.get("transcript") or ""
            result = _ms(turn["v2v_ms"]) if turn.get("ok") else f"failed: {turn.get('error')}"
            kind = "warm-up" if turn["kind"] == "warmup" else "question"
            rows.append(
                f"| {LABELS[side]} | {n} | {kind} | {turn['utterance']} | {result} | {heard} |"
            )
        for barge in session["barge_ins"]:
            result = (
                f"silent after {_ms(barge['silence_ms'])}"
                if barge.get("ok")
                else f"failed: {barge.get('error')}"
            )
            rows.append(f"| {LABELS[side]} | {n} | barge-in | {barge['utterance']} | {result} | |")
    return rows


def to_markdown(run: dict[str, Any]) -> str:
    summary = run["summary"]
    settings = run["settings"]
    lines = [
        "# Vocable and pipecat side by side",
        "",
        f"Command: `{run['command']}`  ",
        f"Started: {run['started_at']}, commit {run['git_commit']}  ",
        f"Machine: {run['machine']['cpu']}, {run['machine']['cores']} cores, "
        f"Python {run['machine']['python']}  ",
        f"Versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}",
        "",
        f"Each side: {settings['rounds']} round(s) of one WebRTC call (aiortc caller), "
        f"{settings.get('warmups', 0)} warm-up question(s), {settings['questions']} questions "
        f"then {settings['barge_ins']} barge-ins, the sides "
        f"back to back in the order {', '.join(settings['order'])}; LLM: {settings['llm']}; "
        f"Whisper `{settings['whisper_model']}`, Piper `{settings['piper_voice']}`.",
        "",
        "Measured at the caller from audio alone, the same way for both: voice-to-voice = the "
        "caller's last voiced sample leaving -> the agent's first audible sample arriving; "
        "barge-in = the interruption's first voiced sample leaving -> the agent silent "
        "(300 ms held). A turn fails if no answer is heard, or if the agent was already "
        "audible while the caller spoke (answered before the end of the question).",
        "",
        summary_table(summary),
        "",
        "## Configuration",
        "",
        *(f"- {LABELS[side]}: {run['configuration'][side]}" for side in SIDES),
        "",
        "## Every turn",
        "",
        "| server | round | kind | utterance | result | transcript the LLM got |",
        "|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        lines += _turn_rows(side, run["sides"][side])
    return "\n".join(lines) + "\n"
