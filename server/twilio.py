"""``/twilio/media``: calls arriving as Twilio Media Streams (also Telnyx's dialect).

Protocol (JSON text messages over a WebSocket): in ``connected``, ``start`` (stream id, custom
parameters, media format), ``media`` (base64 mu-law 8 kHz), ``dtmf``, ``mark``, ``stop``; out
``media``, ``mark`` and ``clear``. Vocable paces its media at real time, sends a ``mark`` as each
sentence starts playing (the phone echoes it when playback reaches it) and ``clear`` on barge-in,
so the phone drops what it buffered. Telnyx sends the same events (its stream id may be named
``stream_id``); A-law streams (``mediaFormat.encoding: audio/x-alaw``) are accepted too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import WSMsgType, web

from media import Speaker

from .events import VoiceEvent
from .registry import CallRegistry
from .session import Session
from .telephony import CallerAudio, CallerGap, Encoding, FramePacer, encode

__all__ = ["TwilioCall", "serve_media_stream"]

log = logging.getLogger(__name__)

PHONE_RATE = 8000
START_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 * 1024
_ENCODINGS: dict[str, Encoding] = {"audio/x-mulaw": "ulaw", "audio/x-alaw": "alaw"}


async def serve_media_stream(
    ws: web.WebSocketResponse, registry: CallRegistry, playbook: str | None
) -> None:
    """Serve one media stream on an open WebSocket until it stops; raises OverCapacity or
    UnknownPlaybook before the call starts (the socket is then closed by the caller)."""
    start = await _wait_for_start(ws)
    if start is None:
        return
    stream_sid, details = start
    call_id = registry.new_call_id()
    parameters = details.get("customParameters") or {}
    playbook_id = registry.playbook_id(parameters.get("playbook") or playbook)
    media_format = details.get("mediaFormat") or {}
    encoding = _ENCODINGS.get(str(media_format.get("encoding", "")), "ulaw")
    rate = int(media_format.get("sampleRate") or PHONE_RATE)
    speaker = Speaker(rate)
    call = TwilioCall(ws, registry, call_id, stream_sid, encoding, rate)
    call.session = registry.new_session(call_id, playbook_id, speaker, call.emit)
    speaker.on_clear.append(call.on_clear)
    registry.admit(call)
    await call.run()


class TwilioCall:
    """One media stream whose ``start`` has arrived."""

    session: Session

    def __init__(
        self,
        ws: web.WebSocketResponse,
        registry: CallRegistry,
        call_id: str,
        stream_sid: str,
        encoding: Encoding,
        rate: int,
    ) -> None:
        self.ws = ws
        self.registry = registry
        self.id = call_id
        self.stream_sid = stream_sid
        self.ended = asyncio.Event()
        self.marks_sent: list[str] = []
        self.marks_played: list[str] = []
        self._encoding = encoding
        self._audio = CallerAudio(encoding, rate)
        self._send_lock = asyncio.Lock()
        self._sending: set[asyncio.Task[None]] = set()
        self._closed = False

    async def run(self) -> None:
        gap = self._gap = CallerGap(self.session.feed)
        pacer = FramePacer(self.session.voice.speaker, self._send_media, on_tick=gap.tick)
        pacing = asyncio.create_task(pacer.run(), name=f"twilio-pacer:{self.id}")
        try:
            self.session.start()
            await self._receive()
        finally:
            pacing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pacing
            await self.hangup("stream ended")

    async def hangup(self, reason: str) -> None:
        """End the call (idempotent); the socket is closed, which ends the stream at the phone."""
        if self._closed:
            return
        self._closed = True
        await self.session.close()
        self.registry.release(self, reason)
        if not self.ws.closed:
            await self.ws.close()
        self.ended.set()

    def emit(self, event: VoiceEvent) -> None:
        if event.type == "agent_sentence":
            name = f"sentence-{len(self.marks_sent) + 1}"
            self.marks_sent.append(name)
            self._spawn_send(
                {"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}}
            )

    def on_clear(self) -> None:
        self._spawn_send({"event": "clear", "streamSid": self.stream_sid})

    async def _receive(self) -> None:
        async for message in self.ws:
            data = _parse(message)
            if data is None:
                continue
            event = data.get("event")
            if event == "media":
                self._on_media(data.get("media") or {})
            elif event == "dtmf":
                digit = (data.get("dtmf") or {}).get("digit")
                if isinstance(digit, str):
                    self.session.dtmf(digit)
            elif event == "mark":
                name = (data.get("mark") or {}).get("name")
                if isinstance(name, str):
                    self.marks_played.append(name)
            elif event == "stop":
                return

    def _on_media(self, media: dict[str, Any]) -> None:
        if media.get("track", "inbound") not in ("inbound", "inbound_track"):
            return
        try:
            payload = base64.b64decode(str(media.get("payload", "")), validate=True)
        except (binascii.Error, ValueError):
            log.warning("call %s: undecodable media payload ignored", self.id)
            return
        now = time.monotonic()
        self._gap.heard()
        for frame in self._audio.frames(payload):
            self.session.feed(frame, now)

    async def _send_media(self, pcm: bytes) -> None:
        payload = base64.b64encode(encode(pcm, self._encoding)).decode()
        await self._send(
            {"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}}
        )

    def _spawn_send(self, message: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(message))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:  # media and control messages keep their order (FIFO lock)
            if self.ws.closed:
                return
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(message))


async def _wait_for_start(ws: web.WebSocketResponse) -> tuple[str, dict[str, Any]] | None:
    """The stream id and ``start`` details, or None if the stream stopped or never started."""
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            async for message in ws:
                data = _parse(message)
                if data is None:
                    continue
                if data.get("event") == "start":
                    details = data.get("start")
                    sid = data.get("streamSid") or data.get("stream_id") or ""
                    if not sid and isinstance(details, dict):
                        sid = details.get("streamSid") or ""
                    return str(sid), details if isinstance(details, dict) else {}
                if data.get("event") == "stop":
                    return None
    except TimeoutError:
        log.warning("a media stream sent no start message within %.0f s", START_TIMEOUT_S)
    return None


def _parse(message: Any) -> dict[str, Any] | None:
    if message.type != WSMsgType.TEXT or len(message.data) > MAX_MESSAGE_BYTES:
        return None
    try:
        data = json.loads(message.data)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
