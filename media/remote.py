"""Speech recognition and synthesis on a remote OpenAI-compatible audio server.

When one machine's CPUs cannot carry Whisper and Piper for all its calls, a GPU box serving
``/v1/audio/transcriptions`` and ``/v1/audio/speech`` (speaches, faster-whisper-server, vLLM, or
OpenAI itself) can. :class:`RemoteTranscriber` and :class:`RemoteSynthesizer` keep the contracts of
:class:`~media.stt.SpeechToText` and :class:`~media.tts.TextToSpeech` through the ``openai``
client. Every failure (refused connection, timeout, an error status after the client's retries, a
malformed answer) raises :class:`RemoteInferenceError`, which a call handles like a local engine's
failure: an ``error`` event and, where speech still works, the spoken fallback line.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import wave
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import openai
from openai.types.audio import TranscriptionVerbose

from .audio import SAMPLE_RATE, duration_ms, silence
from .stt import Segment, Transcript, screen
from .tts import PIECE_MS, VoiceSettings
from .wavstream import StreamDecoder

__all__ = [
    "RemoteInferenceError",
    "RemoteSynthesizer",
    "RemoteSynthesizerSettings",
    "RemoteTranscriber",
    "RemoteTranscriberSettings",
]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
"""A GPU box that does not accept the connection this soon is treated as down."""


class RemoteInferenceError(RuntimeError):
    """A remote audio endpoint failed; the message names the endpoint (without credentials) and
    the cause, never the API key."""


@dataclass(frozen=True)
class RemoteTranscriberSettings:
    base_url: str
    """OpenAI-compatible base URL, e.g. ``http://gpu-host:8000/v1``."""
    model: str = "whisper-1"
    api_key: str | None = field(default=None, repr=False)
    """Bearer token; None sends a placeholder (self-hosted servers need none)."""
    language: str | None = "en"
    response_format: Literal["verbose_json", "json"] = "verbose_json"
    """``verbose_json`` brings segment confidences, so noise is dropped as with local Whisper;
    ``json`` for servers that only give the text."""
    timeout_s: float = 10.0
    """The whole transcription, retries included (a server's long ``Retry-After`` fails it)."""
    retries: int = 1
    """Retries of refused connections, 408/409/429 and 5xx (after about 0.5 s)."""
    max_no_speech_prob: float = 0.6
    min_avg_logprob: float = -1.0


@dataclass(frozen=True)
class RemoteSynthesizerSettings:
    base_url: str
    """OpenAI-compatible base URL, e.g. ``http://gpu-host:8000/v1``."""
    model: str = "tts-1"
    voice: str = "alloy"
    api_key: str | None = field(default=None, repr=False)
    """Bearer token; None sends a placeholder (self-hosted servers need none)."""
    speed: float | None = None
    """Speaking rate sent as ``speed`` (1 is the voice's own pace, 0.25 to 4); None sends none."""
    response_format: Literal["pcm", "wav"] = "pcm"
    """``pcm``: headerless PCM16 mono at :attr:`sample_rate` (OpenAI's is 24 kHz); ``wav``: any
    PCM16 WAV, resampled to :attr:`sample_rate`."""
    sample_rate: int = 24_000
    """The rate :meth:`RemoteSynthesizer.synthesize` yields, and that of ``pcm`` answers."""
    timeout_s: float = 10.0
    """Until the answer starts, retries included; then between two reads of its audio."""
    retries: int = 1
    """Retries of refused connections, 408/409/429 and 5xx before the answer starts."""


class RemoteTranscriber:
    """Transcription of 16 kHz PCM16 utterances by ``POST {base_url}/audio/transcriptions``
    (sent as 16 kHz mono WAV). Any number of requests may be in flight; the server queues them."""

    def __init__(self, settings: RemoteTranscriberSettings) -> None:
        self.settings = settings
        self.endpoint = redact(settings.base_url)
        self._client = _client(settings)

    async def transcribe(
        self, pcm: bytes, *, slack_s: float = 0.0, owner: object = None
    ) -> Transcript:
        """The utterance's words, screened for noise like local Whisper's; ``compute_ms`` is the
        round trip. Raises :class:`RemoteInferenceError`; cancelling aborts the request. Sent
        at once whatever ``slack_s`` and ``owner``: the remote server orders its own work."""
        started = time.perf_counter()
        settings = self.settings
        try:
            async with asyncio.timeout(settings.timeout_s):
                decoded = await self._request(pcm)
        except Exception as exc:
            raise _failure("speech recognition", self.endpoint, exc) from exc
        return screen(
            decoded,
            duration_ms(pcm),
            (time.perf_counter() - started) * 1000,
            max_no_speech_prob=settings.max_no_speech_prob,
            min_avg_logprob=settings.min_avg_logprob,
        )

    async def _request(self, pcm: bytes) -> Sequence[Segment] | str:
        settings = self.settings
        audio = ("utterance.wav", _wav(pcm), "audio/wav")
        language = settings.language or openai.omit
        if settings.response_format == "verbose_json":
            verbose = await self._client.audio.transcriptions.create(
                model=settings.model,
                file=audio,
                language=language,
                response_format="verbose_json",
                temperature=0.0,
            )
            return _segments(verbose)
        plain = await self._client.audio.transcriptions.create(
            model=settings.model,
            file=audio,
            language=language,
            response_format="json",
            temperature=0.0,
        )
        return str(plain.text)

    async def warm_up(self) -> bool:
        """Transcribe half a second of silence (a server may load its model on first use);
        False, with a warning logged, when the endpoint fails."""
        try:
            await self.transcribe(silence(500))
        except RemoteInferenceError as exc:
            log.warning("%s; calls will get the fallback until it answers", exc)
            return False
        return True

    @property
    def backlog(self) -> None:
        """Not told: the remote engine queues decodes its own way."""
        return None

    def has_idle_worker(self, *, besides: object = None) -> None:
        """Not told, as :attr:`backlog`."""
        return None

    async def aclose(self) -> None:
        await self._client.close()


class RemoteSynthesizer:
    """Synthesis by ``POST {base_url}/audio/speech``, streamed: audio is handed on as it
    arrives, so the first piece plays long before the server has finished the sentence.

    :meth:`variant` gives the same endpoint speaking in another of its voices or at another
    rate (a playbook stage's ``voice``), over the same connections.
    """

    def __init__(
        self, settings: RemoteSynthesizerSettings, *, _shared: openai.AsyncOpenAI | None = None
    ) -> None:
        self.settings = settings
        self.sample_rate: int = settings.sample_rate
        self.endpoint = redact(settings.base_url)
        self._owns_client = _shared is None
        self._client = _client(settings) if _shared is None else _shared
        self._variants: dict[VoiceSettings, RemoteSynthesizer] = {}

    @property
    def voice_id(self) -> str:
        """The remote voice it speaks in (``voice``)."""
        return self.settings.voice

    def variant(self, settings: VoiceSettings) -> RemoteSynthesizer:
        """This endpoint speaking as ``settings.name`` (default: its own voice) at
        ``settings.speaking_rate`` (sent as ``speed``). A Piper voice file or speaker number
        cannot travel to a remote engine: they are ignored, with a warning."""
        found = self._variants.get(settings)
        if found is not None:
            return found
        if settings.model is not None or settings.speaker is not None:
            log.warning(
                "remote speech at %s cannot use a Piper voice file or speaker; voice %s "
                "speaks as %r",
                self.endpoint,
                settings.model or f"speaker {settings.speaker}",
                settings.name or self.settings.voice,
            )
        changed = replace(
            self.settings,
            voice=settings.name or self.settings.voice,
            speed=settings.speaking_rate or self.settings.speed,
        )
        found = self._variants[settings] = RemoteSynthesizer(changed, _shared=self._client)
        return found

    async def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncGenerator[bytes, None]:
        """PCM16 mono at :attr:`sample_rate` in pieces of at most ``PIECE_MS``, as the answer
        streams in (``urgent`` and ``slack_s`` change nothing: the server schedules its own
        work). Raises :class:`RemoteInferenceError` (possibly after some audio, if the stream
        breaks); closing the generator or cancelling its consumer aborts the request."""
        if not text.strip():
            return
        settings = self.settings
        decoder = StreamDecoder(settings.response_format, self.sample_rate)
        piece_bytes = self.sample_rate * PIECE_MS // 1000 * 2
        started = time.perf_counter()
        first_ms: float | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                opening = self._client.audio.speech.with_streaming_response.create(
                    model=settings.model,
                    voice=settings.voice,
                    input=text,
                    response_format=settings.response_format,
                    speed=openai.omit if settings.speed is None else settings.speed,
                )
                async with asyncio.timeout(settings.timeout_s):
                    response = await stack.enter_async_context(opening)
                async for data in response.iter_bytes():
                    pcm = decoder.feed(data)
                    if pcm and first_ms is None:
                        first_ms = (time.perf_counter() - started) * 1000
                    for start in range(0, len(pcm), piece_bytes):
                        yield pcm[start : start + piece_bytes]
            tail = decoder.finish()
        except Exception as exc:
            raise _failure("speech synthesis", self.endpoint, exc) from exc
        for start in range(0, len(tail), piece_bytes):
            yield tail[start : start + piece_bytes]
        log.debug(
            "remote synthesis of %d characters: first audio %s ms, done in %.0f ms",
            len(text),
            "-" if first_ms is None else f"{first_ms:.0f}",
            (time.perf_counter() - started) * 1000,
        )

    async def warm_up(self) -> bool:
        """Synthesize one word (a server may load its voice on first use); False, with a
        warning logged, when the endpoint fails."""
        try:
            async for _ in self.synthesize("Hello."):
                pass
        except RemoteInferenceError as exc:
            log.warning("%s; calls will stay silent until it answers", exc)
            return False
        return True

    @property
    def backlog(self) -> None:
        """Not told: the remote engine queues syntheses its own way."""
        return None

    async def aclose(self) -> None:
        """Close the connections (a variant leaves them to the engine it came from)."""
        if self._owns_client:
            await self._client.close()


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` part, for logs and error messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _client(settings: RemoteTranscriberSettings | RemoteSynthesizerSettings) -> openai.AsyncOpenAI:
    timeout_s = settings.timeout_s
    return openai.AsyncOpenAI(
        base_url=settings.base_url,
        api_key=settings.api_key or "unused",  # never OPENAI_API_KEY: that one is the LLM's
        timeout=openai.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s)),
        max_retries=settings.retries,
    )


def _failure(what: str, endpoint: str, exc: Exception) -> RemoteInferenceError:
    if isinstance(exc, RemoteInferenceError):
        return exc
    if isinstance(exc, (openai.APITimeoutError, TimeoutError)):
        cause = "timed out"
    elif isinstance(exc, openai.APIConnectionError):
        cause = f"cannot connect ({exc.__cause__ or exc})"
    elif isinstance(exc, openai.APIStatusError):
        cause = f"HTTP {exc.status_code}: {exc.message}"
    else:
        cause = f"{type(exc).__name__}: {exc}"
    return RemoteInferenceError(f"remote {what} at {endpoint} failed: {cause}")


def _wav(pcm: bytes) -> bytes:
    """16 kHz PCM16 mono -> a WAV file's bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(pcm)
    return out.getvalue()


@dataclass(frozen=True)
class _RemoteSegment:
    text: str
    avg_logprob: float
    no_speech_prob: float


def _segments(verbose: TranscriptionVerbose) -> Sequence[Segment] | str:
    """The segments of a ``verbose_json`` answer, or its bare text when a server leaves out the
    segments or their confidences."""
    text = str(verbose.text or "")
    if not verbose.segments:
        return text
    try:
        return [
            _RemoteSegment(str(s.text), float(s.avg_logprob), float(s.no_speech_prob))
            for s in verbose.segments
        ]
    except (AttributeError, TypeError, ValueError):
        return text
