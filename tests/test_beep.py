"""The voicemail beep (``media/beep.py``) and what it ends (``server/call/pickup.py``): beeps of
several tones are heard, with their end; two-tone signals (DTMF, ringback), a dial tone, music,
a held vowel and speech are not beeps. A greeting's beep ends it at once; without one, silence
does. Synthetic tones and Piper's speech, a test clock."""

from __future__ import annotations

import numpy as np
import pytest

from media.audio import FRAME_BYTES, SAMPLE_RATE
from media.beep import Beep, BeepDetector
from server.call.pickup import Pickup, PickupSettings
from tests.support.phone import phone_audio

pytestmark = pytest.mark.timeout(60)

HARMONICS = ((1, 1.0), (2, 0.7), (3, 0.5), (4, 0.4), (5, 0.3), (6, 0.2))


Harmonics = tuple[tuple[int, float], ...]


def tones(
    *hz: float, ms: int, level: float = 8000.0, harmonics: Harmonics = ((1, 1.0),)
) -> np.ndarray:
    t = np.arange(SAMPLE_RATE * ms // 1000) / SAMPLE_RATE
    wave = np.zeros_like(t)
    for f in hz:
        for k, a in harmonics:
            wave += a * np.sin(2 * np.pi * f * k * t)
    scaled: np.ndarray = wave / np.max(np.abs(wave)) * level
    return scaled


def quiet(ms: int) -> np.ndarray:
    return np.zeros(SAMPLE_RATE * ms // 1000)


def pcm(*parts: np.ndarray) -> bytes:
    joined = np.concatenate(parts)
    joined = np.concatenate([joined, np.zeros(-joined.size % (FRAME_BYTES // 2))])
    return bytes(np.clip(joined, -32768, 32767).astype("<i2").tobytes())


def beeps_in(audio: bytes) -> list[Beep]:
    detector, found = BeepDetector(), []
    for index, start in enumerate(range(0, len(audio), FRAME_BYTES)):
        beep = detector.push(audio[start : start + FRAME_BYTES], index * 0.02)
        if beep is not None:
            found.append(beep)
    return found


@pytest.mark.parametrize(
    ("hz", "ms"), [(440, 300), (850, 500), (1000, 1000), (1400, 200), (2000, 700)]
)
def test_a_beep_is_heard_with_its_tone_and_end(hz: float, ms: int) -> None:
    (beep,) = beeps_in(pcm(quiet(500), tones(hz, ms=ms), quiet(500)))
    assert abs(beep.frequency_hz - hz) < 5
    assert beep.duration_ms == ms
    assert abs(beep.ended_at - (0.5 + ms / 1000 - 0.02)) < 0.021  # its last frame


def test_a_beep_in_street_noise_is_heard() -> None:
    rng = np.random.default_rng(1)
    audio = np.concatenate([quiet(500), tones(1000, ms=500), quiet(500)])
    (beep,) = beeps_in(pcm(audio + rng.normal(0, 800, audio.size)))  # about 20 dB below it
    assert abs(beep.frequency_hz - 1000) < 5


@pytest.mark.parametrize(
    "sound",
    [
        pytest.param(tones(440, 480, ms=2000), id="US ringback"),
        pytest.param(tones(400, 450, ms=400), id="UK ringback"),
        pytest.param(tones(350, 440, ms=3000), id="dial tone"),
        pytest.param(tones(1000, ms=3000), id="a tone longer than a beep"),
        *(pytest.param(tones(low, high, ms=120), id=f"DTMF {low}+{high}")
          for low, high in ((697, 1209), (770, 1336), (852, 1477), (941, 1633))),
        pytest.param(tones(150, ms=1500, harmonics=HARMONICS), id="held vowel"),
        pytest.param(np.concatenate([
            tones(262, 330, 392, ms=300, harmonics=HARMONICS[:3]),
            tones(294, 370, 440, ms=300, harmonics=HARMONICS[:3]),
            tones(523, ms=300, harmonics=HARMONICS[:4]),
        ]), id="music"),
    ],
)  # fmt: skip
def test_what_is_not_a_beep(sound: np.ndarray) -> None:
    assert beeps_in(pcm(quiet(300), sound, quiet(300))) == []


def test_speech_is_not_a_beep() -> None:
    said = np.frombuffer(phone_audio("Hello, you have reached Sam. Please leave a message."), "<i2")
    speech = np.repeat(said.astype(np.float64), 2)  # 8 kHz, held at 16 kHz
    assert beeps_in(pcm(speech)) == []


def _greeting_end(audio: bytes) -> tuple[Pickup, float | None]:
    """A pickup fed ``audio`` from the answer on, on a test clock; when the greeting ended."""
    pickup = Pickup(PickupSettings(), clock=lambda: 0.0)
    for index, start in enumerate(range(0, len(audio), FRAME_BYTES)):
        at = (index + 1) * 0.02
        pickup.push(audio[start : start + FRAME_BYTES], at)
        if pickup.greeting_over:
            return pickup, at
    return pickup, None


@pytest.fixture(scope="module")
def greeting() -> np.ndarray:
    """Five seconds and more of a voicemail greeting (no pause of half a second)."""
    said = np.frombuffer(
        phone_audio("Hi, you have reached the voicemail of Sam Taylor, I cannot take your call."),
        "<i2",
    )
    return np.repeat(said.astype(np.float64), 2)


@pytest.mark.parametrize("pause_ms", [300, 1500])
def test_a_greeting_ends_as_its_beep_ends(greeting: np.ndarray, pause_ms: int) -> None:
    audio = pcm(greeting, quiet(pause_ms), tones(1000, ms=500), quiet(5000))
    pickup, over_at = _greeting_end(audio)
    beep_end = (greeting.size / SAMPLE_RATE) + (pause_ms + 500) / 1000
    assert pickup.verdict == "machine"
    assert pickup.over_by == "beep"
    assert over_at is not None
    assert beep_end <= over_at <= beep_end + 0.05


def test_a_greeting_without_a_beep_ends_after_the_silence(greeting: np.ndarray) -> None:
    pickup, over_at = _greeting_end(pcm(greeting, quiet(6000)))
    spoken = greeting.size / SAMPLE_RATE
    assert pickup.over_by == "silence"
    assert over_at is not None
    assert spoken + 2.5 <= over_at <= spoken + 2.7
