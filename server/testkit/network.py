"""A lossy, jittery network for a test caller's RTP: some packets never arrive, the others
arrive late by a varying delay (and so, past 20 ms of jitter, sometimes out of order), as on a
mobile or Wi-Fi call. Seeded, so a scenario meets the same losses every run."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LossyLine", "NetworkPath", "impair_dtls", "impair_rtp"]


@dataclass(frozen=True)
class NetworkPath:
    """What the network does to the caller's packets."""

    packet_loss: float = 0.0
    """The share of packets lost (0-0.5), each independently."""
    jitter_ms: int = 0
    """Each packet that arrives is delayed by 0 to this many milliseconds."""
    seed: int = 0


class LossyLine:
    """``sendto`` through a :class:`NetworkPath`: drops, and delays what it does not drop (on
    the running loop). ``sent`` and ``lost`` count the packets."""

    def __init__(self, send: Callable[[bytes, Any], None], path: NetworkPath) -> None:
        self._send = send
        self.path = path
        self._random = random.Random(path.seed)
        self.sent = 0
        self.lost = 0

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self.sent += 1
        if self._random.random() < self.path.packet_loss:
            self.lost += 1
            return
        delay = self._random.uniform(0, self.path.jitter_ms) / 1000
        if delay <= 0:
            self._send(data, addr)
            return
        asyncio.get_running_loop().call_later(delay, self._send, data, addr)


class _Through:
    """A datagram transport whose ``sendto`` goes through a :class:`LossyLine`."""

    def __init__(self, inner: Any, line: LossyLine) -> None:
        self._inner = inner
        self._line = line

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._line.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def impair_dtls(dtls_transport: Any, path: NetworkPath) -> LossyLine:
    """Send what an aiortc ``RTCDtlsTransport`` sends as RTP and RTCP (a WebRTC caller's
    audio) through ``path``; its data channel as it is."""
    send = dtls_transport._send_rtp
    line = LossyLine(lambda data, _addr: _spawn(send(data)), path)

    async def lossy(data: bytes) -> None:
        line.sendto(data)

    dtls_transport._send_rtp = lossy
    return line


_SENDS: set[asyncio.Task[None]] = set()


def _spawn(sending: Any) -> None:
    task = asyncio.ensure_future(sending)
    _SENDS.add(task)
    task.add_done_callback(_SENDS.discard)


def impair_rtp(rtp_session: Any, path: NetworkPath) -> LossyLine:
    """Send a started ``aiortp.RTPSession``'s RTP through ``path`` (its RTCP as it is)."""
    transport = rtp_session._rtp_transport
    inner = transport._transport

    def send(data: bytes, addr: Any) -> None:
        if not inner.is_closing():  # a packet still in flight when the call hung up is lost
            inner.sendto(data, addr)

    line = LossyLine(send, path)
    transport._transport = _Through(inner, line)
    return line
