"""What the harness asks of calls: question turns, barge-ins, backchannels, a concurrency level.

Every function returns plain JSON-able records; times are in ms; ``None`` means "did not happen".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.testkit.caller import (
    Listener,
    ReceivedFrame,
    SpokenUtterance,
    WebRTCCaller,
    longest_gap_ms,
)

from .corpus import Utterance
from .server_process import ServerProcess

ARRIVAL_S = 4.0
"""How long a level's callers take to arrive by default: about a turn, so that their turns are
spread across one."""

__all__ = [
    "ARRIVAL_S",
    "BenchTarget",
    "agent_speaking",
    "backchannel",
    "barge_in",
    "concurrency_level",
    "playout_split",
    "question_turn",
]

log = logging.getLogger(__name__)

FRAME_MS = 20.0
TURN_TIMEOUT_S = 45.0
Record = dict[str, Any]


@dataclass(frozen=True)
class BenchTarget:
    base_url: str
    playbook: str | None
    end_silence_ms: float
    llm_first_sentence_ms: float | None
    """The scripted LLM's known time to its first sentence; None: use the server's measurement."""
    token: str | None = None
    listener: Listener = "arrival"
    """When the callers count the agent's audio as heard: on arrival, or as a stock client
    plays it (:class:`server.testkit.caller.WebRTCCaller`)."""


BACKCHANNEL_VERDICT_S = 6.0
"""How long after a short sound over an answer the agent may take to stop or resume."""


async def new_caller(target: BenchTarget) -> WebRTCCaller:
    caller = WebRTCCaller(listener=target.listener)
    extra = {"playbook": target.playbook} if target.playbook else {}
    await caller.connect(target.base_url, token=target.token, **extra)
    return caller


async def question_turn(
    caller: WebRTCCaller, utterance: Utterance, target: BenchTarget, **labels: Any
) -> Record:
    """Ask one question and wait for the whole answer; measure voice-to-voice at the client,
    as its listener hears it (with the stock listener, also where that time went: see
    :func:`playout_split`)."""
    record: Record = {"kind": "question", "utterance": utterance.id, **labels}
    answers_before = len(caller.of_type("tts_end"))
    events_before = len(caller.events)
    underruns_before = caller.playout.underruns if caller.playout else 0
    metrics_before = len(caller.of_type("turn_metrics"))
    transcripts_before = len(caller.of_type("transcript"))
    spoken = caller.say(utterance.pcm())
    try:
        last_voiced = await spoken.last_voiced_sent_at()
        await caller.wait_for("tts_end", answers_before + 1, TURN_TIMEOUT_S)
    except TimeoutError:
        state = caller.pc.connectionState
        return {**record, "ok": False, "error": f"no answer in time (connection {state})"}
    first_frame = caller.first_sound_frame_after(last_voiced)
    server = _nth(caller.of_type("turn_metrics"), metrics_before)
    transcript = _nth(caller.of_type("transcript"), transcripts_before)
    if first_frame is None or server is None or transcript is None:
        return {**record, "ok": False, "error": "the answer was not heard or not measured"}
    first_sound = first_frame.at
    dry_ms, dry_after_ms = longest_dry_ms(caller.events[events_before:])
    client_ms = (first_sound - last_voiced) * 1000
    answered = time.monotonic()
    llm_ms = target.llm_first_sentence_ms
    if llm_ms is None:
        llm_ms = (server["llm_first_token_ms"] or 0) + (server["first_sentence_ms"] or 0)
    # the server's own end-of-turn wait and transcript wait (speculative transcription overlaps
    # them), then the LLM's pacing, Piper and one frame: what no transport could beat
    waited_ms = (server["end_of_speech_ms"] or target.end_silence_ms) + (server["stt_ms"] or 0)
    floor = waited_ms + llm_ms + (server["tts_first_audio_ms"] or 0) + FRAME_MS
    return {
        **record,
        "ok": True,
        "transcript": transcript["text"],
        "speculative": bool(transcript.get("speculative")),
        "client_v2v_ms": round(client_ms, 1),
        "longest_pause_ms": longest_gap_ms(caller.frames, first_sound, answered),
        "speaker_dry_ms": dry_ms,
        "speaker_dry_after_ms": dry_after_ms,
        "server": {k: v for k, v in server.items() if k.endswith("_ms")},
        "floor_ms": round(floor, 1),
        "overhead_ms": round(client_ms - floor, 1),
        **playout_split(caller, first_frame, last_voiced, underruns_before),
    }


def longest_dry_ms(events: list[dict[str, Any]]) -> tuple[float, float | None]:
    """The longest time the server's speaker ran dry inside the first answer in ``events``
    (from its first ``speaking`` state to its ``tts_end``): a ``thinking`` state there is audio
    that was not made in time, heard as a stutter; 0 when it never ran dry. With it, how long
    after the answer's first sound that dry spell began (None: none)."""
    longest, began, dry_from, first = 0.0, None, None, None
    for event in events:
        if event["type"] == "tts_end" and first is not None:
            break
        if event["type"] != "state":
            continue
        if event.get("state") == "speaking":
            first = event["t_ms"] if first is None else first
            if dry_from is not None and event["t_ms"] - dry_from > longest:
                longest, began = event["t_ms"] - dry_from, dry_from - first
            dry_from = None
        elif event.get("state") == "thinking" and first is not None:
            dry_from = event["t_ms"]
    return round(longest, 1), None if began is None else round(began, 1)


def playout_split(
    caller: WebRTCCaller, first: ReceivedFrame, last_voiced: float, underruns_before: int
) -> Record:
    """With the stock listener, where the answer's first audible frame spent its time:
    ``received_v2v_ms`` (voice-to-voice had it counted when it came out of aiortc's receiver),
    ``jitter_buffer_ms`` (its packet's arrival -> out of the receiver: aiortc's jitter buffer
    and decoder thread), ``playout_wait_ms`` (out of the receiver -> played) and the playout's
    underruns during the turn. Empty with the arrival listener."""
    if caller.playout is None or first.arrived_at is None:
        return {}
    split: Record = {
        "received_v2v_ms": round((first.arrived_at - last_voiced) * 1000, 1),
        "playout_wait_ms": round((first.at - first.arrived_at) * 1000, 1),
        "playout_underruns": caller.playout.underruns - underruns_before,
    }
    if first.packet_at is not None:
        split["jitter_buffer_ms"] = round((first.arrived_at - first.packet_at) * 1000, 1)
    return split


async def barge_in(
    caller: WebRTCCaller, ask: Utterance, interrupt: Utterance, target: BenchTarget
) -> Record:
    """Ask for a long answer, talk over it, and time how fast the agent falls silent."""
    record: Record = {"kind": "barge_in", "utterance": interrupt.id}
    interrupted_before = len(caller.of_type("interrupted"))
    answers_before = len(caller.of_type("tts_end"))
    events_before = len(caller.events)
    spoken = await _talk_over_long_answer(caller, ask, interrupt)
    if spoken is None:
        return {**record, "ok": False, "error": "the agent never started its long answer"}
    # a real model may answer in one short sentence: nothing left to talk over
    over_already = len(caller.of_type("tts_end")) > answers_before
    try:
        started = await spoken.first_voiced_sent_at()
    except TimeoutError:
        return {**record, "ok": False, "error": "the caller's microphone stalled"}
    await asyncio.sleep(2.0)  # let the silence that follows arrive
    silent_at = caller.silent_from(started)
    cut = len(caller.of_type("interrupted")) > interrupted_before
    try:  # the interruption is itself a question: its answer ends the scenario
        await caller.wait_for("tts_end", answers_before + 2, TURN_TIMEOUT_S)
    except TimeoutError:
        return {**record, "ok": False, "error": "the interrupting question was not answered"}
    if not cut and over_already:
        return {**record, "ok": False, "error": "the answer was over before it was talked over"}
    if silent_at is None or not cut:
        events = [_brief(event) for event in caller.events[events_before:]]
        return {**record, "ok": False, "error": "the agent did not stop talking", "events": events}
    return {**record, "ok": True, "silence_ms": round((silent_at - started) * 1000, 1)}


def _brief(event: dict[str, Any]) -> dict[str, Any]:
    """An event as a failed try's record keeps it: its type and its short fields."""
    short = (str, int, float)
    return {k: v for k, v in event.items() if isinstance(v, short) and len(str(v)) < 200}


async def backchannel(target: BenchTarget, ask: Utterance, noise: Utterance) -> Record:
    """On a call of its own: ask for a long answer, make a short sound over it, and see whether
    the agent was cut, or paused and resumed. The call is hung up once that is known (the
    agent stopped or resumed, or, having not paused, still talks 2 s after the sound) rather
    than left to run out its answer."""
    record: Record = {"kind": "backchannel", "utterance": noise.id}
    caller = await new_caller(target)
    try:
        await asyncio.sleep(0.5)
        if await _talk_over_long_answer(caller, ask, noise) is None:
            return {**record, "ok": False, "error": "the agent never started its long answer"}
        quiet_until = time.monotonic() + 2.0
        deadline = time.monotonic() + BACKCHANNEL_VERDICT_S
        while time.monotonic() < deadline:
            if caller.of_type("interrupted") or caller.of_type("resumed"):
                break
            if not caller.of_type("paused") and time.monotonic() >= quiet_until:
                break
            await asyncio.sleep(0.05)
        false_cut = bool(caller.of_type("interrupted"))
        resumed = bool(caller.of_type("resumed"))
        if caller.of_type("paused") and not (false_cut or resumed):
            return {**record, "ok": False, "false_cut": False, "error": "paused, never resumed"}
        return {**record, "ok": True, "false_cut": false_cut, "resumed": resumed}
    finally:
        await caller.close()


async def _talk_over_long_answer(
    caller: WebRTCCaller, ask: Utterance, sound: Utterance
) -> SpokenUtterance | None:
    """Ask for a long answer, wait until it is well under way, then make ``sound`` over it;
    None if the agent never started answering."""
    if await agent_speaking(caller, ask) is None:
        return None
    await asyncio.sleep(1.2)
    return caller.say(sound.pcm())


async def agent_speaking(caller: WebRTCCaller, ask: Utterance) -> float | None:
    spoken = caller.say(ask.pcm())
    try:
        last_voiced = await spoken.last_voiced_sent_at()
    except TimeoutError:
        return None
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while time.monotonic() < deadline:
        heard = caller.first_sound_after(last_voiced)
        if heard is not None:
            return heard
        await asyncio.sleep(0.05)
    return None


async def concurrency_level(
    target: BenchTarget,
    calls: int,
    turns: int,
    questions: Sequence[Utterance],
    server: ServerProcess | None,
    gap_s: float = 1.0,
    on_turn: Callable[[], None] = lambda: None,
    arrival_s: float = ARRIVAL_S,
) -> Record:
    """``calls`` simultaneous calls, each asking ``turns`` questions; the calls arrive evenly
    spread over ``arrival_s``, which staggers their turns."""
    cycle = itertools.cycle(questions)
    scripts = [[next(cycle) for _ in range(turns)] for _ in range(calls)]
    before = server.sample() if server else None
    rss_peak = before.rss_bytes if before else 0
    started = time.monotonic()

    async def one_call(index: int, script: list[Utterance]) -> list[Record]:
        await asyncio.sleep(index * arrival_s / calls)
        records: list[Record] = []
        try:
            caller = await new_caller(target)
        except Exception as exc:
            log.warning("call %d could not connect: %s", index, exc)
            refused = str(exc).startswith("offer refused: 503")  # the server is at capacity
            return [
                {
                    "kind": "question",
                    "call": index,
                    "turn": n,
                    "ok": False,
                    "refused": refused,
                    "error": str(exc),
                }
                for n in range(len(script))
            ]
        try:
            await asyncio.sleep(0.5)  # media flowing
            for n, utterance in enumerate(script):
                records.append(await question_turn(caller, utterance, target, call=index, turn=n))
                on_turn()
                await asyncio.sleep(gap_s)
        finally:
            await caller.close()
        return records

    async def watch_memory() -> None:
        nonlocal rss_peak
        while server is not None:
            rss_peak = max(rss_peak, server.sample().rss_bytes)
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch_memory())
    try:
        per_call = await asyncio.gather(*(one_call(i, s) for i, s in enumerate(scripts)))
    finally:
        watcher.cancel()
    elapsed = time.monotonic() - started
    after = server.sample() if server else None
    usage: Record = {}
    if before and after:
        usage = {
            "server_cpu_percent": round((after.cpu_s - before.cpu_s) / elapsed * 100, 1),
            "server_rss_mb_peak": round(rss_peak / 2**20, 1),
        }
    return {
        "calls": calls,
        "listener": target.listener,
        "turns": [record for records in per_call for record in records],
        "elapsed_s": round(elapsed, 1),
        **usage,
    }


def _nth(events: list[dict[str, Any]], index: int) -> dict[str, Any] | None:
    return events[index] if len(events) > index else None
