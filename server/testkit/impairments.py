"""What real calls do to a caller's audio, made on purpose: background noise at a chosen
signal-to-noise ratio, and phone impairments (G.711). For scenario tests and the harness's
noisy corpus; 16 kHz PCM16 in and out, deterministic for a given seed.

Noise kinds:

- ``babble``: four voices talking at once, none of them the caller's (espeak-ng voices, other
  sentences), the hardest: it is speech;
- ``street``: pink noise with passing swells and short knocks;
- ``car``: low, steady rumble (brown noise under 300 Hz) with engine hum.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from media.audio import SAMPLE_RATE
from media.g711 import alaw_to_pcm, pcm_to_alaw

from .scenarios.speech import to_rate

__all__ = [
    "NOISE_KINDS",
    "NoiseKind",
    "at_level",
    "g711",
    "mix_at_snr",
    "noise",
    "speech_level_dbfs",
]

NoiseKind = Literal["babble", "street", "car"]
NOISE_KINDS: tuple[NoiseKind, ...] = ("babble", "street", "car")

_BABBLE_LINES = (
    ("en-gb", "The weather has been dreadful all week, and the trains were late again."),
    ("en-us+f3", "I told her we would meet at the station around half past seven tonight."),
    ("en-sc", "Did you see the match on Saturday? They played much better in the second half."),
    ("en-us+m7", "We should order more paper for the printer before the end of the month."),
    ("en-gb+f4", "My sister moved to a new flat near the river, with a lovely little garden."),
    ("en-us+m3", "The meeting went on for hours and nobody agreed on anything at all."),
)


def speech_level_dbfs(pcm: bytes) -> float:
    """The level of speech: the RMS, in dBFS, of its 20 ms frames louder than 40 dB below its
    loudest (pauses left out)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    frames = samples[: len(samples) // 320 * 320].reshape(-1, 320)
    power = (frames**2).mean(axis=1)
    loud = power[power > power.max() * 1e-4]
    return float(10 * np.log10(loud.mean() / 32768.0**2)) if loud.size else float("-inf")


def noise(kind: NoiseKind, duration_ms: int, seed: int = 0) -> bytes:
    """``duration_ms`` of noise of ``kind`` (16 kHz PCM16, about -30 dBFS)."""
    samples = duration_ms * SAMPLE_RATE // 1000
    rng = np.random.default_rng(seed)
    if kind == "babble":
        wave_ = _babble(samples, rng)
    elif kind == "street":
        wave_ = _street(samples, rng)
    elif kind == "car":
        wave_ = _car(samples, rng)
    else:
        raise ValueError(f"unknown noise {kind!r}; one of {', '.join(NOISE_KINDS)}")
    return _scaled(wave_, -30.0)


def mix_at_snr(speech: bytes, background: bytes, snr_db: float, lead_ms: int = 0) -> bytes:
    """``speech`` over ``background`` (looped or cut to cover it, starting ``lead_ms`` before
    the speech, which is delayed as much), the background scaled so that the speech's level
    is ``snr_db`` above it."""
    if not -10.0 <= snr_db <= 60.0:
        raise ValueError(f"an SNR of {snr_db} dB is out of range (-10 to 60 dB)")
    lead = bytes(lead_ms * SAMPLE_RATE // 1000 * 2)
    voice = np.frombuffer(lead + speech, dtype="<i2").astype(np.float64)
    behind = np.frombuffer(background, dtype="<i2").astype(np.float64)
    if behind.size == 0:
        raise ValueError("no background to mix")
    behind = np.resize(behind, voice.size)
    gain_db = speech_level_dbfs(speech) - snr_db - _rms_dbfs(behind)
    mixed = voice + behind * 10 ** (gain_db / 20)
    return np.clip(mixed, -32768, 32767).astype("<i2").tobytes()


def at_level(pcm: bytes, dbfs: float) -> bytes:
    """``pcm`` scaled so that :func:`speech_level_dbfs` of it is ``dbfs``."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    gain = 10 ** ((dbfs - speech_level_dbfs(pcm)) / 20)
    return np.clip(samples * gain, -32768, 32767).astype("<i2").tobytes()


def g711(pcm: bytes) -> bytes:
    """``pcm`` as a phone line carries it: to 8 kHz, A-law and back, to 16 kHz."""
    narrow = to_rate(pcm, SAMPLE_RATE, 8000)
    return to_rate(alaw_to_pcm(pcm_to_alaw(narrow)), 8000, SAMPLE_RATE)


def _rms_dbfs(samples: NDArray[np.float64]) -> float:
    power = float((samples**2).mean())
    return 10 * np.log10(power / 32768.0**2) if power > 0 else float("-inf")


def _scaled(samples: NDArray[np.float64], dbfs: float) -> bytes:
    gain = 10 ** ((dbfs - _rms_dbfs(samples)) / 20)
    return np.clip(samples * gain, -32768, 32767).astype("<i2").tobytes()


def _babble(samples: int, rng: np.random.Generator) -> NDArray[np.float64]:
    total = np.zeros(samples)
    picks = rng.choice(len(_BABBLE_LINES), size=4, replace=False)
    for pick in picks:
        voice, line = _BABBLE_LINES[pick]
        talk = np.frombuffer(_espeak(voice, line), dtype="<i2").astype(np.float64)
        talk = np.roll(np.resize(talk, samples), int(rng.integers(0, max(1, talk.size))))
        total += talk / (np.sqrt((talk**2).mean()) + 1e-9)
    return total


def _street(samples: int, rng: np.random.Generator) -> NDArray[np.float64]:
    white = rng.normal(size=samples)
    pink = _pink(white)
    swell = 1 + 0.6 * np.sin(2 * np.pi * np.arange(samples) / (SAMPLE_RATE * 3.7)) ** 2
    knocks = np.zeros(samples)
    for at in rng.integers(0, samples, size=max(1, samples // (SAMPLE_RATE * 2))):
        length = min(samples - at, SAMPLE_RATE // 50)
        knocks[at : at + length] += rng.normal(size=length) * np.exp(-np.arange(length) / 40) * 4
    street: NDArray[np.float64] = pink * swell + knocks
    return street


def _car(samples: int, rng: np.random.Generator) -> NDArray[np.float64]:
    brown = np.cumsum(rng.normal(size=samples))
    brown -= np.convolve(brown, np.ones(801) / 801, mode="same")  # no drift
    rumble = _lowpass(brown, 300)
    t = np.arange(samples) / SAMPLE_RATE
    hum = 0.4 * np.sin(2 * np.pi * 55 * t) + 0.2 * np.sin(2 * np.pi * 110 * t)
    car: NDArray[np.float64] = rumble / (np.sqrt((rumble**2).mean()) + 1e-9) + hum
    return car


def _pink(white: NDArray[np.float64]) -> NDArray[np.float64]:
    spectrum = np.fft.rfft(white)
    freqs = np.fft.rfftfreq(white.size, 1 / SAMPLE_RATE)
    spectrum[1:] /= np.sqrt(freqs[1:])
    spectrum[0] = 0
    return np.fft.irfft(spectrum, white.size)


def _lowpass(samples: NDArray[np.float64], cutoff_hz: float) -> NDArray[np.float64]:
    spectrum = np.fft.rfft(samples)
    spectrum[np.fft.rfftfreq(samples.size, 1 / SAMPLE_RATE) > cutoff_hz] = 0
    return np.fft.irfft(spectrum, samples.size)


@functools.lru_cache(maxsize=16)
def _espeak(voice: str, text: str) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError("babble needs espeak-ng (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory(prefix="vocable-babble-") as folder:
        out = Path(folder) / "voice.wav"
        subprocess.run(
            [espeak, "-v", voice, "-s", "165", "-w", str(out), text],
            check=True,
            capture_output=True,
            timeout=60,
        )
        with wave.open(str(out), "rb") as wav:
            pcm, rate = wav.readframes(wav.getnframes()), wav.getframerate()
    return to_rate(pcm, rate, SAMPLE_RATE)
