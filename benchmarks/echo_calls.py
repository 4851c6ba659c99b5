"""The harness's ``--corpus echo``: calls whose caller's phone sends the agent's voice back.

One call per echo path (delay and return loss; ``server.testkit.echo_path``), on a WebRTC line
(give the server ``--echo-cancellation all``, which cleans a browser line as a phone line's
audio is cleaned; browsers cancel their own echo). Per call:

- the agent gives a long answer with nobody talking: a **self-interruption** is the agent cut
  off (``interrupted``) by its own voice; a pause it resumed from by itself is counted apart;
- the agent gives it again and the caller talks over it: **barge-in**, from the caller's first
  voiced frame to the agent's silence; the caller's transcript must not hold the agent's words
  (**echo words**: words of the answer that the caller did not say).
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from server.testkit.caller import WebRTCCaller
from server.testkit.echo_path import ReturnedEcho

from .corpus import Utterance
from .llm import LONG_ANSWER
from .noisy_calls import words_of
from .scenarios import TURN_TIMEOUT_S, BenchTarget, Record, agent_speaking

__all__ = ["ECHO_PATHS", "echo_call", "echo_markdown", "summarize_echo"]

ECHO_PATHS = (
    ReturnedEcho(40, 6.0),
    ReturnedEcho(120, 6.0),
    ReturnedEcho(250, 6.0),
    ReturnedEcho(60, 12.0),
    ReturnedEcho(200, 20.0),
    ReturnedEcho(120, 10.0),
)


async def echo_call(
    target: BenchTarget, echo: ReturnedEcho, ask: Utterance, interrupt: Utterance
) -> Record:
    record: Record = {"delay_ms": echo.delay_ms, "return_loss_db": echo.return_loss_db}
    caller = WebRTCCaller(listener=target.listener, echo=echo)
    extra = {"playbook": target.playbook} if target.playbook else {}
    await caller.connect(target.base_url, token=target.token, **extra)
    try:
        await asyncio.sleep(0.5)
        alone = await _answer_alone(caller, ask)
        barge = await _talked_over(caller, ask, interrupt)
    finally:
        await caller.close()
    return {**record, **alone, **barge}


async def _answer_alone(caller: WebRTCCaller, ask: Utterance) -> Record:
    answers = len(caller.of_type("tts_end"))
    if await agent_speaking(caller, ask) is None:
        return {"ok": False, "error": "the agent never started its long answer"}
    try:
        await caller.wait_for("tts_end", answers + 1, TURN_TIMEOUT_S * 2)
    except TimeoutError:
        return {"ok": False, "error": "the long answer never ended"}
    await asyncio.sleep(1.0)
    return {
        "ok": True,
        "self_interruptions": len(caller.of_type("interrupted")),
        "self_pauses": len(caller.of_type("paused")),
    }


async def _talked_over(caller: WebRTCCaller, ask: Utterance, interrupt: Utterance) -> Record:
    interrupted = len(caller.of_type("interrupted"))
    transcripts = len(caller.of_type("transcript"))
    if await agent_speaking(caller, ask) is None:
        return {"barge_ok": False}
    await asyncio.sleep(1.5)
    spoken = caller.say(interrupt.pcm())
    started = await spoken.first_voiced_sent_at()
    await asyncio.sleep(2.0)
    silent_at = caller.silent_from(started)
    cut = len(caller.of_type("interrupted")) > interrupted
    await asyncio.sleep(2.0)
    heard = [e["text"] for e in caller.of_type("transcript")[transcripts + 1 :]]
    said = set(words_of(interrupt.text))
    foreign = [w for text in heard for w in words_of(text) if w not in said]
    agents = set(words_of(LONG_ANSWER))
    return {
        "barge_ok": cut and silent_at is not None,
        "barge_in_ms": round((silent_at - started) * 1000, 1) if silent_at and cut else None,
        "caller_heard": heard,
        "echo_words": [w for w in foreign if w in agents],
    }


def summarize_echo(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    barge = sorted(r["barge_in_ms"] for r in ok if r.get("barge_in_ms") is not None)
    return {
        "calls": len(records),
        "failed": len(records) - len(ok),
        "self_interruptions": sum(r["self_interruptions"] for r in ok),
        "self_pauses": sum(r["self_pauses"] for r in ok),
        "barge_ins_detected": sum(bool(r.get("barge_ok")) for r in ok),
        "barge_in_p50_ms": statistics.median(barge) if barge else None,
        "barge_in_max_ms": max(barge) if barge else None,
        "echo_words": sum(len(r.get("echo_words", [])) for r in ok),
    }


def echo_markdown(run: dict[str, Any]) -> str:
    s = run["summary"]
    lines = [
        "# Vocable: the echo corpus",
        "",
        f"`{run['command']}` at {run['git_commit']}, {run['started_at']}",
        f"on {run['machine'].get('cpu', '?')}; settings: `{run['settings']}`",
        "",
        f"- self-interruptions: **{s['self_interruptions']}** (pauses: {s['self_pauses']}) "
        f"in {s['calls']} long answers",
        f"- barge-ins over the echo detected: {s['barge_ins_detected']} of {s['calls']}, "
        f"p50 {s['barge_in_p50_ms']} ms, max {s['barge_in_max_ms']} ms",
        f"- the agent's words in the caller's transcripts: {s['echo_words']}",
        "",
        "| delay ms | return loss dB | self-interruptions | pauses | barge-in ms | caller heard "
        "| echo words |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in run["records"]:
        if not r.get("ok"):
            lines.append(f"| {r['delay_ms']} | {r['return_loss_db']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['delay_ms']} | {r['return_loss_db']} | {r['self_interruptions']} | "
            f"{r['self_pauses']} | {r.get('barge_in_ms')} | {r.get('caller_heard')} | "
            f"{r.get('echo_words')} |"
        )
    return "\n".join(lines) + "\n"
