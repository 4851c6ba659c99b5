"""Fault injection: every failure a caller can meet, each beside a healthy call.

For each fault the faulty call gets a spoken fallback (or, for a vanished peer, a clean end), an
``error`` event with a meaningful ``source``, and ``vocable_errors{source}`` goes up; a second call
running at the same time, on the same Whisper, Piper and LLM server, gets its normal answer.

Whisper, Piper, webrtcvad and aiortc are real; the LLM is the scripted server. Whisper and Piper
faults are subclasses of the real engines, on the same loaded models, whose decode or synthesis
raises in the worker thread. Covered elsewhere and not repeated: retry policy and status codes
(test_llm), tool error results and Phase 1 limits (test_orchestrator), closed STT/TTS pools and a
dead endpoint on a lone call (test_voice_pipeline), a peer vanishing while idle
(test_webrtc_call).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from media import Synthesizer, Transcriber, Transcript
from media.audio import silence
from playbooks import OrchestratorOptions, load_playbook
from playbooks.loader import LoadedPlaybook
from playbooks.orchestrator import DEFAULT_FALLBACK
from server.call.session import SessionSettings
from server.config.server import ServerConfig
from server.http.app import CALLS
from server.runtime.observability import ServerMetrics
from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import NO_INTENT, Reply, ScriptedLLM, ScriptedToolCall
from tests.support.calls import (
    VoiceCall,
    piper_speech,
    sentences_of,
    start_call,
    synthesize_ahead,
    synthesizer,
    transcriber,
    voice_server,
    words,
)
from tests.support.timed_stt import TimedTranscriber

pytestmark = pytest.mark.slow

FAULTY_QUESTION = "Is anybody there?"  # 1.2 s of speech (with "Hello," 1.8 s)
FAULTY_KEY = "there"
"""The question's last word: a speculative turn on part of it gets a harmless reply."""
HEALTHY_QUESTION = "Where is my parcel?"
HEALTHY_KEY = "parcel"
HEALTHY_ANSWER = "Your parcel arrives on Tuesday."
RECOVERED = "Our records are not answering."
"""What the LLM says once a failed tool call's error result is back."""
FALLBACK = DEFAULT_FALLBACK

PLAYBOOK = """
id: faults
name: Fault drill
initial_stage: main
tools_module: tools.py
stages:
  - id: main
    name: Main
    system_prompt: Help the caller.
    tools: [lookup_order, stall]
"""

TOOLS = '''
import asyncio

from playbooks import tool


@tool(side_effects=False)
def lookup_order(order_id: str) -> dict:
    """Look up an order.

    Args:
        order_id: The order number, like A1001.
    """
    return {"status": "shipped"}


@tool(timeout_s=1, side_effects=False)
async def stall() -> str:
    """A back end that never answers."""
    await asyncio.Event().wait()
    return "never"
'''


@pytest.fixture(scope="module", autouse=True)
def _caller_speech_ready() -> None:
    synthesize_ahead(FAULTY_QUESTION, HEALTHY_QUESTION)


@pytest.fixture
def playbook(write_playbook: Callable[..., Path]) -> LoadedPlaybook:
    return load_playbook(write_playbook(PLAYBOOK, TOOLS))


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics()


DECODE = TimedTranscriber(0.3)
"""The calls' Whisper, its time set by the test (0.3 s: the words of the question's last pause
come after the turn's 400 ms of silence, and it is answered without a preemptive start)."""


def _start(
    calls: list[VoiceCall],
    metrics: ServerMetrics,
    playbook: LoadedPlaybook,
    url: str,
    **kwargs: Any,
) -> VoiceCall:
    """A loopback call whose events feed ``metrics`` as they happen, like the server's."""
    kwargs.setdefault("stt", DECODE)
    call = start_call(playbook, url, **kwargs)
    call.probes.append(metrics.observe)
    calls.append(call)
    return call


def _route(fault: Reply) -> Callable[[dict[str, Any]], Reply]:
    """The faulty caller's question gets ``fault``, a tool result gets ``RECOVERED``, the
    healthy caller's question its answer, and anything else (a partial transcript) "Go on."."""

    def reply(body: dict[str, Any]) -> Reply:
        if not body.get("stream"):
            return NO_INTENT
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply(content=RECOVERED)
        text = str(last["content"]).lower()
        if FAULTY_KEY in text:
            return fault
        if HEALTHY_KEY in text:
            return Reply(content=HEALTHY_ANSWER)
        return Reply(content="Go on.")

    return reply


async def _converse(faulty: VoiceCall, healthy: VoiceCall, timeout_s: float = 30.0) -> None:
    """Both callers ask at once; wait until both turns are over."""
    for question in (FAULTY_QUESTION, HEALTHY_QUESTION):
        await DECODE.prime(piper_speech(question) + silence(200))
    await faulty.say(piper_speech(FAULTY_QUESTION), 200)
    await healthy.say(piper_speech(HEALTHY_QUESTION), 200)
    await asyncio.gather(faulty.wait_idle(timeout_s), healthy.wait_idle(timeout_s))


def _spoken(call: VoiceCall) -> list[str]:
    return sentences_of([event.data["text"] for event in call.of_type("agent_sentence")])


async def _heard(pcm: bytes) -> str:
    """What Whisper hears in the agent's audio."""
    return (await transcriber().transcribe(pcm)).text


async def _assert_fallback_heard(call: VoiceCall) -> None:
    assert _spoken(call)[-1] == FALLBACK
    assert call.voice.heard.endswith(FALLBACK)
    assert "trouble" in words(await _heard(bytes(call.line.recording)))
    assert call.session.state == "listening"


async def _assert_healthy(call: VoiceCall) -> None:
    assert call.of_type("error") == []
    assert _spoken(call) == [HEALTHY_ANSWER]
    _assert_answer_heard(await _heard(bytes(call.line.recording)))
    assert len(call.of_type("turn_metrics")) == 1
    assert call.session.state == "listening"


def _assert_answer_heard(heard: str) -> None:
    """The healthy answer reached the ear: its closing words, not the fallback. (A word error
    rate on five words failed a busy CI machine's run on "Your personal arrival arrives on
    Tuesday.", a frame late mid-"parcel".)"""
    assert {"arrives", "tuesday"} <= set(words(heard)), heard
    assert "trouble" not in words(heard), heard


def _errors_counted(exposition: str) -> dict[str, float]:
    """``vocable_errors_total`` by source, from Prometheus text."""
    return {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "vocable_errors_total"
    }


def _errors(call: VoiceCall, source: str) -> list[dict[str, Any]]:
    errors = [event.data for event in call.of_type("error")]
    assert [error["source"] for error in errors] == [source] * len(errors), errors
    return errors


# -- the LLM endpoint ------------------------------------------------------------------------------


LLM_FAULTS = {
    # name: (fault, the call's orchestrator options, expected sentences before the fallback)
    "refused": (None, None, []),
    "no first token": (Reply(hang=True), OrchestratorOptions(llm_timeout_ms=1500), []),
    "stalled mid-answer": (
        Reply(content="Let me check that for you. Your parcel is late.", stall_after_chunks=9),
        OrchestratorOptions(llm_timeout_ms=1500),
        ["Let me check that for you.", "Your parcel…"],
    ),
    # a short first sentence: the fallback follows the cut sooner (the chunks sent are the
    # role, "Let", " me", " check.", " Your", " parcel")
    "cut mid-answer": (
        Reply(content="Let me check. Your parcel is late.", cut_after_chunks=6),
        None,
        ["Let me check.", "Your parcel…"],
    ),
    # a llama.cpp server still loading its model, as it words it
    "still loading": (
        Reply(
            status=503,
            error={"code": 503, "message": "Loading model", "type": "unavailable_error"},
        ),
        None,
        [],
    ),
}


@pytest.mark.parametrize("fault_name", list(LLM_FAULTS))
async def test_an_llm_fault_speaks_the_fallback(
    fault_name: str,
    llm: ScriptedLLM,
    playbook: LoadedPlaybook,
    calls: list[VoiceCall],
    metrics: ServerMetrics,
) -> None:
    fault, options, before = LLM_FAULTS[fault_name]
    llm.script(_route(fault or Reply(content="Nobody should ask me.")))
    url = llm.base_url
    if fault is None:  # connection refused: a port nothing listens on any more
        async with ScriptedLLM() as gone:
            url = gone.base_url
    # one retry (1 s backoff) for the refused endpoint: it is retried, then given up on
    faulty = _start(calls, metrics, playbook, url, options=options, retries=1)
    healthy = _start(calls, metrics, playbook, llm.base_url)

    await _converse(faulty, healthy)

    await _assert_healthy(healthy)
    assert _spoken(faulty) == [*before, FALLBACK]
    await _assert_fallback_heard(faulty)
    (error,) = _errors(faulty, "llm")
    if fault_name == "refused":
        assert "connect" in error["message"]
    elif fault_name == "still loading":
        assert "HTTP 503" in error["message"]
        assert "Loading model" in error["message"]
    elif options is not None:
        assert error["message"] == "the LLM sent nothing for 1.5 s"
        # given up on after the LLM's silence, not the client's 60 s request timeout
        (asked_at,) = [
            at
            for at, body in zip(llm.received_at, llm.requests, strict=True)
            if body.get("stream") and FAULTY_KEY in str(body["messages"][-1]["content"]).lower()
        ]
        (reported,) = faulty.of_type("error")
        assert 1.4 <= reported.t - asked_at <= 5.0
    assert _errors_counted(metrics.render().decode()) == {"llm": 1.0}
    # the history says what the caller heard, cut where the stream broke
    assert faulty.orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": " ".join([*before, FALLBACK]),
    }


# -- tools -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (ScriptedToolCall("lookup_order", '{"order_id": "A10'), "not valid JSON"),
        (ScriptedToolCall("launch_rockets", {}), "unknown tool 'launch_rockets'"),
    ],
    ids=["invalid arguments JSON", "unknown tool"],
)
async def test_a_bad_tool_call_is_reported_and_the_llm_answers(
    call: ScriptedToolCall,
    problem: str,
    llm: ScriptedLLM,
    playbook: LoadedPlaybook,
    calls: list[VoiceCall],
    metrics: ServerMetrics,
) -> None:
    llm.script(_route(Reply(tool_calls=[call])))
    faulty = _start(calls, metrics, playbook, llm.base_url)
    healthy = _start(calls, metrics, playbook, llm.base_url)

    await _converse(faulty, healthy)

    await _assert_healthy(healthy)
    (error,) = _errors(faulty, "tool_call")
    assert problem in error["message"]
    (end,) = faulty.of_type("tool_call_end")
    assert (end.data["name"], end.data["error"]) == (call.name, True)
    # the LLM was told what went wrong, and its answer was spoken
    told = [m for r in llm.requests for m in r["messages"] if m["role"] == "tool"]
    assert len(told) == 1
    assert problem in told[0]["content"]
    assert _spoken(faulty) == [RECOVERED]
    assert "records" in words(await _heard(bytes(faulty.line.recording)))
    assert _errors_counted(metrics.render().decode()) == {"tool_call": 1.0}


async def test_a_hanging_tool_times_out_and_the_turn_answers(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall], metrics: ServerMetrics
) -> None:
    llm.script(_route(Reply(tool_calls=[ScriptedToolCall("stall")])))
    faulty = _start(calls, metrics, playbook, llm.base_url)
    healthy = _start(calls, metrics, playbook, llm.base_url)

    await _converse(faulty, healthy)

    await _assert_healthy(healthy)
    (error,) = _errors(faulty, "tool")
    assert error["message"] == "tool 'stall' timed out after 1 s"
    (end,) = faulty.of_type("tool_call_end")
    assert end.data["error"] is True
    assert 900 <= end.data["duration_ms"] <= 3000  # its own 1 s timeout, not Phase 1's 60 s
    told = [m for r in llm.requests for m in r["messages"] if m["role"] == "tool"]
    assert "timed out" in told[0]["content"]
    assert _spoken(faulty) == [RECOVERED]
    assert "records" in words(await _heard(bytes(faulty.line.recording)))
    assert _errors_counted(metrics.render().decode()) == {"tool": 1.0}


# -- Whisper and Piper -----------------------------------------------------------------------------


class _FailingTranscriber(Transcriber):
    """The shared Whisper model, whose every decode raises in the worker thread."""

    def __init__(self) -> None:
        shared = transcriber()
        super().__init__(shared._model, shared.settings)

    def _decode(self, pcm: bytes) -> Transcript:
        raise RuntimeError("CTranslate2 decode failed (injected)")


class _FailingSynthesizer(Synthesizer):
    """The shared Piper voice, whose synthesis raises in the worker thread for sentences
    containing ``trigger`` (every sentence when None), as a phonemizer failure would."""

    def __init__(self, trigger: str | None) -> None:
        shared = synthesizer()
        super().__init__(shared._voice, shared.settings)
        self.trigger = trigger

    def _chunks(
        self, text: str, *, first_sentence: int = 0, stream_first: bool = False
    ) -> Generator[tuple[bytes, bool], None, None]:
        if self.trigger is None or self.trigger in text:
            raise RuntimeError(f"Piper failed on {text!r} (injected)")
        yield from super()._chunks(text, first_sentence=first_sentence, stream_first=stream_first)


async def test_whisper_raising_speaks_the_fallback_without_asking_the_llm(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall], metrics: ServerMetrics
) -> None:
    llm.script(_route(Reply(content="Nobody should ask me.")))
    broken = _FailingTranscriber()
    try:
        faulty = _start(calls, metrics, playbook, llm.base_url, stt=broken)
        healthy = _start(calls, metrics, playbook, llm.base_url)
        await _converse(faulty, healthy)
    finally:
        broken.close()

    await _assert_healthy(healthy)
    (error,) = _errors(faulty, "stt")
    assert "CTranslate2 decode failed" in error["message"]
    assert faulty.of_type("transcript") == []
    assert all(FAULTY_KEY not in turn.lower() for turn in llm.user_turns)
    assert _spoken(faulty) == [FALLBACK]
    await _assert_fallback_heard(faulty)
    assert _errors_counted(metrics.render().decode()) == {"stt": 1.0}


async def test_piper_raising_on_a_sentence_says_the_fallback_in_its_place(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall], metrics: ServerMetrics
) -> None:
    llm.script(_route(Reply(content="Your order is a blue kettle. It arrives on Tuesday.")))
    broken = _FailingSynthesizer(trigger="kettle")
    try:
        faulty = _start(calls, metrics, playbook, llm.base_url, tts=broken)
        healthy = _start(calls, metrics, playbook, llm.base_url)
        await _converse(faulty, healthy)
    finally:
        broken.close()

    await _assert_healthy(healthy)
    (error,) = _errors(faulty, "tts")
    assert "kettle" in error["message"]
    assert _spoken(faulty) == [FALLBACK, "It arrives on Tuesday."]
    said = await _heard(bytes(faulty.line.recording))
    assert {"trouble", "tuesday"} <= set(words(said))
    assert "kettle" not in words(said)
    assert faulty.session.state == "listening"
    assert _errors_counted(metrics.render().decode()) == {"tts": 1.0}


async def test_a_dead_piper_is_reported_per_sentence_and_the_call_goes_on(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall], metrics: ServerMetrics
) -> None:
    """Nothing can be spoken, not even the fallback: the caller hears silence (the client gets
    the error events), the turn ends, and ``voice_lost`` tells the transport to hang up (its
    CallClock does; see tests/test_watchdog.py)."""
    llm.script(_route(Reply(content="Your order is a blue kettle. It arrives on Tuesday.")))
    broken = _FailingSynthesizer(trigger=None)
    try:
        faulty = _start(calls, metrics, playbook, llm.base_url, tts=broken)
        healthy = _start(calls, metrics, playbook, llm.base_url)
        await _converse(faulty, healthy)
    finally:
        broken.close()

    await _assert_healthy(healthy)
    assert len(_errors(faulty, "tts")) == 2  # one per sentence; the fallback's failure is logged
    assert [e.type for e in faulty.events if e.type == "voice_lost"] == ["voice_lost"]
    assert _spoken(faulty) == []
    assert not any(faulty.line.recording)
    assert faulty.session.state == "listening"
    assert not faulty.session.busy
    assert _errors_counted(metrics.render().decode()) == {"tts": 2.0}


# -- the caller's connection -----------------------------------------------------------------------


async def test_a_peer_vanishing_mid_turn_ends_its_call_cleanly(llm: ScriptedLLM) -> None:
    """Over real WebRTC through the real app: the peer closes without a hang-up while its answer
    is still streaming; the other call on the same server carries on."""
    long_answer = " ".join(["Standard delivery takes three to five working days."] * 6)
    llm.script(_route(Reply(content=long_answer, chunk_delay_s=0.15)))
    config = ServerConfig(session=SessionSettings(greet=False))
    faulty, healthy = WebRTCCaller(), WebRTCCaller()
    async with voice_server(llm.base_url, config) as server:
        base = str(server.make_url("")).rstrip("/")
        try:
            await faulty.connect(base, playbook="support")
            await healthy.connect(base, playbook="support")
            registry = server.app[CALLS]
            vanishing = registry.calls[faulty.session_id]
            faulty.say(piper_speech(FAULTY_QUESTION))
            healthy.say(piper_speech(HEALTHY_QUESTION))
            await faulty.wait_for("agent_sentence", timeout_s=40)
            assert vanishing.session.busy

            await faulty.close()  # no hang-up message: the peer is simply gone

            await asyncio.wait_for(vanishing.ended.wait(), timeout=10)
            await asyncio.wait_for(llm.stream_abandoned.wait(), timeout=5)
            assert vanishing.session.state == "closed"
            assert not vanishing.session.busy
            assert list(registry.calls) == [healthy.session_id]

            await healthy.wait_for("tts_end", timeout_s=40)
            assert healthy.of_type("error") == []
            spoken = [e["text"] for e in healthy.of_type("agent_sentence")]
            assert sentences_of(spoken) == [HEALTHY_ANSWER]
            await asyncio.sleep(0.3)  # the last frames in flight
            said = await _heard(bytes(healthy.heard))
            _assert_answer_heard(said)

            async with (
                aiohttp.ClientSession() as http,
                http.get(server.make_url("/metrics")) as response,
            ):
                exposition = await response.text()
            assert _errors_counted(exposition) == {"transport": 1.0}
        finally:
            await faulty.close()
            await healthy.close()
