"""Cleaning the caller's audio (WebRTC's AEC3 and noise suppressor): the agent's voice returned
at a speakerphone's 6 dB is taken out so that webrtcvad hears no speech in it, a caller talking
over it is still understood by Whisper, and a car's steady noise stops sounding like speech.
Real Piper speech, webrtcvad and Whisper."""

from __future__ import annotations

import pytest

from media import FRAME_BYTES, Hearing, HearingSettings
from media.audio import SAMPLE_RATE, silence
from media.vad import VadSegmenter, VadSettings
from server.testkit.echo_path import EchoPath, ReturnedEcho
from server.testkit.impairments import at_level, mix_at_snr, noise
from tests.support.calls import transcriber, word_error_rate
from tests.support.speech import piper_speech

pytestmark = pytest.mark.timeout(120)

AGENT = (
    "Standard delivery takes three to five working days and costs nothing over fifty euros. "
    "Express delivery arrives the next working day."
)
CALLER = "Sorry, are you open on Monday?"


def _frames(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + FRAME_BYTES] for i in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)]


def _speakerphone(hearing: Hearing | None, caller_at_s: float | None) -> bytes:
    """A call's 20 ms clock: the agent speaks; what it sent comes back 120 ms later at -6 dB
    (plus the caller, from ``caller_at_s``); returns what the VAD is given."""
    agent = _frames(piper_speech(AGENT))
    path = EchoPath(ReturnedEcho(120, 6.0), SAMPLE_RATE)
    voice = piper_speech(CALLER) if caller_at_s is not None else b""
    start = int((caller_at_s or 0) * 50)
    heard = bytearray()
    for n, frame in enumerate(agent):
        if hearing is not None:
            hearing.played(frame)
        path.played(frame, SAMPLE_RATE)
        mic = silence(20)
        if caller_at_s is not None and start <= n < start + len(voice) // FRAME_BYTES:
            mic = voice[(n - start) * FRAME_BYTES : (n - start + 1) * FRAME_BYTES]
        picked_up = path.mixed(mic)
        heard += hearing.heard(picked_up) if hearing is not None else picked_up
    return bytes(heard)


def _voiced(pcm: bytes) -> int:
    vad = VadSegmenter(VadSettings())
    return sum(vad.is_voiced(frame) for frame in _frames(pcm))


def test_the_agents_own_voice_is_taken_out_of_the_callers_audio() -> None:
    raw = _speakerphone(None, None)
    assert _voiced(raw) > 100  # the echo alone is speech to the VAD
    hearing = Hearing(HearingSettings(echo_cancellation=True))
    cleaned = _speakerphone(hearing, None)
    assert _voiced(cleaned) <= 3
    assert hearing.frames == len(cleaned) // FRAME_BYTES


async def test_a_caller_talking_over_the_echo_is_understood_without_the_agents_words() -> None:
    cleaned = _speakerphone(Hearing(HearingSettings(echo_cancellation=True)), caller_at_s=3.0)
    start = int(2.8 * SAMPLE_RATE) * 2
    said = (await transcriber().transcribe(cleaned[start : start + 3 * SAMPLE_RATE * 2])).text
    assert word_error_rate(said, CALLER) <= 0.2, said
    assert not {"delivery", "working", "euros"} & set(said.lower().split()), said


async def test_steady_noise_stops_sounding_like_speech_and_speech_stays_clear() -> None:
    """A car's rumble at -25 dBFS is speech to webrtcvad in most frames; cleaned, in few. A
    question over it at 10 dB SNR is still understood."""
    car = at_level(noise("car", 5000, seed=1), -25.0)
    hearing = Hearing(HearingSettings(noise_suppression=True))
    cleaned = b"".join(hearing.heard(frame) for frame in _frames(car))
    assert _voiced(car) > 150
    assert _voiced(cleaned[SAMPLE_RATE * 2 :]) < 40  # after a second to learn the noise
    noisy = mix_at_snr(piper_speech(CALLER) + silence(300), car, 10.0)
    heard = b"".join(hearing.heard(frame) for frame in _frames(noisy))
    said = (await transcriber().transcribe(heard)).text
    assert word_error_rate(said, CALLER) <= 0.2, said
