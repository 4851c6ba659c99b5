"""Asterisk AudioSocket over TCP (``--audiosocket HOST:PORT``, loopback unless configured).

Framing: one byte of kind, two bytes of big-endian length, then the payload. Kinds: ``0x00``
hang-up, ``0x01`` the channel's 16-byte UUID, ``0x03`` a DTMF digit (one ASCII byte), ``0x10``
signed linear 16-bit audio at 8 kHz, ``0x12`` the same at 16 kHz, ``0xff`` an error. Vocable
answers in the caller's format, pacing its own 20 ms frames, and sends nothing while quiet (so a
barge-in stops its audio at once). A call ends on the peer's hang-up or error, READ_TIMEOUT_S
without any message, and like every other call on idle timeout and at the maximum length
(:class:`CallClock`): Vocable then sends a hang-up message and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from server.call.session import Session
from server.runtime.registry import CallRegistry, OverCapacity

from .line import PhoneCall

__all__ = ["AudioSocketCall", "AudioSocketServer", "frame_message", "read_message"]

log = logging.getLogger(__name__)

HANGUP, UUID, DTMF, SLIN_8K, SLIN_16K, ERROR = 0x00, 0x01, 0x03, 0x10, 0x12, 0xFF
RATES = {SLIN_8K: 8000, SLIN_16K: 16000}
READ_TIMEOUT_S = 30.0


def frame_message(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > 0xFFFF:
        raise ValueError("an AudioSocket payload holds at most 65535 bytes")
    return bytes([kind]) + len(payload).to_bytes(2, "big") + payload


async def read_message(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next (kind, payload); raises IncompleteReadError when the peer closes."""
    header = await reader.readexactly(3)
    payload = await reader.readexactly(int.from_bytes(header[1:3], "big"))
    return header[0], payload


class AudioSocketCall(PhoneCall):
    """One AudioSocket connection whose channel UUID and first audio have arrived."""

    transport = "AudioSocket"

    def __init__(
        self,
        registry: CallRegistry,
        writer: asyncio.StreamWriter,
        call_id: str,
        session: Session,
        channel: uuid.UUID,
        kind: int,
    ) -> None:
        super().__init__(registry, call_id, session, "slin", RATES[kind])
        self.writer = writer
        self.channel = channel
        self.kind = kind

    async def run(self, reader: asyncio.StreamReader, first_audio: bytes) -> None:
        """Serve the call until it ends, whoever ends it; returns once it has ended."""
        self.start_media(self._send_audio)
        reason = "caller hung up"
        try:
            self.session.start()
            self.hear(first_audio)
            while True:
                kind, payload = await asyncio.wait_for(read_message(reader), READ_TIMEOUT_S)
                if kind in RATES:
                    self.hear(payload)
                elif kind == DTMF and payload:
                    self.heard_signal()
                    self.clock.touch()
                    self.session.dtmf(chr(payload[0]))
                elif kind == HANGUP:
                    break
                elif kind == ERROR:
                    reason = f"peer error {payload[:1].hex()}"
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            reason = "connection closed"
        except TimeoutError:
            reason = "no audio from the peer"
        finally:
            await self.hangup(reason)
            await self.ended.wait()  # the watchdog may be hanging up: let it finish

    async def _send_audio(self, pcm: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame_message(self.kind, pcm))
            await self.writer.drain()

    async def close_transport(self, reason: str) -> None:
        """A hang-up message to the peer, then the connection closed."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            if not self.writer.is_closing():
                self.writer.write(frame_message(HANGUP))
                await self.writer.drain()
            self.writer.close()


class AudioSocketServer:
    """Accepts AudioSocket connections and runs each as a call of ``registry``."""

    def __init__(self, registry: CallRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sockets = self._server.sockets
        if sockets and self.port == 0:
            self.port = int(sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            opened = await self._open(reader, writer)
            if opened is not None:
                call, first_audio = opened
                await call.run(reader, first_audio)
        except Exception:
            log.exception("AudioSocket connection failed")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _open(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[AudioSocketCall, bytes] | None:
        """Read the UUID and the first audio (its kind tells the rate): the admitted call and
        that audio; None if the peer hangs up, is refused, or sends something else first."""
        try:
            kind, payload = await asyncio.wait_for(read_message(reader), READ_TIMEOUT_S)
            if kind != UUID or len(payload) != 16:
                writer.write(frame_message(ERROR, b"\x01"))
                return None
            channel = uuid.UUID(bytes=payload)
            while True:
                kind, payload = await asyncio.wait_for(read_message(reader), READ_TIMEOUT_S)
                if kind in RATES:
                    break
                if kind in (HANGUP, ERROR):
                    return None
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return None
        try:
            call = self.registry.open(
                lambda call_id, session: AudioSocketCall(
                    self.registry, writer, call_id, session, channel, kind
                ),
                rate=RATES[kind],
            )
        except OverCapacity as exc:
            log.warning("AudioSocket call %s refused: %s", channel, exc)
            writer.write(frame_message(HANGUP))
            return None
        log.info("AudioSocket call %s: channel %s", call.id, channel)
        return call, payload
