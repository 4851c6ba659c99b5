"""A stand-in GPU inference box: OpenAI-compatible audio endpoints on 127.0.0.1 running the real
local Whisper and Piper (the same models a GPU server would run, here on this CPU).

``POST /v1/audio/transcriptions`` takes the multipart form the ``openai`` client sends (``file``,
``model``, ``language``, ``response_format`` json or verbose_json, ``temperature``).
``POST /v1/audio/speech`` takes the JSON body (``model``, ``input``, ``voice``, ``speed``,
``response_format`` pcm or wav) and streams the audio in chunked encoding as Piper produces it:
``pcm`` at 24 kHz as OpenAI sends it, ``wav`` at Piper's own rate with a streaming header.
Every request is recorded; ``fail_next`` answers the next requests with error statuses.
"""

from __future__ import annotations

import io
import struct
import time
import wave
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from media import Resampler, Synthesizer, Transcriber
from media.tts import TextToSpeech, VoiceSettings
from server.testkit.loopback import LoopbackServer
from tests.support.speech import to_16k

__all__ = ["AudioApiServer", "RecordedRequest"]

PCM_RATE = 24_000


@dataclass
class RecordedRequest:
    path: str
    fields: dict[str, Any]
    """Form fields (the file's size under ``file_bytes``) or the JSON body."""
    authorization: str | None
    audio_writes: list[float] = field(default_factory=list)
    """``time.perf_counter()`` of each audio chunk a speech answer wrote."""


class AudioApiServer(LoopbackServer):
    """``async with AudioApiServer(transcriber, synthesizer) as server:`` then point clients at
    ``server.base_url``."""

    client_max_size = 32 * 1024 * 1024

    def __init__(self, transcriber: Transcriber, synthesizer: Synthesizer) -> None:
        super().__init__()
        self.transcriber = transcriber
        self.synthesizer = synthesizer
        self.requests: list[RecordedRequest] = []
        self._failures: list[tuple[int, dict[str, str]]] = []

    def fail_next(self, *statuses: int, retry_after_s: int | None = None) -> None:
        """Answer the next ``len(statuses)`` requests with these error statuses (and a
        ``Retry-After`` header when given)."""
        headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
        self._failures.extend((status, headers) for status in statuses)

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        app.router.add_post("/v1/audio/speech", self._speech)

    def _record(self, request: web.Request, fields: dict[str, Any]) -> RecordedRequest:
        recorded = RecordedRequest(request.path, fields, request.headers.get("Authorization"))
        self.requests.append(recorded)
        return recorded

    def _failure(self) -> web.Response | None:
        if not self._failures:
            return None
        status, headers = self._failures.pop(0)
        return _error(status, f"scripted status {status}", headers)

    async def _transcribe(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            return _error(400, "file is required")
        data = upload.file.read()
        fields: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
        fields["file_bytes"] = len(data)
        self._record(request, fields)
        if (failure := self._failure()) is not None:
            return failure
        try:
            with wave.open(io.BytesIO(data), "rb") as wav:
                rate, channels = wav.getframerate(), wav.getnchannels()
                pcm = wav.readframes(wav.getnframes())
        except (wave.Error, EOFError) as exc:
            return _error(400, f"not a WAV file: {exc}")
        heard = await self.transcriber.transcribe(to_16k(pcm, rate, channels))
        if fields.get("response_format", "json") == "json":
            return web.json_response({"text": heard.text})
        seconds = len(pcm) / 2 / channels / rate
        segments = []
        if heard.text:
            segments.append(
                {
                    "id": 0,
                    "seek": 0,
                    "start": 0.0,
                    "end": seconds,
                    "text": f" {heard.text}",
                    "tokens": [],
                    "temperature": 0.0,
                    "avg_logprob": heard.avg_logprob,
                    "compression_ratio": 1.0,
                    "no_speech_prob": heard.no_speech_prob,
                }
            )
        body = {"task": "transcribe", "language": "english", "duration": seconds}
        return web.json_response({**body, "text": heard.text, "segments": segments})

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        recorded = self._record(request, body)
        if (failure := self._failure()) is not None:
            return failure
        audio_format = body.get("response_format", "mp3")
        if audio_format not in ("pcm", "wav") or not body.get("input"):
            return _error(400, f"this server speaks pcm or wav, not {audio_format!r}")
        rate = self.synthesizer.sample_rate
        resampler = Resampler(rate, PCM_RATE) if audio_format == "pcm" else None
        response = web.StreamResponse(headers={"Content-Type": f"audio/{audio_format}"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(data: bytes) -> None:
            if data:
                await response.write(data)
                recorded.audio_writes.append(time.perf_counter())

        if resampler is None:
            await response.write(_streaming_wav_header(rate))
        async for piece in self._voice(body.get("speed")).synthesize(str(body["input"])):
            await send(resampler.resample(piece) if resampler else piece)
        if resampler is not None:
            await send(resampler.flush())
        await response.write_eof()
        return response

    def _voice(self, speed: object) -> TextToSpeech:
        """Piper at ``speed`` (one Piper voice is installed: every ``voice`` name speaks in it)."""
        if isinstance(speed, (int, float)) and speed != 1:
            return self.synthesizer.variant(VoiceSettings(speaking_rate=float(speed)))
        return self.synthesizer


def _streaming_wav_header(rate: int) -> bytes:
    """A PCM16 mono WAV header whose sizes say "unknown" (2^32 - 1), as streaming servers do."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", unknown)
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": None}},
        status=status,
        headers=headers,
    )
