"""The side by side's impaired corpora (``python -m benchmarks.compare --corpus noisy|echo``):
what noise and echo do to an agent's long answer, judged from the caller's audio alone, so that
Vocable and pipecat are measured by the same rule.

Each side first gives the long answer on a clean line: its **voiced length** (the agent's
audible frames from its first to the quiet that ends it) is the reference. Then:

- **noisy**: on the same call, noise alone (babble, street, car; ``server.testkit.impairments``)
  at 20 and 10 dB below the caller's speech level, ``NOISE_MS`` of it starting 1 s into the long
  answer;
- **echo**: one call per echo path of ``benchmarks.echo_calls.ECHO_PATHS`` (40-250 ms, 6-20 dB
  return loss), the caller's phone returning what it receives (``server.testkit.echo_path``),
  and nobody talking.

An answer counts as **cut** when its voiced length falls below ``CUT_FRACTION`` of the clean
one: the agent stopped for good (an agent that pauses and resumes loses nothing). The LLM
requests made from the question to the quiet say whether the sound was **taken as a turn** (more
than the answer's own request).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

from server.testkit.caller import SILENCE_DBFS, WebRTCCaller
from server.testkit.echo_path import ReturnedEcho
from server.testkit.impairments import NOISE_KINDS, NoiseKind, at_level, noise

from .corpus import Utterance
from .echo_calls import ECHO_PATHS
from .heard import (
    ANSWER_TIMEOUT_S,
    FRAME_S,
    settle,
    streamed_requests,
    wait_first_sound,
    wait_quiet,
)

__all__ = [
    "CUT_FRACTION",
    "IMPAIRED_CORPORA",
    "NOISE_SNRS_DB",
    "VOCABLE_CLEANING",
    "impaired_side",
    "impaired_summary",
    "impaired_table",
    "judge_trial",
]

IMPAIRED_CORPORA = ("noisy", "echo")
NOISE_SNRS_DB = (20, 10)
NOISE_MS = 2500
CUT_FRACTION = 0.8
QUIET_S = 4.0
"""Silence that ends the long answer: longer than a pause while noise plays and is settled."""
VOCABLE_CLEANING = {
    "noisy": ("--noise-suppression", "all"),
    "echo": ("--echo-cancellation", "all"),
}
"""Vocable cleans a WebRTC line as it cleans a phone line for these corpora (browsers clean their
own audio, so WebRTC lines are not cleaned by default); pipecat runs as configured."""

Record = dict[str, Any]


async def impaired_side(
    corpus: str, url: str, llm: Any, ask: Utterance, speech_dbfs: float
) -> Record:
    """One side's run of ``corpus``: the clean reference, then the impaired answers."""
    caller = WebRTCCaller()
    await caller.connect(url)
    try:
        await settle(caller)
        clean = await _long_answer(caller, ask, llm)
        trials: list[Record] = []
        if corpus == "noisy":
            for kind in NOISE_KINDS:
                for snr in NOISE_SNRS_DB:
                    level = speech_dbfs - snr
                    trial = await _long_answer(caller, ask, llm, noise_at=(kind, level))
                    trials.append({"noise": kind, "snr_db": snr, **trial})
    finally:
        await caller.close()
    if corpus == "echo":
        for echo in ECHO_PATHS:
            trial = await _echo_call(url, echo, ask, llm)
            trials.append(
                {"delay_ms": echo.delay_ms, "return_loss_db": echo.return_loss_db, **trial}
            )
    return {"clean": clean, "trials": [judge_trial(t, clean) for t in trials]}


async def _echo_call(url: str, echo: ReturnedEcho, ask: Utterance, llm: Any) -> Record:
    caller = WebRTCCaller(echo=echo)
    await caller.connect(url)
    try:
        await settle(caller)
        return await _long_answer(caller, ask, llm)
    finally:
        await caller.close()


async def _long_answer(
    caller: WebRTCCaller,
    ask: Utterance,
    llm: Any,
    *,
    noise_at: tuple[NoiseKind, float] | None = None,
) -> Record:
    """Ask for the long answer (with ``noise_at``: that noise at that level, alone, 1 s into
    it); its voiced length and the LLM requests made until it ended."""
    requests = len(streamed_requests(llm))
    spoken = caller.say(ask.pcm())
    try:
        last_voiced = await spoken.last_voiced_sent_at()
    except TimeoutError:
        return {"ok": False, "error": "the caller's microphone stalled"}
    first = await wait_first_sound(caller, last_voiced, ANSWER_TIMEOUT_S)
    if first is None:
        return {"ok": False, "error": "no answer heard"}
    if noise_at is not None:
        kind, dbfs = noise_at
        await asyncio.sleep(max(0.0, first + 1.0 - time.monotonic()))
        caller.say(at_level(noise(kind, NOISE_MS, seed=zlib.crc32(kind.encode())), dbfs))
    end = await wait_quiet(caller, first, QUIET_S, 90.0)
    if end is None:
        requests = len(streamed_requests(llm)) - requests
        return {"ok": False, "error": "the agent never fell quiet", "llm_requests": requests}
    voiced = sum(first <= f.at <= end and f.dbfs > SILENCE_DBFS for f in caller.frames)
    return {
        "ok": True,
        "voiced_ms": round(voiced * FRAME_S * 1000),
        "llm_requests": len(streamed_requests(llm)) - requests,
    }


def judge_trial(trial: Record, clean: Record) -> Record:
    """``trial`` judged against the clean answer: cut (below ``CUT_FRACTION`` of its voiced
    length), and taken as a turn (more than one LLM request); a failed one as it is."""
    if not trial.get("ok") or not clean.get("ok"):
        return trial
    return {
        **trial,
        "cut": trial["voiced_ms"] < CUT_FRACTION * clean["voiced_ms"],
        "taken_as_turn": trial["llm_requests"] > 1,
    }


def impaired_summary(corpus: str, sessions: list[Record]) -> Record:
    trials = [t for s in sessions for t in s["trials"]]
    judged = [t for t in trials if "cut" in t]
    summary: Record = {
        "clean_voiced_ms": [s["clean"].get("voiced_ms") for s in sessions],
        "trials": len(trials),
        "failed": len(trials) - len(judged),
        "cut": sum(t["cut"] for t in judged),
        "taken_as_turn": sum(t["taken_as_turn"] for t in judged),
    }
    if corpus == "noisy":
        for snr in NOISE_SNRS_DB:
            at = [t for t in judged if t["snr_db"] == snr]
            summary[f"cut_at_{snr}_db"] = f"{sum(t['cut'] for t in at)} of {len(at)}"
    else:
        worst = [t for t in judged if t["return_loss_db"] <= 6.0]
        summary["cut_at_6_db"] = f"{sum(t['cut'] for t in worst)} of {len(worst)}"
    return summary


def impaired_table(corpus: str, sides: dict[str, Record], runs: dict[str, list[Record]]) -> str:
    names = list(sides)
    title = (
        "Noise alone over a long answer"
        if corpus == "noisy"
        else "A phone returning the agent's voice"
    )
    rows = ["", f"## {title}", "", "| | " + " | ".join(names) + " |", "|---|---|---|"]
    for key in sides[names[0]]:
        rows.append(f"| {key} | " + " | ".join(str(sides[n][key]) for n in names) + " |")
    rows += ["", "| side | trial | voiced ms | cut | LLM requests |", "|---|---|---|---|---|"]
    for name in names:
        for session in runs[name]:
            for t in session["trials"]:
                what = (
                    f"{t['noise']} {t['snr_db']} dB"
                    if corpus == "noisy"
                    else f"{t['delay_ms']} ms, {t['return_loss_db']:g} dB"
                )
                if "cut" not in t:
                    rows.append(f"| {name} | {what} | failed: {t.get('error')} | | |")
                    continue
                rows.append(
                    f"| {name} | {what} | {t['voiced_ms']} | {'yes' if t['cut'] else 'no'} | "
                    f"{t['llm_requests']} |"
                )
    return "\n".join(rows) + "\n"
