"""Real Whisper output after a decode time the test chooses, so that what a call does when a
decode is fast or slow is tested on every machine, whatever its own CPU takes.

Each utterance is decoded once per test session by the shared real transcriber and cached by
its audio (digital silence trimmed from both ends: the same words heard a frame earlier or later
are the same utterance). :meth:`TimedTranscriber.prime` decodes ahead of the call every pause
and every utterance the VAD will hand out for a script, so during the call each transcription
takes exactly ``latency_s``, 0 included; a decode the call had to wait for is counted in
``misses``.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from media import SpeechEnded, SpeechPaused, Transcript, VadSegmenter, VadSettings
from media.audio import FRAME_BYTES, silence
from server.call.endpointing import EndpointSettings
from tests.support.speech import transcriber

__all__ = ["DECODE_TIMES", "TimedTranscriber", "primed"]

_DECODED: dict[bytes, Transcript] = {}
"""Whisper's output by trimmed audio, for the whole test session."""

LEAD_IN_MS = 1000
"""Silence a call's script is primed with before its first word (the loopback line feeds
silence until the script starts)."""


def _key(pcm: bytes) -> bytes:
    samples = np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype=np.int16)
    voiced = np.flatnonzero(samples)
    if not voiced.size:
        return b""
    return samples[voiced[0] : voiced[-1] + 1].tobytes()


class TimedTranscriber:
    """A ``SpeechToText`` whose every transcription takes ``latency_s`` of wall-clock time and
    returns what the real Whisper transcriber makes of the audio."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.misses = 0
        """Transcriptions whose decode was not primed (they took the decode's time as well)."""
        self.calls = 0
        self.backlog: int | None = None
        """Decodes the session is told wait for a worker (``Transcriber.backlog``); None: not
        told, as of a remote transcriber."""
        self.idle: bool | None = None
        """Whether the session is told no other call's decode keeps Whisper busy
        (``Transcriber.has_idle_worker``); None: not told, as of a remote transcriber."""

    async def prime(self, script: bytes, vad: VadSettings | None = None) -> None:
        """Decode ahead what a call fed ``script`` (after silence) will ask for: the audio at
        each pause of ``vad.pause_ms`` and each whole utterance, whether the session ends it
        at the shortest end-of-turn silence or at the longest."""
        vad = vad or VadSettings()
        longest = EndpointSettings().incomplete_silence_ms
        audio = silence(LEAD_IN_MS) + script + silence(2 * longest)
        for settings in {vad, dataclasses.replace(vad, end_silence_ms=longest)}:
            segmenter = VadSegmenter(settings)
            for index in range(len(audio) // FRAME_BYTES):
                frame = audio[index * FRAME_BYTES : (index + 1) * FRAME_BYTES]
                for event in segmenter.push(frame, index * 0.02):
                    if isinstance(event, SpeechPaused | SpeechEnded):
                        await self._decode(event.audio)

    def has_idle_worker(self, *, besides: object = None) -> bool | None:
        return self.idle

    async def transcribe(
        self, pcm: bytes, *, slack_s: float = 0.0, owner: object = None
    ) -> Transcript:
        self.calls += 1
        key = _key(pcm)
        if key not in _DECODED:
            self.misses += 1
        result = await self._decode(pcm)
        await asyncio.sleep(self.latency_s)
        return dataclasses.replace(result, compute_ms=self.latency_s * 1000)

    async def aclose(self) -> None:
        """Nothing to release: the real transcriber is shared by the test session."""

    async def _decode(self, pcm: bytes) -> Transcript:
        key = _key(pcm)
        if key not in _DECODED:
            _DECODED[key] = await transcriber().transcribe(pcm)
        return _DECODED[key]


async def primed(latency_s: float, *scripts: bytes) -> TimedTranscriber:
    """A :class:`TimedTranscriber` taking ``latency_s`` per transcription, primed for calls
    that feed each of ``scripts`` (with the default VAD settings)."""
    timed = TimedTranscriber(latency_s)
    for script in scripts:
        await timed.prime(script)
    return timed


DECODE_TIMES = pytest.mark.parametrize("decode_s", [0.0, 1.0], ids=["instant decode", "1 s decode"])
"""Run a test with a decode that is ready at once (a fast CPU, or faster) and one slower than
any end-of-turn silence (a slow or busy CPU)."""
