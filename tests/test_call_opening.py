"""Every transport opens its calls through one registry operation, ``CallRegistry.open``: a call
refused there leaves no session, no registry slot and no port behind.

One server runs every transport on 127.0.0.1 (WebRTC, a media stream, AudioSocket, SIP in and
out) with a single call slot, which a held call fills. After each refusal the process has the
same sessions, calls, UDP sockets and leased RTP ports as before it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from aiortc import RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack

from media.audio import silence
from playbooks.transfer import TransferRequest
from server.admission.ratelimit import RateLimited, RateLimiter
from server.call.session import Session
from server.config.server import ServerConfig, SipSettings
from server.http.app import AUDIOSOCKET, CALLS, SIP
from server.runtime.registry import CallRegistry, OverCapacity, UnknownPlaybook
from server.testkit.sip_phone import SipPhone
from server.transports.base import TransportCall
from server.transports.phone.audiosocket import HANGUP, SLIN_8K, UUID, frame_message, read_message
from tests.support.calls import voice_server
from tests.support.processes import free_port
from tests.test_telephony import TwilioPhone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RTP_SPAN = 20


class HeldCall(TransportCall):
    """A call that only holds its slot."""

    transport = "held"


@dataclass(frozen=True)
class Footprint:
    """What a call would leave behind in this process."""

    sessions: int
    calls: int
    udp_ports: frozenset[int]
    leased_rtp_ports: int


def _udp_ports() -> frozenset[int]:
    """Local ports of the UDP sockets this process holds."""
    ports_by_inode: dict[str, int] = {}
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            ports_by_inode[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        inode = target.removeprefix("socket:[").removesuffix("]")
        if inode in ports_by_inode:
            held.add(ports_by_inode[inode])
    return frozenset(held)


def _footprint(server: TestServer, *, ignore_ports: tuple[int, ...] = ()) -> Footprint:
    gc.collect()
    sessions = sum(isinstance(thing, Session) for thing in gc.get_objects())
    return Footprint(
        sessions,
        len(server.app[CALLS]),
        _udp_ports() - set(ignore_ports),
        len(server.app[SIP].rtp_ports.leased),
    )


def _hold(registry: CallRegistry) -> HeldCall:
    return registry.open(partial(HeldCall, registry), rate=16000)


@asynccontextmanager
async def _server() -> AsyncIterator[TestServer]:
    """Every transport, one call slot, its RTP ports in a range of their own."""
    first_rtp = free_port(RTP_SPAN)
    sip = SipSettings(host="127.0.0.1", port=0, rtp_ports=(first_rtp, first_rtp + RTP_SPAN - 1))
    config = ServerConfig(
        max_sessions=1, rate_limit_per_min=0, sip=sip, audiosocket=("127.0.0.1", 0)
    )
    async with voice_server(None, config) as server:
        yield server


@pytest.fixture
async def full() -> AsyncIterator[TestServer]:
    """The server with its one slot held."""
    async with _server() as server:
        held = _hold(server.app[CALLS])
        try:
            yield server
        finally:
            await held.hangup("test over")


async def _offer() -> str:
    pc = RTCPeerConnection()
    pc.addTrack(AudioStreamTrack())
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = str(pc.localDescription.sdp)
    await pc.close()
    return sdp


async def test_a_refused_webrtc_offer_leaves_nothing_behind(full: TestServer) -> None:
    offer = await _offer()
    before = _footprint(full)
    async with (
        aiohttp.ClientSession() as http,
        http.post(full.make_url("/offer"), json={"type": "offer", "sdp": offer}) as response,
    ):
        assert response.status == 503
        assert "at most 1 calls" in (await response.json())["error"]
        assert response.headers["Retry-After"]
    assert _footprint(full) == before


async def test_a_media_stream_refused_at_its_start_leaves_nothing_behind() -> None:
    """Admitted to the WebSocket while a slot was free, refused when its ``start`` comes after
    the slot was taken: the refusal is the registry's, not the HTTP handler's early check."""
    async with _server() as server, aiohttp.ClientSession() as http:
        phone = TwilioPhone(await http.ws_connect(server.make_url("/twilio/media")))
        held = _hold(server.app[CALLS])
        try:
            before = _footprint(server)
            await phone.start("support")
            await asyncio.wait_for(phone.reader, 10)
            assert phone.closed_with is not None
            code, reason = phone.closed_with
            assert code == aiohttp.WSCloseCode.POLICY_VIOLATION
            assert "at most 1 calls" in str(reason)
            assert _footprint(server) == before
        finally:
            await held.hangup("test over")


async def test_a_refused_audiosocket_call_is_hung_up_and_leaves_nothing_behind(
    full: TestServer,
) -> None:
    before = _footprint(full)
    reader, writer = await asyncio.open_connection("127.0.0.1", full.app[AUDIOSOCKET].port)
    try:
        writer.write(frame_message(UUID, uuid.uuid4().bytes))
        writer.write(frame_message(SLIN_8K, silence(20, 8000)))
        await writer.drain()
        kind, _ = await asyncio.wait_for(read_message(reader), 10)
        assert kind == HANGUP
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then the connection closes
    finally:
        writer.close()
    assert _footprint(full) == before


async def test_a_refused_sip_invite_gets_503_and_leaves_nothing_behind(full: TestServer) -> None:
    phone = await SipPhone.open(full.app[SIP].port)
    try:
        before = _footprint(full)
        answer = await phone.invite()
        assert answer.status_code == 503
        assert answer.headers.get_first("retry-after")
        phone_ports = (phone.rtp_port, phone.rtp_port + 1)  # its RTP and RTCP
        assert _footprint(full, ignore_ports=phone_ports) == before
        assert not full.app[SIP].calls
    finally:
        await phone.close()


async def test_a_refused_outbound_call_leaves_nothing_behind(full: TestServer) -> None:
    before = _footprint(full)
    body = {"to": "sip:nobody@127.0.0.1:9", "playbook": "support"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(full.make_url("/calls"), json=body) as response,
    ):
        assert response.status == 503
        assert "at most 1 calls" in (await response.json())["error"]
    assert _footprint(full) == before
    assert not full.app[SIP].outbound


async def test_open_builds_nothing_for_a_call_it_refuses(full: TestServer) -> None:
    """The checks come before the build: refused, unknown or rate-limited, no call is built."""
    registry = full.app[CALLS]
    built: list[str] = []

    def build(call_id: str, session: Session) -> HeldCall:
        built.append(call_id)
        return HeldCall(registry, call_id, session)

    with pytest.raises(OverCapacity):
        registry.open(build, rate=16000)
    await registry.close_all("make room")
    with pytest.raises(UnknownPlaybook):
        registry.open(build, rate=16000, playbook="no-such-playbook")
    registry.admissions = RateLimiter(1.0, 1)
    registry.admissions.check("192.0.2.7")  # the address's one admission is spent
    with pytest.raises(RateLimited):
        registry.open(build, rate=16000, address="192.0.2.7")
    assert built == []
    assert len(registry) == 0


async def test_a_call_is_built_in_one_direction_around_a_whole_session(
    full: TestServer,
) -> None:
    """The registry makes the session first, whole: speaking at the transport's rate, its
    conversation's transfers already going to the call. Then the transport's call is built
    around it, and nothing of the session's parts is set from outside afterwards."""
    registry = full.app[CALLS]
    await registry.close_all("make room")
    parts_at_build: dict[str, dict[str, int]] = {}

    def parts(session: Session) -> dict[str, dict[str, int]]:
        voice = session.voice
        named = {"session": session, "voice": voice, "speaker": voice.speaker}
        named["orchestrator"] = voice.orchestrator
        return {name: {k: id(v) for k, v in vars(part).items()} for name, part in named.items()}

    def build(call_id: str, session: Session) -> HeldCall:
        assert call_id not in registry.calls  # the session exists before the call
        assert session.voice.orchestrator.transferrer is not None
        assert session.voice.speaker.sample_rate == 8000
        parts_at_build.update(parts(session))
        return HeldCall(registry, call_id, session)

    call = registry.open(build, rate=8000)
    try:
        assert parts(call.session) == parts_at_build
        transferrer = call.session.voice.orchestrator.transferrer
        assert transferrer is not None
        request = TransferRequest("sip:desk@192.0.2.7", "blind", None, None, None, 10.0)
        outcome = await transferrer(request)  # reaches the call
        assert outcome.reason == "not_supported"
        assert outcome.detail == "held calls cannot be transferred"
    finally:
        await call.hangup("done")


async def test_a_build_that_fails_leaves_no_call_in_the_registry(full: TestServer) -> None:
    registry = full.app[CALLS]
    await registry.close_all("make room")
    before = _footprint(full)

    def build(call_id: str, session: Session) -> HeldCall:
        raise OSError("no socket for this call")

    with pytest.raises(OSError, match="no socket"):
        registry.open(build, rate=16000)
    assert _footprint(full) == before
    call = _hold(registry)  # the slot is free
    await call.hangup("done")
