"""CallClock: the idle timeout and maximum call length every transport applies."""

from __future__ import annotations

import asyncio

from server.call.clock import CallClock
from server.call.events import VoiceEvent


def test_idle_counts_from_the_last_caller_speech_and_waits_for_a_quiet_agent() -> None:
    clock = CallClock(max_call_s=100, idle_timeout_s=10)
    start = clock.started_at
    assert clock.verdict(agent_busy=False, now=start + 9) is None
    assert clock.verdict(agent_busy=True, now=start + 11) is None  # the agent is talking
    assert clock.verdict(agent_busy=False, now=start + 11) == "idle timeout"
    clock.observe(VoiceEvent("transcript", {"text": "hi"}))  # not a sign of the caller
    assert clock.verdict(agent_busy=False, now=start + 11) == "idle timeout"
    clock.observe(VoiceEvent("speech_start"))
    assert clock.verdict(agent_busy=False, now=clock.last_activity + 9) is None


def test_the_maximum_length_ends_even_a_busy_lively_call() -> None:
    clock = CallClock(max_call_s=60, idle_timeout_s=10)
    clock.touch()
    assert clock.verdict(agent_busy=True, now=clock.started_at + 60) == (
        "maximum call duration reached"
    )


async def test_watch_hangs_up_once_with_the_reason() -> None:
    clock = CallClock(max_call_s=0.05, idle_timeout_s=100, period_s=0.01)
    reasons: list[str] = []

    async def hangup(reason: str) -> None:
        reasons.append(reason)

    await asyncio.wait_for(clock.watch(lambda: False, hangup), 2)
    assert reasons == ["maximum call duration reached"]


async def test_an_agent_that_lost_its_voice_is_hung_up_even_mid_turn() -> None:
    clock = CallClock(max_call_s=100, idle_timeout_s=100, period_s=0.01)
    clock.touch()
    assert clock.verdict(agent_busy=True) is None
    clock.observe(VoiceEvent("voice_lost", {"message": "speech synthesis failed"}))
    reasons: list[str] = []

    async def hangup(reason: str) -> None:
        reasons.append(reason)

    await asyncio.wait_for(clock.watch(lambda: True, hangup), 2)
    assert reasons == ["the agent cannot speak"]
