"""The harness's ``--corpus hesitation``: one call says every line of the hesitation corpus.

Per line it records a **cut-in** (agent audio that starts before the caller's last voiced frame
was sent: inside the inserted pause, or inside a comma pause), voice-to-voice from the caller's
last voiced frame to the first audible agent frame after it, the LLM requests the line cost
(streamed answers; more than one is a request wasted on part of the line) and why each of its
turns ended (``speech_end``'s ``reason`` and ``turn_score``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import ScriptedLLM

from .hesitation import HesitantLine
from .scenarios import TURN_TIMEOUT_S, Record

__all__ = ["hesitant_line", "hesitation_markdown", "summarize_hesitation"]

SETTLE_S = 1.5
"""After the answer ends, how long nothing more may happen before the line is over."""
GOAL_PAUSE_MS = 1200
"""The goal counts cut-ins at pauses up to this long."""


async def hesitant_line(
    caller: WebRTCCaller, line: HesitantLine, llm: ScriptedLLM | None
) -> Record:
    record: Record = {"line": line.id, "kind": line.kind, "pause_ms": line.pause_ms}
    events_before = len(caller.events)
    requests_before = _answers_asked(llm)
    answers_before = len(caller.of_type("tts_end"))
    spoken = caller.say(line.pcm())
    try:
        first_voiced = await spoken.first_voiced_sent_at()
        last_voiced = await spoken.last_voiced_sent_at()
        await asyncio.sleep(max(0.0, last_voiced - time.monotonic()))
        await caller.wait_for("tts_end", answers_before + 1, TURN_TIMEOUT_S)
        await _settled(caller)
    except TimeoutError:
        return {**record, "ok": False, "error": "no answer in time"}
    early = caller.first_sound_frame_after(first_voiced)
    cut_in = early is not None and early.at < last_voiced
    after = caller.first_sound_frame_after(last_voiced)
    events = caller.events[events_before:]
    ends = [e for e in events if e["type"] == "speech_end"]
    return {
        **record,
        "ok": True,
        "cut_in": cut_in,
        "cut_in_at_ms": round((early.at - first_voiced) * 1000) if cut_in and early else None,
        "v2v_ms": round((after.at - last_voiced) * 1000, 1) if after is not None else None,
        "llm_requests": None if llm is None else _answers_asked(llm) - requests_before,
        "turns": len(ends),
        "interrupted": sum(e["type"] == "interrupted" for e in events),
        "reasons": [e.get("reason") for e in ends],
        "scores": [e.get("turn_score") for e in ends],
        "transcripts": [e["text"] for e in events if e["type"] == "transcript"],
    }


async def _settled(caller: WebRTCCaller) -> None:
    """Wait until no event has come for ``SETTLE_S`` (a cut-in's answer and the next one)."""
    while True:
        count = len(caller.events)
        await asyncio.sleep(SETTLE_S)
        if len(caller.events) == count and caller.pc.connectionState == "connected":
            return


def _answers_asked(llm: ScriptedLLM | None) -> int:
    return 0 if llm is None else sum(bool(r.get("stream")) for r in llm.requests)


def summarize_hesitation(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    paused = [r for r in ok if r["kind"] != "comma"]
    in_goal = [r for r in paused if r["pause_ms"] <= GOAL_PAUSE_MS]
    commas = [r for r in ok if r["kind"] == "comma"]
    v2v = sorted(r["v2v_ms"] for r in paused if r["v2v_ms"] is not None and not r["cut_in"])
    comma_v2v = sorted(r["v2v_ms"] for r in commas if r["v2v_ms"] is not None)
    by_kind = {
        kind: _percentile(
            sorted(r["v2v_ms"] for r in ok if r["kind"] == kind and r["v2v_ms"] is not None), 50
        )
        for kind in dict.fromkeys(r["kind"] for r in ok)
    }
    reasons: dict[str, int] = {}
    for r in ok:
        for reason in r["reasons"]:
            reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    return {
        "lines": len(records),
        "failed": len(records) - len(ok),
        "paused_lines": len(paused),
        "cut_ins": sum(r["cut_in"] for r in paused),
        "cut_ins_within_goal": sum(r["cut_in"] for r in in_goal),
        "lines_within_goal": len(in_goal),
        "cut_in_lines": sorted({r["line"] for r in paused if r["cut_in"]}),
        "v2v_p50_ms": _percentile(v2v, 50),
        "v2v_p95_ms": _percentile(v2v, 95),
        "comma_questions": len(commas),
        "comma_llm_requests": sum(r["llm_requests"] or 0 for r in commas),
        "comma_wasted_requests": sum(max(0, (r["llm_requests"] or 0) - 1) for r in commas),
        "comma_v2v_p50_ms": _percentile(comma_v2v, 50),
        "end_reasons": reasons,
        "v2v_p50_ms_by_kind": by_kind,
    }


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


def hesitation_markdown(run: dict[str, Any]) -> str:
    s = run["summary"]
    lines = [
        "# Vocable: the hesitation corpus",
        "",
        f"`{run['command']}` at {run['git_commit']}, {run['started_at']}",
        f"on {run['machine'].get('cpu', '?')}; settings: `{run['settings']}`",
        "",
        "| measure | value |",
        "|---|---|",
        f"| cut-ins, pauses <= {GOAL_PAUSE_MS} ms | {s['cut_ins_within_goal']} of "
        f"{s['lines_within_goal']} line runs |",
        f"| cut-ins, all paused lines | {s['cut_ins']} of {s['paused_lines']} "
        f"({', '.join(s['cut_in_lines']) or 'none'}) |",
        f"| voice-to-voice after the whole line (no cut-in), p50 / p95 | {s['v2v_p50_ms']} / "
        f"{s['v2v_p95_ms']} ms |",
        f"| comma-opened questions: LLM requests / wasted | {s['comma_llm_requests']} / "
        f"{s['comma_wasted_requests']} for {s['comma_questions']} questions |",
        f"| comma-opened questions, voice-to-voice p50 | {s['comma_v2v_p50_ms']} ms |",
        f"| voice-to-voice p50 by kind of line (ms) | {s.get('v2v_p50_ms_by_kind')} |",
        f"| why turns ended | {s['end_reasons']} |",
        f"| failed runs | {s['failed']} |",
        "",
        "| line | kind | pause | cut-in | v2v ms | LLM requests | turns | reasons | scores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in run["lines"]:
        if not r.get("ok"):
            lines.append(f"| {r['line']} | {r['kind']} | {r['pause_ms']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['line']} | {r['kind']} | {r['pause_ms']} | {'**yes**' if r['cut_in'] else 'no'}"
            f" | {r['v2v_ms']} | {r['llm_requests']} | {r['turns']} | {r['reasons']} | "
            f"{r['scores']} |"
        )
    return "\n".join(lines) + "\n"
