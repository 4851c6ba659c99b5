"""Barge-in manners with real Whisper, Piper and webrtcvad on the loopback transport: the policies,
pause-and-resume after a cough or a backchannel (continuing exactly where it paused), no resume
after a real question, and the agent's own echo not interrupting it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from benchmarks.corpus import load_corpus
from media import EchoGate, EchoSettings, HearingSettings
from media.audio import pcm_rms_dbfs, silence
from playbooks import LoadedPlaybook, load_playbook
from server.call.session import SessionSettings
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.conftest import EXAMPLES
from tests.support.calls import VoiceCall, start_call, transcriber, word_error_rate
from tests.support.speech import piper_speech, tone

pytestmark = pytest.mark.slow

QUESTION = "Tell me about my order."
LONG_ANSWER = (
    "Your order left our warehouse on Monday. The courier will bring it on Tuesday between nine "
    "and five. Anything else today?"
)
"""Three sentences: a sound over the second still leaves one to resume into."""
SECOND_ANSWER = "All right, here is the short version."


@pytest.fixture(scope="module")
def support() -> LoadedPlaybook:
    return load_playbook(EXAMPLES / "support.yaml")


@pytest.fixture
async def calls() -> AsyncIterator[list[VoiceCall]]:
    made: list[VoiceCall] = []
    yield made
    for call in made:
        await call.line.stop()
        await call.orchestrator.client.aclose()


def _start(
    calls: list[VoiceCall],
    support: LoadedPlaybook,
    llm: ScriptedLLM,
    settings: SessionSettings | None = None,
    echo: tuple[float, int] | None = None,
) -> VoiceCall:
    llm.script(_replies)
    call = start_call(
        support, llm.base_url, settings=settings or SessionSettings(greet=False), echo=echo
    )
    calls.append(call)
    return call


_replies = answers_by_words({"about my order": LONG_ANSWER}, SECOND_ANSWER)
"""The long answer to the question; the short one to anything said over it (a request started
early on part of those words and then undone may come first)."""


@pytest.mark.parametrize("sound", ["synthetic_cough", "piper_mhm"])
async def test_a_cough_or_backchannel_pauses_then_resumes_where_it_stopped(
    calls: list[VoiceCall], support: LoadedPlaybook, llm: ScriptedLLM, sound: str
) -> None:
    call = _start(calls, support, llm)
    paused_at: list[int] = []
    call.probes.append(
        lambda event: paused_at.append(len(call.line.recording)) if event.type == "paused" else None
    )
    await call.say(piper_speech(QUESTION), 200)
    await call.wait_event("agent_sentence", count=2)
    await call.say(load_corpus()[sound].pcm(), 200)
    paused = await call.wait_event("paused")
    resumed = await call.wait_event("resumed", timeout_s=10)
    await call.wait_idle()

    assert call.of_type("interrupted") == []
    assert resumed.t - paused.t < 1.5
    # the whole answer was heard, once, in order: nothing repeated, nothing skipped
    assert call.voice.heard == LONG_ANSWER
    # what the caller heard, the pause's silence inside it, says the answer once (a repeat or a
    # skip would show): transcribed whole, since halves cut mid-word sound like other words to
    # tiny.en ("your order." + "Your order, like our.", for "Your order left our")
    heard = await transcriber().transcribe(bytes(call.line.recording))
    assert word_error_rate(heard.text, LONG_ANSWER) <= 0.15
    # and the caller heard silence from the moment the agent paused
    gap = call.line.recording[paused_at[0] : paused_at[0] + 32000 * 3 // 10]
    assert pcm_rms_dbfs(bytes(gap)) < -60
    assert len(llm.user_turns) == 1  # the sound made no LLM call


async def test_a_real_question_is_not_resumed(
    calls: list[VoiceCall], support: LoadedPlaybook, llm: ScriptedLLM
) -> None:
    call = _start(calls, support, llm)
    await call.say(piper_speech(QUESTION), 200)
    await call.wait_event("agent_sentence", count=2)
    await call.say(piper_speech("Sorry, can you repeat that more slowly?"), 200)
    await call.wait_event("interrupted", timeout_s=10)
    await call.wait_idle()
    assert call.of_type("resumed") == []
    assert len(call.of_type("paused")) == 1
    assert call.voice.heard == SECOND_ANSWER
    cut = [m for m in call.orchestrator.conversation.messages if m.get("interrupted")]
    assert len(cut) == 1
    assert "slowly" in llm.user_turns[-1].lower()


@pytest.mark.parametrize(
    ("policy", "interrupts"),
    [("immediate", True), ("confirmed", True), ("disabled", False)],
)
async def test_policies(
    calls: list[VoiceCall], support: LoadedPlaybook, llm: ScriptedLLM, policy: str, interrupts: bool
) -> None:
    settings = SessionSettings(greet=False, barge_in=policy)  # type: ignore[arg-type]
    call = _start(calls, support, llm, settings)
    await call.say(piper_speech(QUESTION), 200)
    await call.wait_event("agent_sentence", count=2)
    await call.say(piper_speech("Sorry, can you repeat that more slowly?"), 200)
    await call.wait_idle(timeout_s=40)
    assert call.of_type("paused") == []
    if interrupts:
        (started,) = call.of_type("speech_start")[1:]
        (interrupted,) = call.of_type("interrupted")
        limit = 0.15 if policy == "immediate" else 0.6
        assert interrupted.t - started.t <= limit
        assert call.voice.heard == SECOND_ANSWER
    else:  # the agent finishes; the caller's words are answered after
        assert call.of_type("interrupted") == []
        assert len(llm.user_turns) == 2
        assert call.voice.heard == SECOND_ANSWER
        assert "slowly" in llm.user_turns[-1].lower()


@pytest.mark.parametrize(
    ("cleanup", "echo"),
    [
        ("cancelled", (-6.0, 120)),  # a speakerphone: the gate let it cut the agent off
        ("gated", (-20.0, 100)),  # without the canceller, the gate holds back faint echo
        ("none", (-6.0, 120)),
    ],
)
async def test_the_agents_own_echo_does_not_interrupt_it(
    calls: list[VoiceCall],
    support: LoadedPlaybook,
    llm: ScriptedLLM,
    cleanup: str,
    echo: tuple[float, int],
) -> None:
    """A phone line returning the agent's voice: with the echo canceller (phone lines' default)
    or, without it, the level gate, the agent talks on; with neither, its own voice pauses or
    cuts it (so the fixture bites)."""
    settings = SessionSettings(
        greet=False,
        echo=EchoSettings(enabled=cleanup == "gated"),
        hearing=HearingSettings(echo_cancellation=cleanup == "cancelled"),
    )
    call = _start(calls, support, llm, settings, echo=echo)
    await call.say(piper_speech(QUESTION), 200)
    await call.wait_event("agent_sentence", count=1)
    if cleanup == "none":
        await call.wait_event("paused", timeout_s=10)
        return
    await call.wait_idle(timeout_s=40)
    assert call.of_type("paused") == []
    assert call.of_type("interrupted") == []
    assert call.voice.heard == LONG_ANSWER
    if cleanup == "gated":
        assert call.session.echo.suppressed > 100
    else:
        assert call.session.echo.suppressed == 0  # the gate is off where the canceller runs
        hearing = call.session.hearing
        assert hearing is not None
        assert hearing.frames > 100


def test_the_echo_gate_tells_echo_from_the_caller() -> None:
    gate = EchoGate(EchoSettings(return_loss_db=12, max_delay_ms=300))
    agent = -20.0
    levels = [agent] * 10 + [-120.0] * 5  # the agent spoke until 100 ms ago
    echo = _tone_at(agent - 20, 440)
    caller = _tone_at(agent - 3, 300)
    assert gate.is_echo(echo, levels)
    assert not gate.is_echo(caller, levels)
    assert not gate.is_echo(echo, [-120.0] * 20)  # the agent silent for longer than any echo
    assert not gate.is_echo(silence(20), levels)  # silence is nobody's
    assert pcm_rms_dbfs(echo) == pytest.approx(agent - 20, abs=0.1)
    assert gate.suppressed == 1
    assert not EchoGate(EchoSettings(enabled=False)).is_echo(echo, levels)


def _tone_at(dbfs: float, frequency: float) -> bytes:
    """20 ms of a 16 kHz sine at ``dbfs`` RMS."""
    return tone(16000, 20, frequency, amplitude=2**0.5 * 10 ** (dbfs / 20))
