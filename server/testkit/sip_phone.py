"""A scriptable SIP phone: hand-written SIP requests over UDP (so tests can send anything,
including malformed messages), aiortp for the call's RTP (G.711, RFC 4733 digits), and the call's
events read from the server (``GET /calls/{id}/events``, the session id coming in the answer's
``X-Vocable-Session`` header).

It calls ``127.0.0.1`` only: a test's server runs on the same machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiortp import RTPSession
from aiosipua import SipMessage, SipRequest, SipResponse, parse_sdp

from media.audio import pcm_rms_dbfs
from server.transports.sip.outbound import SESSION_HEADER

from .echo_path import EchoPath, ReturnedEcho
from .network import LossyLine, NetworkPath, impair_rtp

__all__ = ["Heard", "SipPhone", "offer_sdp"]

PHONE_RATE = 8000
FRAME_BYTES = 320  # 20 ms of 8 kHz PCM16


def offer_sdp(
    rtp_port: int, payload_types: tuple[int, ...] = (0, 101), direction: str = "sendrecv"
) -> str:
    names = {
        0: "PCMU/8000", 8: "PCMA/8000", 9: "G722/8000", 18: "G729/8000", 101: "telephone-event/8000"
    }  # fmt: skip
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


_Queued = tuple[
    list[tuple[bytes, str | None]], asyncio.Future[float] | None, asyncio.Future[float] | None
]
"""What the microphone sends next: frames (PCM, a digit before it), when the first left, when
the last did."""


class SipPhone:
    """One caller at ``127.0.0.1:server_port``; build with :meth:`open`, end with :meth:`close`.

    After a 200 to :meth:`invite`, :attr:`session_id` names the call on the server, and
    :meth:`follow_events` reads its events into :attr:`events` (:meth:`of_type`,
    :meth:`wait_for`, as a :class:`~server.testkit.caller.WebRTCCaller` does)."""

    def __init__(
        self,
        server_port: int,
        endpoint: _Endpoint,
        port: int,
        echo: ReturnedEcho | None = None,
        network: NetworkPath | None = None,
    ) -> None:
        self.server = ("127.0.0.1", server_port)
        self.network = network
        """What the network does to the phone's RTP (None: a perfect one)."""
        self.lossy: LossyLine | None = None
        """The phone's RTP through :attr:`network`, once a call has media (its counts)."""
        self.echo = EchoPath(echo, PHONE_RATE) if echo is not None else None
        """What the phone plays returning into its microphone (None: no echo); it needs the
        microphone running (:meth:`start_microphone`)."""
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
        self.session_id = ""
        """The server's id of the call: the 200's ``X-Vocable-Session`` ("" before, or if
        absent)."""
        self.events: list[dict[str, Any]] = []
        """The call's events as the server streams them (:meth:`follow_events`), in order."""
        self.events_ended = asyncio.Event()
        """Set once the server ended the event stream (the call has ended) or reading failed."""
        self._arrived = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._microphone: asyncio.Task[None] | None = None
        self._outbox: asyncio.Queue[_Queued] = asyncio.Queue()

    @classmethod
    async def open(
        cls,
        server_port: int,
        echo: ReturnedEcho | None = None,
        network: NetworkPath | None = None,
    ) -> SipPhone:
        loop = asyncio.get_running_loop()
        transport, endpoint = await loop.create_datagram_endpoint(
            _Endpoint, local_addr=("127.0.0.1", 0)
        )
        port = int(transport.get_extra_info("sockname")[1])
        return cls(server_port, endpoint, port, echo, network)

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
        self.rtp.on_audio = lambda pcm, _ts: self._played(pcm)
        if self.network is not None:
            self.lossy = impair_rtp(self.rtp, self.network)
        self.last_invite_branch = self.request(
            "INVITE", user, offer_sdp(self.rtp_port, payload_types), extra=extra
        )
        self.invite_cseq = self.cseq
        answer = await self.response(10.0)
        self.ack(answer)
        if answer.status_code == 200:
            self.session_id = answer.headers.get_first(SESSION_HEADER) or ""
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

    def start_microphone(self) -> None:
        """From now on send a packet every 20 ms, as a phone does: what :meth:`say` and
        :meth:`press` queue, else silence (a server's VAD then hears each pause end). Without
        it, the phone sends only while :meth:`say` or :meth:`press` runs."""
        if self._microphone is None:
            self._microphone = asyncio.create_task(self._stream(), name="sip-phone-microphone")

    async def say(self, pcm8k: bytes) -> float:
        """Send 8 kHz PCM16 as 20 ms RTP packets at real-time pace (after anything queued, when
        the microphone runs); returns when its first packet left (monotonic seconds)."""
        frames = [
            pcm8k[start : start + FRAME_BYTES].ljust(FRAME_BYTES, b"\0")
            for start in range(0, len(pcm8k), FRAME_BYTES)
        ] or [bytes(FRAME_BYTES)]
        return await self._send([(frame, None) for frame in frames])

    async def press(self, digit: str) -> None:
        """Send ``digit`` as an RFC 4733 event stamped with the media clock, then 400 ms of
        silence (each digit is a separate event, as a phone keypad makes them)."""
        silence = bytes(FRAME_BYTES)
        await self._send([(silence, digit if n == 0 else None) for n in range(20)])

    async def _send(self, frames: list[tuple[bytes, str | None]]) -> float:
        """Send ``frames`` (PCM, and a digit to send as an event before it), paced; returns
        when the first left."""
        if self._microphone is not None:
            started: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            finished: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            self._outbox.put_nowait((frames, started, finished))
            await finished
            return started.result()
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        first = time.monotonic()
        for frame, digit in frames:
            self._packet(frame, digit)
            deadline += 0.02
            await asyncio.sleep(max(0.0, deadline - loop.time()))
        return first

    def _played(self, pcm: bytes) -> None:
        self.heard.add(pcm)
        if self.echo is not None:
            self.echo.played(pcm, PHONE_RATE)

    def _packet(self, pcm: bytes, digit: str | None) -> None:
        assert self.rtp is not None
        if self.echo is not None:
            pcm = self.echo.mixed(pcm)
        if digit is not None:
            self.rtp.send_dtmf(digit, 100, timestamp=self._next_timestamp)
        self._next_timestamp = (self.rtp.send_audio_pcm_auto(pcm) + 160) & 0xFFFFFFFF

    async def _stream(self) -> None:
        """The microphone: a packet every 20 ms, queued frames first, else silence."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        silence = bytes(FRAME_BYTES)
        while True:
            frames, started, finished = self._next_queued()
            for n, (frame, digit) in enumerate(frames or [(silence, None)]):
                self._packet(frame, digit)
                if n == 0 and started is not None:
                    started.set_result(time.monotonic())
                deadline += 0.02
                await asyncio.sleep(max(0.0, deadline - loop.time()))
            if finished is not None:
                finished.set_result(time.monotonic())

    def _next_queued(self) -> _Queued:
        try:
            return self._outbox.get_nowait()
        except asyncio.QueueEmpty:
            return [], None, None

    async def press_digits(self, digits: str) -> None:
        """:meth:`press` each of ``digits`` in turn."""
        for digit in digits:
            await self.press(digit)

    # -- the call's events ---------------------------------------------------------------------

    async def follow_events(self, base_url: str, token: str | None = None) -> None:
        """Start reading the call's server-sent events (``GET {base_url}/calls/{session_id}/
        events``, with ``token`` as a bearer token) into :attr:`events`, in the background,
        until the server ends the stream or :meth:`close`. Returns once the server answered;
        raises RuntimeError when it refused (no session id yet, 401, 404...)."""
        if not self.session_id:
            raise RuntimeError("no session id: the call was not answered with X-Vocable-Session")
        if self._reader is not None:
            raise RuntimeError("already following this call's events")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
        self._http = http = aiohttp.ClientSession(timeout=timeout)
        url = f"{base_url.rstrip('/')}/calls/{self.session_id}/events"
        response = await http.get(url, headers=headers)
        if response.status != 200:
            body = await response.text()
            response.release()
            raise RuntimeError(f"events refused: {response.status} {body[:200]}")
        self._reader = asyncio.create_task(self._read(response), name=f"events:{self.session_id}")

    async def _read(self, response: aiohttp.ClientResponse) -> None:
        try:
            async for line in response.content:
                if line.startswith(b"data:"):
                    self.events.append(json.loads(line[5:]))
                    self._arrived.set()
        except (aiohttp.ClientError, ValueError):
            pass  # the stream broke off: what came is kept, waiting ends
        finally:
            response.release()
            self.events_ended.set()
            self._arrived.set()

    def of_type(self, type: str) -> list[dict[str, Any]]:
        """The events of ``type`` received so far."""
        return [event for event in self.events if event["type"] == type]

    async def wait_for(self, type: str, count: int = 1, timeout_s: float = 30.0) -> dict[str, Any]:
        """The ``count``-th event of ``type``, waiting for it up to ``timeout_s``; raises
        TimeoutError then, or at once once the stream has ended without it."""
        async with asyncio.timeout(timeout_s):
            while len(self.of_type(type)) < count:
                if self.events_ended.is_set():
                    raise TimeoutError(f"the call's events ended with no {type!r} #{count}")
                self._arrived.clear()
                await self._arrived.wait()
        return self.of_type(type)[count - 1]

    async def close(self) -> None:
        """Stop the microphone and reading events, close the RTP session and the SIP socket
        (no BYE: send one with :meth:`bye` first)."""
        if self._microphone is not None:
            self._microphone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._microphone
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._http is not None:
            await self._http.close()
        if self.rtp is not None:
            await self.rtp.close()
        if self.endpoint.transport is not None:
            self.endpoint.transport.close()
