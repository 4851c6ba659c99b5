"""Helpers to run real voice calls in tests: shared models, caller speech, a wired session."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from media import Resampler, Speaker, Synthesizer, Transcriber
from media.audio import SAMPLE_RATE, silence
from playbooks import ChatClient, OrchestratorEvent, PlaybookOrchestrator, RetryPolicy
from playbooks.loader import LoadedPlaybook
from server.events import VoiceEvent
from server.loopback import LoopbackCall
from server.session import Session, SessionSettings
from server.voice import VoicePlaybookOrchestrator


@functools.cache
def synthesizer() -> Synthesizer:
    return Synthesizer.load()


@functools.cache
def transcriber() -> Transcriber:
    return Transcriber.load()


@functools.cache
def piper_speech(text: str) -> bytes:
    """``text`` spoken by the Piper voice, as 16 kHz PCM16."""
    tts = synthesizer()
    resampler = Resampler(tts.sample_rate, SAMPLE_RATE)
    return resampler.resample(tts.synthesize_all(text)) + resampler.flush()


@functools.cache
def espeak_speech(text: str) -> bytes:
    """``text`` spoken by espeak-ng (a second, very different voice), as 16 kHz PCM16."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError(
            "espeak-ng is required (make test installs it: apt-get install espeak-ng)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-v", "en-us", "-s", "150", "-w", str(path), text], check=True)
        with wave.open(str(path)) as wav:
            rate = wav.getframerate()
            pcm = wav.readframes(wav.getnframes())
    resampler = Resampler(rate, SAMPLE_RATE)
    return resampler.resample(pcm) + resampler.flush()


def loudest(pcm: bytes, ms: int) -> bytes:
    """The loudest ``ms`` of ``pcm`` (16 kHz PCM16): a burst of real voiced sound."""
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
    width = SAMPLE_RATE * ms // 1000
    energy = np.convolve(samples * samples, np.ones(width), mode="valid")
    start = int(np.argmax(energy))
    return pcm[start * 2 : (start + width) * 2]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def word_error_rate(heard: str, expected: str) -> float:
    """Word-level edit distance over the expected length (Whisper tiny is not perfect)."""
    a, b = words(heard), words(expected)
    previous = list(range(len(b) + 1))
    for i, word in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != other))
            )
        previous = current
    return previous[-1] / max(1, len(b))


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
    tts: Synthesizer | None = None,
    stt: Transcriber | None = None,
    retries: int = 0,
) -> VoiceCall:
    """Wire a call like the server does, with a 16 kHz speaker so Whisper can check the output."""
    client = ChatClient.connect(base_url, None, "scripted", retry=RetryPolicy(retries=retries))
    orchestrator = PlaybookOrchestrator(playbook, client)
    sink: list[Callable[[VoiceEvent], None]] = []
    voice = VoicePlaybookOrchestrator(
        orchestrator,
        stt or transcriber(),
        tts or synthesizer(),
        Speaker(SAMPLE_RATE),
        lambda event: sink[0](event),
    )
    session = Session("test", voice, settings or SessionSettings(greet=False))
    call = VoiceCall(orchestrator, voice, session, LoopbackCall(session))
    sink.append(call.record)
    orchestrator.on(lambda event: call.llm_events.append((voice.clock(), event)))
    call.line.start()
    return call
