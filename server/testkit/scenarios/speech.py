"""The caller's side of a spoken scenario: lines made into 16 kHz PCM16 speech.

Piper speaks with the bundled voice, deterministic (the same line is the same audio on every
run, so a scenario that passes once does not fail on the next take of its pauses); espeak-ng,
where installed, gives a voice unlike the agent's. ``...`` inside a line is a pause: Piper says
the line whole, and the pause goes into the word break that Piper's own phoneme alignments
place after the word, so the voice runs on through it as a hesitating caller's does (rather
than falling at the end of a phrase said alone). espeak-ng says the pieces one by one.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import threading
import wave
from pathlib import Path
from typing import Any

from media import Resampler
from media.audio import FRAME_BYTES, SAMPLE_RATE, silence
from media.tts import default_piper_voice

from .model import CallerVoice, Impairments

__all__ = [
    "CallerSpeech",
    "SpeechError",
    "aligned_speech",
    "aligned_voice",
    "hesitant_piper",
    "impaired",
    "read_wav",
    "to_rate",
]

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


def impaired(pcm: bytes, impairments: Impairments | None, *, seed: int = 0) -> bytes:
    """A caller line as the line delivers it: ``noise`` under it (at its SNR), then through
    G.711 if asked; unchanged without impairments (echo is the line's, not the line's audio)."""
    from ..impairments import g711, mix_at_snr, noise

    if impairments is None:
        return pcm
    if impairments.noise is not None:
        background = noise(impairments.noise.kind, len(pcm) // 32 + 20, seed=seed)
        pcm = mix_at_snr(pcm, background, impairments.noise.snr_db)
    if impairments.g711:
        pcm = g711(pcm)
    return _whole_frames(pcm)


class CallerSpeech:
    """Makes caller lines into speech; thread-safe, each (line, voice) made once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def speak(self, text: str, voice: CallerVoice, pause_ms: int = 300) -> bytes:
        """``text`` in ``voice`` as 16 kHz PCM16 (whole 20 ms frames); each ``...`` a pause of
        ``pause_ms``. Blocking (tens of ms a sentence): make lines before a call starts, or in
        a worker thread."""
        parts = [part.strip() for part in text.split(PAUSE)]
        parts = [part for part in parts if part]
        if not parts:
            raise SpeechError(f"nothing to say in {text!r}")
        with self._lock:
            if voice.engine == "piper":
                return hesitant_piper(tuple(parts), voice.speed, pause_ms)
            pieces: list[bytes] = []
            for n, part in enumerate(parts):
                if n:
                    pieces.append(silence(pause_ms))
                pieces.append(_espeak(part, voice.espeak_voice, voice.speed))
            return b"".join(pieces)


@functools.lru_cache(maxsize=512)
def hesitant_piper(parts: tuple[str, ...], speed: float = 1.0, pause_ms: int = 300) -> bytes:
    """``parts`` said by Piper as one line, with ``pause_ms`` of silence in the word break
    after each part but the last (16 kHz PCM16, whole frames); deterministic."""
    voice, config = aligned_voice(speed)
    text = " ".join(parts)
    words_before = [len(" ".join(parts[: n + 1]).split()) for n in range(len(parts) - 1)]
    pcm, rate, word_ends = aligned_speech(voice, config, text)
    gap = bytes(pause_ms * rate // 1000 * 2)
    cuts = [word_ends[n - 1] * 2 for n in words_before if 0 < n <= len(word_ends)]
    pieces, start = [], 0
    for cut in cuts:
        pieces += [pcm[start:cut], gap]
        start = cut
    pieces.append(pcm[start:])
    return _whole_frames(to_rate(b"".join(pieces), rate, SAMPLE_RATE))


def aligned_speech(voice: Any, config: Any, text: str) -> tuple[bytes, int, list[int]]:
    """``text`` said whole by an aligned Piper voice with a ``SynthesisConfig`` (see
    :func:`aligned_voice`): its PCM16 at the voice's rate, the rate, and the sample at which
    each word (as spaces split ``text``) ends: where the word break after it begins (a space
    phoneme), or the end of a sentence. Not the middle of the break: that already holds the
    lead-in of the next word, faint but enough for Whisper to hear it ("Friday at eight, for"
    cut there was heard as "... for two.", a finished line)."""
    pcm = b""
    ends: list[int] = []
    offset = 0
    for chunk in voice.synthesize(text, config, include_alignments=True):
        position = offset
        in_word = False
        for alignment in chunk.phoneme_alignments or []:
            samples = int(alignment.num_samples)
            if alignment.phoneme == " " and in_word:
                ends.append(position)
                in_word = False
            elif alignment.phoneme not in "^$_ ":
                in_word = True
            position += samples
        if in_word:
            ends.append(position)
        pcm += chunk.audio_int16_bytes
        offset += len(chunk.audio_int16_bytes) // 2
    return pcm, voice.config.sample_rate, ends


@functools.cache
def aligned_voice(speed: float = 1.0, *, noiseless: bool = True) -> tuple[Any, Any]:
    """The bundled Piper voice, patched to report each phoneme's samples, and its settings
    at ``speed`` for :func:`aligned_speech`: noiseless (the same line is the same audio every
    time), or with Piper's own sampling noise (a natural take)."""
    from piper import PiperVoice, SynthesisConfig

    model, config = default_piper_voice()
    voice = PiperVoice.load(model, config_path=config, include_alignments=True)
    length_scale = round(voice.config.length_scale / speed, 3)
    noise = 0.0 if noiseless else None
    settings = SynthesisConfig(length_scale=length_scale, noise_scale=noise, noise_w_scale=noise)
    return voice, settings


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
