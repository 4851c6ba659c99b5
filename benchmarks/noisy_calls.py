"""The harness's ``--corpus noisy``: one call asks the corpus's questions over background noise,
and makes noise alone while the agent gives a long answer.

Noise kinds (``server.testkit.impairments``): babble (four other voices), street, car; each at
5, 10 and 20 dB below the caller's speech level. Per kind and level, with the noise running
from ``LEAD_MS`` before the question to ``TAIL_MS`` after it:

- **word error rate** of what the server transcribed against the question's text, and a
  **lost turn** when the question got no answer;
- a **false barge-in** when noise alone, ``NOISE_ALONE_MS`` of it over a long answer, cut the
  agent off (``interrupted``); a ``paused`` agent that resumed by itself is counted apart;
- **barge-in** over the noise: the caller talks over the long answer, the noise running from
  ``LEAD_MS`` before the words; from the words' first voiced frame leaving (the noise before it
  aside) to the agent heard silent, and whether the agent was cut off.

A clean pass of the same questions first gives the clean word error rate, and lets the server
learn the caller's own level, as a real call's first turn does.
"""

from __future__ import annotations

import asyncio
import statistics
import zlib
from typing import Any

from server.call.endpointing import edit_distance
from server.testkit.caller import WebRTCCaller, voiced_span_ms
from server.testkit.impairments import (
    NOISE_KINDS,
    NoiseKind,
    at_level,
    mix_at_snr,
    noise,
    speech_level_dbfs,
)

from .corpus import Utterance
from .scenarios import TURN_TIMEOUT_S, Record, agent_speaking

__all__ = [
    "SNRS_DB",
    "noise_alone",
    "noisy_markdown",
    "noisy_question",
    "speech_level",
    "summarize_noisy",
    "talked_over",
    "word_error_rate",
    "word_errors",
    "words_of",
]

SNRS_DB = (20, 10, 5)
LEAD_MS = 600
TAIL_MS = 600
NOISE_ALONE_MS = 2500


def speech_level(questions: list[Utterance]) -> float:
    """The caller's speech level (dBFS, the questions' mean) that noise levels are set against."""
    return statistics.fmean(speech_level_dbfs(q.pcm()) for q in questions)


async def noisy_question(
    caller: WebRTCCaller, question: Utterance, kind: NoiseKind | None, snr_db: float | None
) -> Record:
    """Ask ``question`` (over ``kind`` noise at ``snr_db``; None: clean) and wait for the
    answer; the transcript's word error rate."""
    record: Record = {"test": "question", "noise": kind, "snr_db": snr_db, "line": question.id}
    pcm = question.pcm()
    if kind is not None and snr_db is not None:
        length_ms = LEAD_MS + len(pcm) // 32 + TAIL_MS
        background = noise(kind, length_ms, seed=zlib.crc32(question.id.encode()))
        pcm = mix_at_snr(pcm, background, snr_db, lead_ms=LEAD_MS)
    answers = len(caller.of_type("tts_end"))
    transcripts = len(caller.of_type("transcript"))
    caller.say(pcm)
    try:
        await caller.wait_for("tts_end", answers + 1, TURN_TIMEOUT_S)
    except TimeoutError:
        return {**record, "lost": True}
    await asyncio.sleep(1.0)  # a second answer (the noise taken for a turn) shows here
    heard = " ".join(e["text"] for e in caller.of_type("transcript")[transcripts:])
    return {
        **record,
        "lost": False,
        "heard": heard,
        "wer": word_error_rate(question.text, heard),
        "turns": len(caller.of_type("transcript")) - transcripts,
    }


async def noise_alone(
    caller: WebRTCCaller, ask: Utterance, kind: NoiseKind, snr_db: float, speech_dbfs: float
) -> Record:
    """Ask for a long answer, then make ``kind`` noise alone over it at ``snr_db`` below the
    caller's speech level (``speech_dbfs``): was the agent cut off?"""
    record: Record = {"test": "noise_alone", "noise": kind, "snr_db": snr_db}
    interrupted = len(caller.of_type("interrupted"))
    paused = len(caller.of_type("paused"))
    answers = len(caller.of_type("tts_end"))
    if await agent_speaking(caller, ask) is None:
        return {**record, "ok": False, "error": "the agent never started its long answer"}
    await asyncio.sleep(1.0)
    sound = noise(kind, NOISE_ALONE_MS, seed=int(snr_db))
    caller.say(at_level(sound, speech_dbfs - snr_db))
    await asyncio.sleep(NOISE_ALONE_MS / 1000 + 1.5)
    cut = len(caller.of_type("interrupted")) > interrupted
    try:  # the long answer, cut or whole (noise taken for words may get an answer of its own)
        await caller.wait_for("tts_end", answers + 1, TURN_TIMEOUT_S * 2)
        await asyncio.sleep(2.0)
    except TimeoutError:
        return {**record, "ok": False, "false_barge_in": cut, "error": "the call got stuck"}
    return {
        **record,
        "ok": True,
        "false_barge_in": cut,
        "paused": len(caller.of_type("paused")) - paused,
    }


async def talked_over(
    caller: WebRTCCaller, ask: Utterance, interrupt: Utterance, kind: NoiseKind, snr_db: float
) -> Record:
    """Ask for a long answer, then say ``interrupt`` over it with ``kind`` noise at ``snr_db``:
    the barge-in's time to the agent's silence, from the words' first voiced frame leaving."""
    record: Record = {"test": "barge_in", "noise": kind, "snr_db": snr_db}
    interrupted = len(caller.of_type("interrupted"))
    answers = len(caller.of_type("tts_end"))
    if await agent_speaking(caller, ask) is None:
        return {**record, "ok": False, "error": "the agent never started its long answer"}
    await asyncio.sleep(1.0)
    pcm = interrupt.pcm()
    words_at_ms = LEAD_MS + voiced_span_ms(pcm)[0]
    background = noise(kind, LEAD_MS + len(pcm) // 32 + TAIL_MS, seed=int(snr_db) + 1)
    spoken = caller.say(mix_at_snr(pcm, background, snr_db, lead_ms=LEAD_MS))
    sent_at = await spoken.first_voiced_sent_at() - spoken.first_voiced_ms / 1000
    words_at = sent_at + words_at_ms / 1000
    await asyncio.sleep(words_at_ms / 1000 + 2.0)
    silent_at = caller.silent_from(words_at)
    cut = len(caller.of_type("interrupted")) > interrupted
    try:  # the cut answer's end, then the interruption's answer
        await caller.wait_for("tts_end", answers + 2, TURN_TIMEOUT_S * 2)
        await asyncio.sleep(1.0)
    except TimeoutError:
        return {**record, "ok": False, "cut": cut, "error": "the interruption got no answer"}
    return {
        **record,
        "ok": True,
        "cut": cut,
        "barge_in_ms": round((silent_at - words_at) * 1000, 1) if cut and silent_at else None,
    }


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's length (words lowercased, no punctuation)."""
    return word_errors(reference, hypothesis) / max(1, len(words_of(reference)))


def word_errors(reference: str, hypothesis: str) -> int:
    """Word-level edit distance: substitutions, insertions and deletions (as :func:`words_of`
    reads the words)."""
    return edit_distance(words_of(reference), words_of(hypothesis))


_CONTRACTIONS = {
    "'s": " is", "'m": " am", "'re": " are", "'ll": " will", "'ve": " have", "'d": " would",
    "n't": " not",
}  # fmt: skip


def words_of(text: str) -> list[str]:
    """Lowercase words, punctuation gone, contractions spelled out ("where's": "where is"), so
    that a transcript is not marked wrong for writing what was said another way."""
    text = text.lower().replace("can't", "can not").replace("won't", "will not")
    for short, long in _CONTRACTIONS.items():
        text = text.replace(short, long)
    return "".join(c if c.isalnum() or c == "'" else " " for c in text).split()


def summarize_noisy(records: list[Record]) -> dict[str, Any]:
    rows = []
    for kind in (None, *NOISE_KINDS):
        for snr in (None,) if kind is None else SNRS_DB:
            asked = [r for r in records if r["test"] == "question" and r["noise"] == kind]
            asked = [r for r in asked if r["snr_db"] == snr]
            alone = [r for r in records if r["test"] == "noise_alone" and r["noise"] == kind]
            alone = [r for r in alone if r["snr_db"] == snr and "false_barge_in" in r]
            heard = [r["wer"] for r in asked if not r["lost"]]
            talked = [r for r in records if r["test"] == "barge_in" and r["noise"] == kind]
            talked = [r for r in talked if r["snr_db"] == snr]
            rows.append(
                {
                    "noise": kind or "clean",
                    "snr_db": snr,
                    "questions": len(asked),
                    "lost": sum(r["lost"] for r in asked),
                    "wer": round(statistics.fmean(heard) * 100, 1) if heard else None,
                    "extra_turns": sum(max(0, r.get("turns", 1) - 1) for r in asked),
                    "noise_alone": len(alone),
                    "false_barge_ins": sum(r["false_barge_in"] for r in alone),
                    "paused": sum(r.get("paused", 0) for r in alone),
                    "barge_ins": len(talked),
                    "barge_ins_detected": sum(r.get("barge_in_ms") is not None for r in talked),
                    "barge_in_ms": [r["barge_in_ms"] for r in talked if r.get("barge_in_ms")],
                }
            )
    measured = sorted(ms for row in rows if (row["snr_db"] or 0) >= 10 for ms in row["barge_in_ms"])
    return {
        "rows": rows,
        "barge_in_10db_and_above": {
            "n": len(measured),
            "p50_ms": statistics.median(measured) if measured else None,
            "max_ms": max(measured) if measured else None,
        },
    }


def noisy_markdown(run: dict[str, Any]) -> str:
    lines = [
        "# Vocable: the noisy corpus",
        "",
        f"`{run['command']}` at {run['git_commit']}, {run['started_at']}",
        f"on {run['machine'].get('cpu', '?')}; settings: `{run['settings']}`",
        "",
        "| noise | SNR dB | questions | lost | WER % | extra turns | noise alone | false "
        "barge-ins | paused (resumed) | barge-ins over it: detected | to silence ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in run["summary"]["rows"]:
        talked = f"{row.get('barge_ins_detected', 0)} of {row.get('barge_ins', 0)}"
        lines.append(
            f"| {row['noise']} | {row['snr_db'] or ''} | {row['questions']} | {row['lost']} | "
            f"{row['wer']} | {row['extra_turns']} | {row['noise_alone']} | "
            f"{row['false_barge_ins']} | {row['paused']} | {talked} | "
            f"{row.get('barge_in_ms', [])} |"
        )
    above = run["summary"].get("barge_in_10db_and_above")
    if above:
        lines += [
            "",
            f"Barge-in over noise at 10 and 20 dB: {above['n']} measured, p50 "
            f"{above['p50_ms']} ms, max {above['max_ms']} ms.",
        ]
    return "\n".join(lines) + "\n"
