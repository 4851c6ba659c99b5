"""Browser calls: one :class:`WebRTCCall` per peer connection, kept by the call registry.

A call owns its ``RTCPeerConnection``, its :class:`Session` and the ``events`` data channel. It
starts listening (and greets) once ICE connects, and ends on hang-up, peer failure, no connection
within CONNECT_TIMEOUT_S, caller audio stopped for ``--webrtc-media-timeout-s`` (a peer that
vanished without a word: ICE would take about half a minute to notice), idle timeout or maximum
duration, freeing everything; other calls are unaffected. Whatever a client sends (an SDP aiortc
chokes on, any data-channel message) is refused with a clear message and never takes the call,
or the server, down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)

from server.call.events import VoiceEvent
from server.call.keypad import DTMF_DIGITS
from server.call.session import Session
from server.runtime.registry import CallRegistry
from server.transports.base import TransportCall
from server.transports.client_events import client_view

from .inbound import hear_promptly
from .tracks import (
    OUTPUT_RATE,
    OpusPackets,
    SpeakerTrack,
    caller_frames,
    negotiated_opus,
)

__all__ = ["BadOffer", "WebRTCCall", "open_webrtc_call"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024
"""Largest data-channel message taken from a client (a typed turn is sent on to the LLM)."""
MAX_DTMF_DIGITS = 32
"""Most keypad digits one ``dtmf`` message may carry."""
CONNECT_TIMEOUT_S = 30.0
"""A call whose peer connection is not up this long after the answer is hung up (the peer
vanished, or its offer was one aiortc accepted but cannot connect)."""
CLOSE_TIMEOUT_S = 10.0
HANGUP_NOTICE_TIMEOUT_S = 3.0
"""How long a hang-up waits for the events channel to carry its ``hangup`` event: a call hung up
while its peer is still connecting (``DELETE`` right after the offer) waits for the channel to
open, so the client learns why its call ended instead of seeing it drop."""


class BadOffer(ValueError):
    """The SDP offer cannot be used; the message says why."""


class WebRTCCall(TransportCall):
    """One browser call. Create through :func:`open_webrtc_call`."""

    transport = "WebRTC"

    def __init__(
        self, registry: CallRegistry, call_id: str, session: Session, pc: RTCPeerConnection
    ) -> None:
        super().__init__(registry, call_id, session)
        self.pc = pc
        self._channel: RTCDataChannel | None = None
        self._outbox: list[str] = []
        self._caller: MediaStreamTrack | None = None
        self._listening = False
        self._connected = asyncio.Event()
        self._channel_open = asyncio.Event()
        self._heard_at = time.monotonic()
        """When the caller's last audio frame arrived."""
        self._peer_gone = False
        """Set when the caller vanished: nothing more is sent to it."""
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    async def accept(self, offer_sdp: str) -> str:
        """Apply the offer and return the answer SDP with all ICE candidates (non-trickle);
        raises BadOffer. The call hangs up by itself unless connected within
        CONNECT_TIMEOUT_S."""
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        except OSError:
            raise
        except Exception as exc:  # aiortc raises ValueError, AssertionError... on bad SDP
            raise BadOffer(f"cannot use this SDP offer: {_reason(exc)}") from exc
        if self._caller is None:
            raise BadOffer("the offer carries no audio track")
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind == "audio":
                hear_promptly(transceiver.receiver)
        speaker = SpeakerTrack(self.session.voice.speaker)
        self.pc.addTrack(speaker)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except OSError:  # gathering candidates failed: ours, not the offer's
            raise
        except Exception as exc:  # an offer aiortc took but cannot answer (e.g. a lost a=mid)
            raise BadOffer(f"cannot answer this SDP offer: {_reason(exc)}") from exc
        if negotiated_opus(self.pc.localDescription.sdp):
            speaker.opus = OpusPackets()
        self.spawn(self._connect_deadline(), "connect-deadline")
        return str(self.pc.localDescription.sdp)

    async def _connect_deadline(self) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            await self.hangup(f"not connected within {CONNECT_TIMEOUT_S:.0f} s")

    # -- events to the client ----------------------------------------------------------------

    def on_event(self, event: VoiceEvent) -> None:
        self._send(client_view(event))

    def _send(self, payload: dict[str, Any]) -> None:
        """Send ``payload`` on the events channel, or keep it until the channel opens. Nothing
        is sent once the connection is gone: aiortc would send from a task of its own, whose
        failure nobody could retrieve."""
        if self._peer_gone or self.pc.connectionState in ("failed", "closed"):
            return
        text = json.dumps(payload, ensure_ascii=False)
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)
        elif channel is None or channel.readyState == "connecting":
            self._outbox.append(text)

    # -- peer connection callbacks ------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._caller is None:
            self._caller = track

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != "events":
            return
        self._channel = channel
        channel.on("message", self._on_message)

        def flush() -> None:
            outbox, self._outbox = self._outbox, []
            for text in outbox:
                channel.send(text)
            self._channel_open.set()

        channel.on("open", flush)
        if channel.readyState == "open":
            flush()

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self._connected.set()
        if (
            state == "connected"
            and not self._listening
            and not self.hung_up
            and self._caller is not None
        ):
            self._listening = True
            self._heard_at = time.monotonic()
            self.spawn(self._listen(self._caller), "listen")
            self.watch(self._media_silent)
        elif state in ("failed", "closed"):
            if state == "failed" and self.session.busy and not self.hung_up:
                self.session.voice.emit(
                    "error", source="transport", message="the connection failed mid-turn"
                )
            await self.hangup(f"connection {state}")

    def _on_message(self, message: str | bytes) -> None:
        """A client message; whatever it holds, the answer is at most one ``error`` event. An
        exception escaping here would end aiortc's receive loop: the call would go deaf."""
        try:
            problem = self._take(message)
        except Exception:
            log.exception("call %s: data-channel message not handled", self.id)
            problem = "the server could not handle this message"
        if problem is not None:
            self._send({"type": "error", "source": "client", "message": problem})

    def _take(self, message: str | bytes) -> str | None:
        """Act on a client message; returns what is wrong with it, if anything."""
        if isinstance(message, bytes) or len(message.encode()) > MAX_MESSAGE_BYTES:
            return "message too large or binary"
        try:
            data = json.loads(message)
            kind = data["type"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return "expected a JSON object with a type"
        self.clock.touch()
        if kind == "hangup":
            self.spawn(self.hangup("caller hung up"), "hangup")
        elif kind == "text":
            text = data.get("text")
            if not isinstance(text, str) or not text.strip():
                return 'a "text" message needs a non-empty "text" string'
            self.session.submit_text(text.strip()[:2000])
        elif kind == "mute":
            if not isinstance(data.get("muted"), bool):
                return 'a "mute" message needs "muted": true or false'
            self.session.muted = data["muted"]
        elif kind == "dtmf":
            digits = data.get("digits")
            problem = _dtmf_problem(digits)
            if problem is not None:
                return problem
            for digit in digits:  # as a phone's RFC 4733 digits, in order
                self.session.dtmf(digit)
        else:
            shown = repr(kind) if len(repr(kind)) <= 60 else repr(kind)[:57] + "..."
            return f"unsupported message {shown}"
        return None

    # -- lifecycle -----------------------------------------------------------------------------

    async def _listen(self, track: MediaStreamTrack) -> None:
        await self.session.run(self._heard(caller_frames(track)))
        await self.hangup("caller audio ended")

    async def _heard(self, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for frame in frames:
            self._heard_at = time.monotonic()
            yield frame

    def _media_silent(self, now: float) -> str | None:
        """The watchdog's check: the caller's audio stopped (browsers send it without pause)."""
        timeout = self.registry.config.webrtc_media_timeout_s
        if now - self._heard_at < timeout:
            return None
        self._peer_gone = True
        return f"media_timeout: no audio from the caller for {timeout:g} s"

    def ending(self, reason: str) -> None:
        with contextlib.suppress(Exception):  # the channel may be failing with the call
            self._send({"type": "hangup", "reason": reason})

    @property
    def close_in_background(self) -> bool:
        """A hang-up right after the offer waits, in the background, up to
        HANGUP_NOTICE_TIMEOUT_S for the events channel to open and carry the ``hangup``
        event, so the client learns why its call ended instead of seeing it drop."""
        return not self._channel_open.is_set()

    async def close_transport(self, reason: str) -> None:
        await self._deliver_events()
        await _close_peer(self.pc, self.id)

    async def _deliver_events(self) -> None:
        """Wait (up to HANGUP_NOTICE_TIMEOUT_S) until the events sent so far have left: the
        channel opened and its send buffer drained. Returns at once when the peer is gone."""
        if (
            self.pc.localDescription is None
            or self.pc.connectionState in ("failed", "closed")
            or self._peer_gone
        ):
            return  # no answer was given, or the peer is gone: nobody can hear it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HANGUP_NOTICE_TIMEOUT_S):
                await self._channel_open.wait()
                channel = self._channel
                if channel is None or channel.bufferedAmount <= channel.bufferedAmountLowThreshold:
                    return
                drained = asyncio.Event()
                channel.once("bufferedamountlow", drained.set)
                await drained.wait()


def _dtmf_problem(digits: object) -> str | None:
    """What is wrong with a ``dtmf`` message's ``digits``, or None: 1 to MAX_DTMF_DIGITS keypad
    characters (0-9, *, #, A-D)."""
    if not isinstance(digits, str) or not digits:
        return 'a "dtmf" message needs a non-empty "digits" string'
    if len(digits) > MAX_DTMF_DIGITS:
        return f'a "dtmf" message carries at most {MAX_DTMF_DIGITS} digits'
    wrong = next((c for c in digits if c not in DTMF_DIGITS), None)
    if wrong is not None:
        shown = repr(wrong) if wrong.isprintable() else f"U+{ord(wrong):04X}"
        return f"not a keypad digit: {shown} (0-9, *, #, A-D)"
    return None


def _reason(exc: Exception) -> str:
    return str(exc) or f"malformed SDP ({type(exc).__name__})"


async def _close_peer(pc: RTCPeerConnection, call_id: str) -> None:
    """``pc.close()``; when aiortc fails half-way (it can, after an offer it half took), stop
    the transports it did not reach, so their sockets are not left open."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await pc.close()
        return
    except Exception as exc:
        log.warning("call %s: closing the peer connection failed: %r", call_id, exc)
    dtls = [transceiver.receiver.transport for transceiver in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls.append(pc.sctp.transport)
    for transport in dtls:
        if transport is None:
            continue
        with contextlib.suppress(Exception):
            await transport.stop()
        with contextlib.suppress(Exception):
            await transport.transport.stop()


async def open_webrtc_call(
    registry: CallRegistry,
    offer_sdp: str,
    playbook: str | None,
    address: str | None = None,
    *,
    record: bool = True,
) -> WebRTCCall:
    """A new browser call answering ``offer_sdp`` from ``address`` (the caller's, for the rate
    limit), recorded with ``--record`` unless ``record`` is False; raises BadOffer,
    OverCapacity, RateLimited, UnknownPlaybook. A refused call opens no socket."""
    if "m=audio" not in offer_sdp:
        raise BadOffer("the offer has no audio (no m=audio line)")
    ice = [RTCIceServer(s.urls, s.username, s.credential) for s in registry.config.ice_servers]

    def build(call_id: str, session: Session) -> WebRTCCall:
        # a peer connection opens no socket before its descriptions are set
        pc = RTCPeerConnection(RTCConfiguration(iceServers=ice))
        return WebRTCCall(registry, call_id, session, pc)

    call = registry.open(
        build,
        rate=OUTPUT_RATE,
        playbook=playbook,
        address=address,
        record=record,
        line="browser",
    )
    try:
        await call.accept(offer_sdp)
    except BaseException:
        await call.hangup("offer rejected")
        raise
    return call
