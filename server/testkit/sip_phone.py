"""A scriptable SIP phone for tests: hand-written SIP requests over UDP (so tests can send anything,
including malformed messages), aiortp for the call's RTP (G.711, RFC 4733 digits)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from dataclasses import dataclass, field

from aiortp import RTPSession
from aiosipua import SipMessage, SipRequest, SipResponse, parse_sdp

from media.audio import pcm_rms_dbfs

__all__ = ["Heard", "SipPhone", "offer_sdp"]

PHONE_RATE = 8000
FRAME_BYTES = 320  # 20 ms of 8 kHz PCM16


def offer_sdp(
    rtp_port: int, payload_types: tuple[int, ...] = (0, 101), direction: str = "sendrecv"
) -> str:
    names = {0: "PCMU/8000", 8: "PCMA/8000", 9: "G722/8000", 101: "telephone-event/8000"}
    lines = [
        "v=0",
        "o=phone 1 1 IN IP4 127.0.0.1",
        "s=-",
        "c=IN IP4 127.0.0.1",
        "t=0 0",
        f"m=audio {rtp_port} RTP/AVP {' '.join(map(str, payload_types))}",
        *(f"a=rtpmap:{pt} {names[pt]}" for pt in payload_types),
        "a=ptime:20",
        f"a={direction}",
    ]
    return "\r\n".join(lines) + "\r\n"


@dataclass
class Heard:
    """What the phone received: PCM and the arrival time and level of every packet."""

    pcm: bytearray = field(default_factory=bytearray)
    packets: list[tuple[float, float]] = field(default_factory=list)  # (arrival, dBFS)

    def add(self, pcm: bytes) -> None:
        self.pcm += pcm
        self.packets.append((time.monotonic(), pcm_rms_dbfs(pcm)))

    def loud_between(self, start: float, end: float) -> list[float]:
        return [at for at, dbfs in self.packets if start < at < end and dbfs > -45]

    def count_between(self, start: float, end: float) -> int:
        return sum(1 for at, _ in self.packets if start < at < end)


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.inbox: asyncio.Queue[SipMessage] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None
        self.requests_from: list[tuple[str, tuple[str, int]]] = []
        """(method, source address) of every request received."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        with contextlib.suppress(ValueError):
            message = SipMessage.parse(data)
            if isinstance(message, SipRequest):
                self.requests_from.append((message.method, (addr[0], addr[1])))
            self.inbox.put_nowait(message)


async def _rtp_session(payload_type: int) -> tuple[int, RTPSession]:
    """An RTP session on a free port pair of 127.0.0.1 (RTCP takes the port above)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1]) & ~1
        try:
            session = await RTPSession.create(
                local_addr=("127.0.0.1", port),
                remote_addr=("127.0.0.1", 9),
                payload_type=payload_type,
                dtmf_payload_type=101,
            )
        except OSError:
            continue
        return port, session
    raise OSError("no free RTP port pair")


class SipPhone:
    """One caller at ``127.0.0.1:server_port``; build with :meth:`open`, end with :meth:`close`."""

    def __init__(self, server_port: int, endpoint: _Endpoint, port: int) -> None:
        self.server = ("127.0.0.1", server_port)
        self.endpoint = endpoint
        self.port = port
        self.call_id = secrets.token_hex(8)
        self.tag = secrets.token_hex(4)
        self.cseq = 0
        self.remote_tag = ""
        self.rtp: RTPSession | None = None
        self.rtp_port = 0
        self._next_timestamp = 0
        self.heard = Heard()
        self.last_invite_branch = ""
        self.route_set: list[str] = []
        """The Record-Route of the call's answer, reversed (a proxy on the way: RFC 3261
        12.1.2); in-dialog requests then go to the answer's Contact through these routes."""
        self.remote_target = ""

    @classmethod
    async def open(cls, server_port: int) -> SipPhone:
        loop = asyncio.get_running_loop()
        transport, endpoint = await loop.create_datagram_endpoint(
            _Endpoint, local_addr=("127.0.0.1", 0)
        )
        port = int(transport.get_extra_info("sockname")[1])
        return cls(server_port, endpoint, port)

    # -- signalling ----------------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        assert self.endpoint.transport is not None
        self.endpoint.transport.sendto(data, self.server)

    def request(
        self,
        method: str,
        user: str = "support",
        body: str = "",
        *,
        cseq: int | None = None,
        branch: str | None = None,
        extra: str = "",
        content_type: str = "application/sdp",
    ) -> str:
        """Send a request in this phone's dialog; returns its Via branch."""
        if cseq is None:
            self.cseq += 1
            cseq = self.cseq
        hop_by_hop = method == "ACK" and branch is not None  # the ACK of a failed INVITE
        branch = branch or "z9hG4bK" + secrets.token_hex(6)
        to_tag = f";tag={self.remote_tag}" if self.remote_tag and method != "INVITE" else ""
        if method == "INVITE" and self.remote_tag:
            to_tag = f";tag={self.remote_tag}"  # re-INVITE
        content = f"Content-Type: {content_type}\r\n" if body else ""
        target = f"sip:{user}@127.0.0.1:{self.server[1]}"
        if self.route_set and self.remote_tag and not hop_by_hop:
            target = self.remote_target  # in the dialog, through the proxy's recorded route
            extra = "".join(f"Route: {route}\r\n" for route in self.route_set) + extra
        text = (
            f"{method} {target} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch={branch};rport\r\n"
            f"From: <sip:phone@127.0.0.1:{self.port}>;tag={self.tag}\r\n"
            f"To: <sip:{user}@127.0.0.1:{self.server[1]}>{to_tag}\r\n"
            f"Call-ID: {self.call_id}\r\n"
            f"CSeq: {cseq} {method}\r\n"
            f"Contact: <sip:phone@127.0.0.1:{self.port}>\r\n"
            f"Max-Forwards: 70\r\n{extra}{content}"
            f"Content-Length: {len(body.encode())}\r\n\r\n{body}"
        )
        self.send_raw(text.encode())
        return branch

    async def response(self, timeout_s: float = 5.0, final: bool = True) -> SipResponse:
        """The next response in this phone's call (the next final one when ``final``); others
        (answers to messages a test sent with :meth:`send_raw`) are skipped."""
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self.endpoint.inbox.get()
                if (
                    isinstance(message, SipResponse)
                    and message.call_id == self.call_id
                    and (not final or message.status_code >= 200)
                ):
                    return message

    async def invite(
        self, user: str = "support", payload_types: tuple[int, ...] = (0, 101), extra: str = ""
    ) -> SipResponse:
        """INVITE with an offer from a fresh RTP session (``extra``: header lines, each ending
        with CRLF); ACKs and starts media on a 200."""
        local_codec = payload_types[0] if payload_types[0] in (0, 8) else 0
        self.rtp_port, self.rtp = await _rtp_session(local_codec)
        self.rtp.on_audio = lambda pcm, _ts: self.heard.add(pcm)
        self.last_invite_branch = self.request(
            "INVITE", user, offer_sdp(self.rtp_port, payload_types), extra=extra
        )
        self.invite_cseq = self.cseq
        answer = await self.response(10.0)
        self.ack(answer)
        if answer.status_code == 200:
            self.start_media(answer)
        return answer

    def ack(self, response: SipResponse) -> None:
        to = response.headers.get_first("to") or ""
        if ";tag=" in to:
            self.remote_tag = to.split(";tag=")[1].split(";")[0]
        if 200 <= response.status_code < 300:
            self.route_set = list(reversed(response.headers.get("record-route") or []))
            contact = response.headers.get_first("contact") or ""
            self.remote_target = contact.strip().removeprefix("<").split(">")[0]
        branch = self.last_invite_branch if response.status_code >= 300 else None
        self.request("ACK", cseq=self.invite_cseq, branch=branch)

    def start_media(self, answer: SipResponse) -> None:
        address = parse_sdp(answer.text).rtp_address
        assert address is not None
        assert self.rtp is not None
        self.rtp.update_remote(address)

    async def incoming(self, method: str, timeout_s: float = 10.0) -> SipRequest:
        """The next request of ``method`` in this phone's call (others are skipped)."""
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self.endpoint.inbox.get()
                if (
                    isinstance(message, SipRequest)
                    and message.method == method
                    and message.call_id == self.call_id
                ):
                    return message

    def reply(self, request: SipRequest, status: int, reason: str) -> None:
        """Answer ``request`` (to the next hop, which sent it)."""
        vias = "".join(f"Via: {via}\r\n" for via in request.headers.get("via"))
        headers = request.headers
        text = (
            f"SIP/2.0 {status} {reason}\r\n{vias}"
            f"From: {headers.get_first('from')}\r\nTo: {headers.get_first('to')}\r\n"
            f"Call-ID: {request.call_id}\r\nCSeq: {headers.get_first('cseq')}\r\n"
            "Content-Length: 0\r\n\r\n"
        )
        self.send_raw(text.encode())

    async def bye(self) -> SipResponse:
        self.request("BYE")
        return await self.response()

    # -- media ---------------------------------------------------------------------------------

    async def say(self, pcm8k: bytes) -> None:
        """Send 8 kHz PCM16 as 20 ms RTP packets at real-time pace."""
        assert self.rtp is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        for start in range(0, len(pcm8k), FRAME_BYTES):
            chunk = pcm8k[start : start + FRAME_BYTES].ljust(FRAME_BYTES, b"\0")
            self._next_timestamp = (self.rtp.send_audio_pcm_auto(chunk) + 160) & 0xFFFFFFFF
            deadline += 0.02
            await asyncio.sleep(max(0.0, deadline - loop.time()))

    async def press(self, digit: str) -> None:
        """Send ``digit`` as an RFC 4733 event stamped with the media clock, then 200 ms of
        silence (each digit is a separate event, as a phone keypad makes them)."""
        assert self.rtp is not None
        self.rtp.send_dtmf(digit, 100, timestamp=self._next_timestamp)
        await self.say(bytes(8000 * 2 // 5))

    async def close(self) -> None:
        if self.rtp is not None:
            await self.rtp.close()
        if self.endpoint.transport is not None:
            self.endpoint.transport.close()
