"""CallClock: the idle timeout (or a playbook's idle prompt and goodbye) and the maximum call
length every transport applies."""

from __future__ import annotations

import asyncio

from playbooks.models import Idle
from server.call.clock import IDLE_GOODBYE, CallClock
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


def test_a_playbooks_idle_setting_prompts_then_says_goodbye() -> None:
    idle = Idle(prompt_after_s=5, prompt="Still there?", hangup_after_s=3, goodbye="Bye.")
    clock = CallClock(max_call_s=100, idle_timeout_s=1, idle=idle)
    start = clock.last_activity
    assert clock.verdict(agent_busy=False, now=start + 4) is None  # the setting replaces it
    assert clock.idle_step(agent_busy=False, now=start + 4) is None
    assert clock.idle_step(agent_busy=True, now=start + 6) is None  # the agent is talking
    assert clock.idle_step(agent_busy=False, now=start + 6) == "prompt"
    clock.prompted = True
    clock.last_activity = start + 8  # the prompt's end
    assert clock.idle_step(agent_busy=False, now=start + 10) is None
    assert clock.idle_step(agent_busy=False, now=start + 11) == "goodbye"
    clock.observe(VoiceEvent("speech_start"))  # the caller answered: counting starts again
    assert not clock.prompted
    assert clock.idle_step(agent_busy=False, now=clock.last_activity + 4) is None


async def test_watch_says_the_prompt_then_the_goodbye_and_hangs_up() -> None:
    idle = Idle(prompt_after_s=1, prompt="Still there?", hangup_after_s=1, goodbye="Bye.")
    clock = CallClock(max_call_s=100, idle_timeout_s=100, period_s=0.01, idle=idle)
    clock.last_activity -= 1  # quiet for a second already
    said: list[str] = []
    reasons: list[str] = []

    async def say(text: str) -> None:
        said.append(text)

    async def hangup(reason: str) -> None:
        reasons.append(reason)

    await asyncio.wait_for(clock.watch(lambda: False, hangup, say=say), 3)
    assert said == ["Still there?", "Bye."]
    assert reasons == [IDLE_GOODBYE]
