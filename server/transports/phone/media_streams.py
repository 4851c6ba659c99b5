"""``/twilio/media``: calls arriving as Twilio Media Streams (also Telnyx's dialect).

Protocol (JSON text messages over a WebSocket): in ``connected``, ``start`` (stream id, custom
parameters, media format), ``media`` (base64 mu-law 8 kHz), ``dtmf``, ``mark``, ``stop``; out
``media``, ``mark`` and ``clear``. Vocable paces its media at real time, sends a ``mark`` as each
sentence starts playing (the phone echoes it when playback reaches it) and ``clear`` on barge-in,
so the phone drops what it buffered. Telnyx sends the same events (its stream id may be named
``stream_id``); A-law streams (``mediaFormat.encoding: audio/x-alaw``) are accepted too.

A ``start`` that does not fit the protocol (a ``sampleRate`` that is not a whole number of Hz in
8000-48000, ``customParameters`` that are not an object, a ``playbook`` parameter that is not a
string...) ends the stream before any call starts: :class:`BadStart`, and the socket is closed with
1008 and the reason. Messages over MAX_MESSAGE_BYTES close it with 1009; other malformed messages
are ignored. Calls end like every other call on idle timeout and at the maximum length
(:class:`CallClock`): the socket is closed with 1000 and the reason.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from typing import Annotated, Any

from aiohttp import WSMsgType, web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from playbooks.transfer import TransferOutcome, TransferRequest
from server.call.events import VoiceEvent
from server.call.recordings import wants_recording
from server.call.session import Session
from server.runtime.registry import CallRegistry

from .audio import Encoding, encode
from .line import PhoneCall
from .provider_transfer import dial_twiml, transfer_by_api

__all__ = ["MAX_MESSAGE_BYTES", "BadStart", "TwilioCall", "close_reason", "serve_media_stream"]

log = logging.getLogger(__name__)

PHONE_RATE = 8000
START_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest WebSocket message taken from the phone (a 20 ms media message is about 250 bytes)."""
MIN_RATE, MAX_RATE = 8000, 48000
_ENCODINGS: dict[str, Encoding] = {"audio/x-mulaw": "ulaw", "audio/x-alaw": "alaw"}


class BadStart(ValueError):
    """The ``start`` message does not fit the protocol; the message says where and why."""


class _MediaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    encoding: str | None = None
    sampleRate: Annotated[int, Field(ge=MIN_RATE, le=MAX_RATE)] | None = None


class _Parameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    playbook: str | None = None


class _StartDetails(BaseModel):
    model_config = ConfigDict(extra="ignore")
    streamSid: str | None = None
    accountSid: str | None = None
    callSid: str | None = None
    customParameters: _Parameters | None = None
    mediaFormat: _MediaFormat | None = None


class _Start(BaseModel):
    """What Vocable reads of a ``start`` message; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    streamSid: str | None = None
    stream_id: str | None = None
    start: _StartDetails | None = None


def _validate_start(data: dict[str, Any]) -> _Start:
    """The ``start`` message, checked; raises BadStart naming the first field at fault."""
    try:
        return _Start.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "start"
        problem = "must be an object" if first["type"] == "model_type" else first["msg"]
        raise BadStart(f"invalid start message: {where}: {problem}") from None


def close_reason(text: str) -> bytes:
    """``text`` as a WebSocket close reason: at most 123 bytes of UTF-8, cut between
    characters."""
    return text.encode()[:123].decode(errors="ignore").encode()


async def serve_media_stream(
    ws: web.WebSocketResponse, registry: CallRegistry, playbook: str | None, *, record: bool = True
) -> None:
    """Serve one media stream on an open WebSocket until it stops (recorded with ``--record``
    unless ``record`` is False or the ``start`` has a custom parameter ``record: off``); raises
    BadStart, OverCapacity or UnknownPlaybook before the call starts (the caller then closes
    the socket)."""
    start = await _wait_for_start(ws)
    if start is None:
        return
    details = start.start or _StartDetails()
    stream_sid = start.streamSid or start.stream_id or details.streamSid or ""
    parameters = details.customParameters or _Parameters()
    media_format = details.mediaFormat or _MediaFormat()
    encoding = _ENCODINGS.get(media_format.encoding or "", "ulaw")
    rate = media_format.sampleRate or PHONE_RATE
    asked = (parameters.model_extra or {}).get("record")

    def build(call_id: str, session: Session) -> TwilioCall:
        call = TwilioCall(ws, registry, call_id, session, stream_sid, encoding, rate)
        call.account_sid, call.call_sid = details.accountSid or "", details.callSid or ""
        return call

    call = registry.open(
        build,
        rate=rate,
        playbook=parameters.playbook or playbook,
        record=record and wants_recording(asked if isinstance(asked, str) else None),
    )
    await call.run()


class TwilioCall(PhoneCall):
    """One media stream whose ``start`` has arrived."""

    transport = "media stream"

    def __init__(
        self,
        ws: web.WebSocketResponse,
        registry: CallRegistry,
        call_id: str,
        session: Session,
        stream_sid: str,
        encoding: Encoding,
        rate: int,
    ) -> None:
        super().__init__(registry, call_id, session, encoding, rate)
        self.ws = ws
        self.stream_sid = stream_sid
        self.marks_sent: list[str] = []
        self.marks_played: list[str] = []
        self._encoding = encoding
        self._send_lock = asyncio.Lock()
        self.account_sid = ""
        self.call_sid = ""
        """The provider's ids of the phone call (from ``start``), for transfers by its API."""

    async def run(self) -> None:
        """Serve the stream until the phone stops it or the call is hung up; returns once the
        call has ended."""
        self.start_media(self._send_media)
        try:
            self.session.start()
            await self._receive()
        finally:
            await self.hangup("stream ended")
            await self.ended.wait()  # the watchdog may be hanging up: let it finish

    async def close_transport(self, reason: str) -> None:
        """The socket closed (1000, ``reason``), which ends the stream at the phone."""
        if not self.ws.closed:
            await self.ws.close(message=close_reason(reason))

    def on_event(self, event: VoiceEvent) -> None:
        if event.type == "agent_sentence":
            name = f"sentence-{len(self.marks_sent) + 1}"
            self.marks_sent.append(name)
            self._spawn_send(
                {"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}}
            )

    def transfer_problem(self, request: TransferRequest) -> str | None:
        return None

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        """A ``transfer`` event on the stream (with the TwiML that dials the destination), then,
        with ``--transfer-api-url``, the provider's API (:mod:`.provider_transfer`); once the
        provider took the call, the stream is closed. Without the API nothing confirms that the
        platform acts on the event (Twilio ignores it): the outcome is ``requested`` and the
        call stays up until the platform moves or ends it."""
        twiml = dial_twiml(request)
        details = {"to": request.destination, "mode": request.mode, "twiml": twiml}
        await self._send({"event": "transfer", "streamSid": self.stream_sid, "transfer": details})
        api, http = self.registry.config.transfer_api, self.registry.http
        if api is None or http is None:  # only a platform that acts on the event moves the call
            return TransferOutcome.requested("stream event")
        outcome = await transfer_by_api(http, api, self.account_sid, self.call_sid, request)
        if outcome.ok:
            self.spawn(self.hangup(f"transferred to {request.destination}"), "transferred")
        return outcome

    def agent_cleared(self) -> None:
        """The platform drops the audio it buffered too (a ``clear`` message)."""
        self._spawn_send({"event": "clear", "streamSid": self.stream_sid})

    async def _receive(self) -> None:
        async for message in self.ws:
            data = _parse(message)
            if data is None:
                continue
            event = data.get("event")
            if event == "media":
                self._on_media(_object(data, "media"))
            elif event == "dtmf":
                digit = _object(data, "dtmf").get("digit")
                if isinstance(digit, str):
                    self.heard_signal()
                    self.clock.touch()
                    self.session.dtmf(digit)
            elif event == "mark":
                name = _object(data, "mark").get("name")
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
        self.hear(payload)

    async def _send_media(self, pcm: bytes) -> None:
        payload = base64.b64encode(encode(pcm, self._encoding)).decode()
        await self._send(
            {"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}}
        )

    def _spawn_send(self, message: dict[str, Any]) -> None:
        self.spawn(self._send(message), "twilio-send")

    async def _send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:  # media and control messages keep their order (FIFO lock)
            if self.ws.closed:
                return
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(message))


async def _wait_for_start(ws: web.WebSocketResponse) -> _Start | None:
    """The ``start`` message, or None if the stream stopped or never started; raises BadStart."""
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            async for message in ws:
                data = _parse(message)
                if data is None:
                    continue
                if data.get("event") == "start":
                    return _validate_start(data)
                if data.get("event") == "stop":
                    return None
    except TimeoutError:
        log.warning("a media stream sent no start message within %.0f s", START_TIMEOUT_S)
    return None


def _object(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data[key]`` if it is a JSON object, else an empty one."""
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _parse(message: Any) -> dict[str, Any] | None:
    if message.type != WSMsgType.TEXT or len(message.data) > MAX_MESSAGE_BYTES:
        return None
    try:
        data = json.loads(message.data)
    except (ValueError, RecursionError):  # RecursionError: nesting thousands deep
        return None
    return data if isinstance(data, dict) else None
