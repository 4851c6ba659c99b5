"""Real speech and real models for the media tests, loaded once per test session.

Only ``media`` is imported here, so the media tests do not depend on the server or playbooks.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np

from media import Resampler, Synthesizer, SynthesizerSettings, Transcriber
from media.audio import FRAME_BYTES, SAMPLE_RATE
from media.turn_model import TurnModel


@functools.cache
def synthesizer() -> Synthesizer:
    """The product's Piper voice without sampling noise: a phrase sounds the same in every test
    session, so a test that passes once does not fail on the next session's take of it (with
    noise, the pause after "Stop," in "Stop, stop, that is enough." ranges over 300-440 ms,
    and past 400 ms it ends a turn)."""
    return Synthesizer.load(SynthesizerSettings(deterministic=True))


@functools.cache
def transcriber() -> Transcriber:
    return Transcriber.load()


@functools.cache
def turn_model() -> TurnModel:
    """The bundled audio end-of-turn model, loaded once per test process, as servers do."""
    return TurnModel.load()


def to_16k(pcm: bytes, rate: int, channels: int = 1) -> bytes:
    resampler = Resampler(rate, SAMPLE_RATE, channels)
    return resampler.resample(pcm) + resampler.flush()


def whole_frames(pcm: bytes) -> bytes:
    return pcm[: len(pcm) // FRAME_BYTES * FRAME_BYTES]


@functools.cache
def piper_speech(text: str) -> bytes:
    """``text`` spoken by the product's Piper voice (deterministic), 16 kHz PCM16 cut to whole
    20 ms frames."""
    tts = synthesizer()
    return whole_frames(to_16k(tts.synthesize_all(text), tts.sample_rate))


def espeak_wav(text: str, path: Path, *args: str) -> tuple[bytes, int]:
    """``text`` spoken by espeak-ng into the WAV ``path``: (PCM16 mono, sample rate)."""
    espeak = shutil.which("espeak-ng")
    assert espeak is not None, "espeak-ng is required: apt-get install espeak-ng"
    subprocess.run(
        [espeak, *args, "-w", str(path), text], check=True, capture_output=True, timeout=60
    )
    with wave.open(str(path), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return wav.readframes(wav.getnframes()), wav.getframerate()


def tone(
    rate: int, ms: float, frequency: float = 440.0, amplitude: float = 0.5, channels: int = 1
) -> bytes:
    """A sine tone as interleaved PCM16 (the same signal on every channel)."""
    t = np.arange(int(rate * ms / 1000)) / rate
    samples = np.round(amplitude * 32767 * np.sin(2 * np.pi * frequency * t)).astype(np.int16)
    return np.repeat(samples, channels).tobytes()


def peak_frequency(pcm: bytes, rate: int) -> float:
    """The strongest frequency of PCM16 mono, interpolated between FFT bins."""
    x = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    k = int(np.argmax(spectrum[1:-1])) + 1
    a, b, c = np.log(spectrum[k - 1 : k + 2] + 1e-12)
    return float((k + 0.5 * (a - c) / (a - 2 * b + c)) * rate / x.size)


def white_noise(ms: float, dbfs: float, seed: int = 7) -> bytes:
    """Gaussian white noise at 16 kHz with an RMS level of ``dbfs``."""
    rng = np.random.default_rng(seed)
    samples = rng.standard_normal(int(SAMPLE_RATE * ms / 1000))
    samples *= 32768 * 10 ** (dbfs / 20) / np.sqrt(np.mean(samples * samples))
    return np.clip(np.round(samples), -32768, 32767).astype(np.int16).tobytes()


_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]


def words(text: str) -> list[str]:
    """Lower-case words without punctuation; small numbers spelled out ("4" -> "four")."""
    found = re.findall(r"[a-z0-9']+", text.lower())
    return [_NUMBER_WORDS[int(w)] if w.isdigit() and int(w) <= 20 else w for w in found]


def word_error_rate(heard: str, expected: str) -> float:
    """Word-level edit distance divided by the expected number of words."""
    hyp, ref = words(heard), words(expected)
    previous = list(range(len(ref) + 1))
    for i, word in enumerate(hyp, 1):
        current = [i]
        for j, target in enumerate(ref, 1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != target))
            )
        previous = current
    return previous[-1] / max(1, len(ref))
