"""What a caller heard of the agent, from its received audio alone (no events): when the agent
was first audible, when it fell quiet; used by the side by side, where pipecat sends no events,
so both sides are judged alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from server.testkit.caller import SILENCE_DBFS, ReceivedFrame, WebRTCCaller

__all__ = [
    "ANSWER_TIMEOUT_S",
    "FRAME_S",
    "heard_between",
    "last_sound_after",
    "settle",
    "streamed_requests",
    "wait_first_sound",
    "wait_quiet",
]

FRAME_S = 0.02
ANSWER_TIMEOUT_S = 30.0
"""How long a caller waits for an answer to start."""


async def wait_first_sound(caller: WebRTCCaller, after: float, timeout_s: float) -> float | None:
    """Arrival time of the agent's first audible frame after ``after``; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while (heard := caller.first_sound_after(after)) is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.02)
    return heard


async def wait_quiet(
    caller: WebRTCCaller, since: float, hold_s: float, timeout_s: float
) -> float | None:
    """Wait until the agent has been inaudible for ``hold_s``; the arrival time of its last
    audible frame after ``since`` (``since`` if none); None if it still talks at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = last_sound_after(caller.frames, since)
        quiet_from = since if last is None else last + FRAME_S
        if time.monotonic() - quiet_from >= hold_s:
            return since if last is None else last
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)


def heard_between(frames: Sequence[ReceivedFrame], t0: float, t1: float) -> float | None:
    """Arrival time of the first audible frame in (t0, t1], or None."""
    for frame in frames:
        if t0 < frame.at <= t1 and frame.dbfs > SILENCE_DBFS:
            return frame.at
    return None


def last_sound_after(frames: Sequence[ReceivedFrame], t: float) -> float | None:
    """Arrival time of the last audible frame after ``t``, or None."""
    for frame in reversed(frames):
        if frame.at <= t:
            return None
        if frame.dbfs > SILENCE_DBFS:
            return frame.at
    return None


def streamed_requests(llm: Any) -> list[dict[str, Any]]:
    """The scripted LLM's streamed requests so far (answers, not classifications)."""
    return [r for r in llm.requests if r.get("stream")]


async def settle(caller: WebRTCCaller) -> None:
    """Until media flows and anything the agent says on its own (a greeting) is over."""
    await asyncio.sleep(1.0)
    await wait_quiet(caller, time.monotonic(), 1.0, ANSWER_TIMEOUT_S)
