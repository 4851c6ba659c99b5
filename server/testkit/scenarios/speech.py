"""The caller's side of a spoken scenario: lines made into 16 kHz PCM16 speech.

Piper speaks with the bundled voice, deterministic (the same line is the same audio on every
run, so a scenario that passes once does not fail on the next take of its pauses); espeak-ng,
where installed, gives a voice unlike the agent's. ``...`` inside a line is a pause.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import threading
import wave
from pathlib import Path

from media import Resampler, Synthesizer, SynthesizerSettings
from media.audio import FRAME_BYTES, SAMPLE_RATE, silence

from .model import CallerVoice

__all__ = ["CallerSpeech", "SpeechError", "read_wav", "to_rate"]

PAUSE = "..."


class SpeechError(RuntimeError):
    """A caller line could not be made into speech (a missing engine, an unreadable WAV)."""


def to_rate(pcm: bytes, rate: int, out_rate: int) -> bytes:
    """Mono PCM16 from ``rate`` to ``out_rate``."""
    if rate == out_rate:
        return pcm
    resampler = Resampler(rate, out_rate, 1)
    return resampler.resample(pcm) + resampler.flush()


def _whole_frames(pcm: bytes) -> bytes:
    return pcm[: len(pcm) // FRAME_BYTES * FRAME_BYTES]


def read_wav(path: Path) -> bytes:
    """A mono PCM16 WAV file as 16 kHz PCM16 in whole 20 ms frames; raises SpeechError."""
    try:
        with wave.open(str(path), "rb") as wav:
            if (wav.getnchannels(), wav.getsampwidth()) != (1, 2):
                raise SpeechError(f"{path.name}: a caller WAV must be mono 16-bit PCM")
            pcm, rate = wav.readframes(wav.getnframes()), wav.getframerate()
    except (OSError, EOFError, wave.Error) as exc:
        raise SpeechError(f"{path.name}: cannot read the WAV file: {exc}") from None
    return _whole_frames(to_rate(pcm, rate, SAMPLE_RATE))


class CallerSpeech:
    """Makes caller lines into speech; thread-safe, each (line, voice) made once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def speak(self, text: str, voice: CallerVoice, pause_ms: int = 300) -> bytes:
        """``text`` in ``voice`` as 16 kHz PCM16 (whole 20 ms frames); each ``...`` a pause of
        ``pause_ms``. Blocking (tens of ms a sentence): make lines before a call starts, or in
        a worker thread."""
        parts = [part.strip() for part in text.split(PAUSE)]
        pieces: list[bytes] = []
        for n, part in enumerate(p for p in parts if p):
            if n:
                pieces.append(silence(pause_ms))
            pieces.append(self._phrase(part, voice))
        if not pieces:
            raise SpeechError(f"nothing to say in {text!r}")
        return b"".join(pieces)

    def _phrase(self, text: str, voice: CallerVoice) -> bytes:
        with self._lock:
            if voice.engine == "espeak":
                return _espeak(text, voice.espeak_voice, voice.speed)
            return _piper(text, voice.speed)


@functools.cache
def _piper_voice(speed: float) -> Synthesizer:
    settings = SynthesizerSettings(deterministic=True, length_scale=round(1 / speed, 3))
    return Synthesizer.load(settings)


@functools.lru_cache(maxsize=512)
def _piper(text: str, speed: float) -> bytes:
    voice = _piper_voice(speed)
    return _whole_frames(to_rate(voice.synthesize_all(text), voice.sample_rate, SAMPLE_RATE))


@functools.lru_cache(maxsize=512)
def _espeak(text: str, name: str, speed: float) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SpeechError("the espeak voice needs espeak-ng (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory(prefix="vocable-caller-") as folder:
        out = Path(folder) / "line.wav"
        words_per_minute = str(round(175 * speed))
        try:
            subprocess.run(
                [espeak, "-v", name, "-s", words_per_minute, "-w", str(out), text],
                check=True,
                capture_output=True,
                timeout=60,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            raise SpeechError(f"espeak-ng failed: {exc}") from None
        return read_wav(out)
