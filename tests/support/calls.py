"""Helpers to run real voice calls in tests: shared models, caller speech, a wired session."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from aiohttp.test_utils import TestServer

from media import Speaker, SpeechToText, TextToSpeech, joins_next
from media.audio import SAMPLE_RATE, silence
from playbooks import (
    ChatClient,
    OrchestratorEvent,
    OrchestratorOptions,
    PlaybookOrchestrator,
    RetryPolicy,
    load_playbooks,
)
from playbooks.loader import LoadedPlaybook
from server.call.events import VoiceEvent, payload_problem
from server.call.session import Session, SessionSettings
from server.call.voice import VoicePlaybookOrchestrator
from server.config.server import ServerConfig
from server.http.app import CALLS, create_app
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.transports.base import TransportCall
from tests.support.loopback_call import LoopbackCall
from tests.support.speech import (
    espeak_wav,
    piper_speech,
    synthesizer,
    to_16k,
    transcriber,
    turn_model,
    word_error_rate,
    words,
)

__all__ = [
    "VoiceCall",
    "answers_spoken",
    "base_url",
    "espeak_speech",
    "events_of",
    "loudest",
    "piper_speech",
    "quick_playbook",
    "start_call",
    "synthesize_ahead",
    "synthesizer",
    "transcriber",
    "voice_server",
    "word_error_rate",
    "words",
]


def sentences_of(chunks: list[str]) -> list[str]:
    """``agent_sentence`` texts as sentences: an answer's first phrase ("Your parcel arrives",
    see ``media.joins_next``) joined to the chunk that goes on with it."""
    sentences: list[str] = []
    joining = False
    for chunk in chunks:
        if joining and sentences:
            sentences[-1] += " " + chunk
        else:
            sentences.append(chunk)
        joining = joins_next(chunk)
    return sentences


def synthesize_ahead(*phrases: str) -> None:
    """Synthesize (and cache) the caller's phrases before any call starts: Piper running on the
    test's event loop mid-call would stall the call's 20 ms clock."""
    for phrase in phrases:
        piper_speech(phrase)


def espeak_speech(text: str) -> bytes:
    """``text`` spoken by espeak-ng (a second, very different voice), as 16 kHz PCM16."""
    with tempfile.TemporaryDirectory() as tmp:
        pcm, rate = espeak_wav(text, Path(tmp) / "speech.wav", "-v", "en-us", "-s", "150")
    return to_16k(pcm, rate)


def loudest(pcm: bytes, ms: int) -> bytes:
    """The loudest ``ms`` of ``pcm`` (16 kHz PCM16): a burst of real voiced sound."""
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
    width = SAMPLE_RATE * ms // 1000
    energy = np.convolve(samples * samples, np.ones(width), mode="valid")
    start = int(np.argmax(energy))
    return pcm[start * 2 : (start + width) * 2]


PAYLOAD_PROBLEMS: list[str] = []
"""Events of the tests' calls whose data is not their kind's payload (see ``tests/conftest.py``:
a test whose call emits one fails)."""


def check_payload(event: VoiceEvent) -> None:
    """Note ``event`` in PAYLOAD_PROBLEMS unless its data is its kind's payload; never raises
    (it runs inside the call's event path)."""
    try:
        problem = payload_problem(event)
    except Exception as exc:
        problem = f"{event.type}: the check failed: {exc!r}"
    if problem is not None:
        PAYLOAD_PROBLEMS.append(problem)


@dataclass
class VoiceCall:
    """A session on the loopback transport, with every voice and orchestrator event recorded."""

    orchestrator: PlaybookOrchestrator
    voice: VoicePlaybookOrchestrator
    session: Session
    line: LoopbackCall
    events: list[VoiceEvent] = field(default_factory=list)
    llm_events: list[tuple[float, OrchestratorEvent]] = field(default_factory=list)
    probes: list[Callable[[VoiceEvent], None]] = field(default_factory=list)
    """Run synchronously as each event is emitted, to observe state at that instant."""

    def record(self, event: VoiceEvent) -> None:
        for probe in self.probes:
            probe(event)
        check_payload(event)
        self.events.append(event)

    def of_type(self, type: str) -> list[VoiceEvent]:
        return [event for event in self.events if event.type == type]

    async def say(self, pcm: bytes, trailing_silence_ms: int = 0) -> None:
        self.line.say(pcm + silence(trailing_silence_ms))

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the caller's script is sent and the agent is done with its turn."""
        await self.line.wait_until(
            lambda: (
                self.line.caller_idle and not self.session.busy and not self.session.vad.speaking
            ),
            timeout_s,
        )

    async def wait_event(self, type: str, count: int = 1, timeout_s: float = 30.0) -> VoiceEvent:
        await self.line.wait_until(lambda: len(self.of_type(type)) >= count, timeout_s)
        return self.of_type(type)[count - 1]

    def heard_since(self, start_byte: int) -> bytes:
        return bytes(self.line.recording[start_byte:])


def start_call(
    playbook: LoadedPlaybook,
    base_url: str,
    *,
    settings: SessionSettings | None = None,
    tts: TextToSpeech | None = None,
    stt: SpeechToText | None = None,
    retries: int = 0,
    echo: tuple[float, int] | None = None,
    options: OrchestratorOptions | None = None,
    api_key: str | None = None,
) -> VoiceCall:
    """Wire a call like the server does, with a 16 kHz speaker so Whisper can check the output."""
    client = ChatClient.connect(base_url, api_key, "scripted", retry=RetryPolicy(retries=retries))
    orchestrator = PlaybookOrchestrator(playbook, client, options)
    sink: list[Callable[[VoiceEvent], None]] = []
    voice = VoicePlaybookOrchestrator(
        orchestrator,
        stt or transcriber(),
        tts or synthesizer(),
        Speaker(SAMPLE_RATE),
        lambda event: sink[0](event),
    )
    session = Session("test", voice, settings or SessionSettings(greet=False))
    call = VoiceCall(orchestrator, voice, session, LoopbackCall(session, echo=echo))
    sink.append(call.record)
    orchestrator.on(lambda event: call.llm_events.append((voice.clock(), event)))
    call.line.start()
    return call


def events_of(call: TransportCall, kind: str) -> int:
    """How many events of ``kind`` ``call`` has had so far."""
    return [event["type"] for event in call.events.since(0)].count(kind)


def only_call(server: TestServer) -> TransportCall:
    """The server's one call (asserts there is exactly one)."""
    (call,) = server.app[CALLS].calls.values()
    assert isinstance(call, TransportCall)
    return call


async def answers_spoken(server: TestServer, count: int, timeout_s: float = 30) -> None:
    """Return once the agent of the server's one call has finished ``count`` answers, its
    greeting included (the ``count``-th ``tts_end``: the audio has left the speaker). A wait on
    the event, where a test would otherwise sleep for as long as the audio might last."""
    call = only_call(server)
    queue = call.events.listen()  # from the call's first event
    kinds: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            while kinds.count("tts_end") < count:
                item = await queue.get()
                assert item is not None, f"the call ended after the events {kinds}"
                kinds.append(item["type"])
    except TimeoutError:
        raise AssertionError(f"{count} answer(s) not spoken in {timeout_s} s: {kinds}") from None
    finally:
        call.events.unlisten(queue)


QUICK_PLAYBOOK = """\
id: quick
name: Quick
description: The support example's order tools behind a one-word greeting.
initial_stage: talk
tools_module: {tools}
stages:
  - id: talk
    name: Talk
    greeting: Hi.
    system_prompt: Answer the caller.
    tools: [lookup_order]
    two_phase_execution: false
"""
"""A playbook for calls whose greeting is only something to sit through: a greeting of 0.5 s
(the support example's takes 3.2 s to play), the support example's ``lookup_order`` tool."""


def quick_playbook(folder: Path) -> Path:
    """:data:`QUICK_PLAYBOOK` written to ``folder``: its path (``--playbook``)."""
    from tests.conftest import EXAMPLES

    path = folder / "quick.yaml"
    path.write_text(QUICK_PLAYBOOK.format(tools=json.dumps(str(EXAMPLES / "support_tools.py"))))
    return path


def base_url(server: TestServer) -> str:
    """The server's root URL without a trailing slash (``http://127.0.0.1:PORT``)."""
    return str(server.make_url("")).rstrip("/")


@asynccontextmanager
async def voice_server(
    llm_url: str | None,
    config: ServerConfig | None = None,
    playbooks: Path | None = None,
    llm_api_key: str | None = None,
    *,
    measured_admission: bool = False,
) -> AsyncIterator[TestServer]:
    """The real app on 127.0.0.1 with the shared models and the playbooks of ``playbooks`` (a
    folder or file; the example playbooks when None); no LLM when ``llm_url`` is None.

    Admission by a call's measured cost is off unless ``measured_admission``: the test's own
    callers, Whisper checks and speech run in the server's process, whose CPU the gauge would
    take for the calls' (it is tested with its own gauge in tests/test_overload.py). Every
    other limit stays."""
    from tests.conftest import EXAMPLES

    config = config or ServerConfig()
    if not measured_admission:
        config = replace(config, overload=replace(config.overload, capacity_cpu_percent=0))
    llm = ChatClient.connect(llm_url, llm_api_key, "scripted") if llm_url else None
    engines = Engines(
        transcriber(),
        synthesizer(),
        load_playbooks(playbooks or EXAMPLES),
        LLMProvider.serving(llm),
        turn_model() if config.turn_model is not None else None,
    )
    server = TestServer(create_app(config, engines), host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()
        if llm is not None:
            await llm.aclose()


QUIET_DBFS = -45.0
"""A received 20 ms chunk at or below this level is silence to the phone tests (as to
``SipPhone.heard``)."""


def quiet_after(arrivals: list[tuple[float, float]], after: float, run: int = 10) -> float:
    """How long after ``after`` the agent's audio stopped: the first of ``run`` quiet chunks in
    a row arrived then (seconds; infinity: it did not, so far)."""
    quiet = 0
    for index, (at, dbfs) in enumerate(arrivals):
        if at <= after:
            continue
        quiet = quiet + 1 if dbfs <= QUIET_DBFS else 0
        if quiet == run:
            return arrivals[index - run + 1][0] - after
    return float("inf")


def greeted(server: TestServer) -> bool:
    """Whether the server's one call has played its greeting out (its first ``tts_end``: the
    audio has left the speaker); False while there is no call yet."""
    if len(server.app[CALLS]) != 1:
        return False
    return events_of(only_call(server), "tts_end") > 0


def assert_cut_off(
    arrivals: list[tuple[float, float]], call: TransportCall, talk_at: float, mark: int
) -> None:
    """Assert that the caller who started talking at ``talk_at`` over the agent cut it off:
    its audio went quiet within 0.6 s (``arrivals``: (monotonic arrival, dBFS) of each chunk
    the phone heard), and the call's events after ``mark`` (an earlier
    ``call.events.published``) show the caller's speech, a pause or a cut (not a lull between
    sentences), and no resuming after the caller spoke."""
    stopped_after = quiet_after(arrivals, talk_at)
    kinds = ("speech_start", "paused", "resumed", "interrupted", "transcript", "tts_start")
    outcome = [event["type"] for event in call.events.since(mark) if event["type"] in kinds]
    assert stopped_after <= 0.6, (stopped_after, outcome)
    assert "speech_start" in outcome, outcome
    assert {"paused", "interrupted"} & set(outcome), outcome
    assert "resumed" not in outcome[outcome.index("speech_start") :], outcome
