"""One call lifecycle for every transport (``server/transports/base.py``): whatever fails while a
call ends, its registry slot, its ports and its connection are given back.

The fault is a real one: a process-wide event listener (metrics, traces) that raises on the
event a session sends as it closes, so ``Session.close()`` raises inside every hang-up. Each
transport runs for real on 127.0.0.1 (aiortc, a WebSocket, TCP, SIP over UDP) with real Whisper
and Piper behind it; the registry holds one call at most, so a leaked slot refuses the next.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from aiortc import RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack

from playbooks import load_playbooks
from server.call.events import VoiceEvent
from server.call.session import Session
from server.config.server import ServerConfig, SipSettings
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.runtime.registry import CallRegistry
from server.testkit.sip_phone import SipPhone
from server.transports.base import TransportCall
from server.transports.phone.audiosocket import (
    HANGUP,
    SLIN_8K,
    UUID,
    AudioSocketServer,
    frame_message,
)
from server.transports.phone.media_streams import serve_media_stream
from server.transports.sip.server import SipServer
from server.transports.webrtc.call import open_webrtc_call
from tests.conftest import EXAMPLES
from tests.support.calls import synthesizer, transcriber

pytestmark = pytest.mark.timeout(120)


class FailingListener:
    """Raises on every ``state: closed`` event: the one a session sends from ``close()``."""

    def __init__(self) -> None:
        self.raised = 0

    def __call__(self, event: VoiceEvent) -> None:
        if event.type == "state" and event.data.get("state") == "closed":
            self.raised += 1
            raise RuntimeError("the metrics exporter is broken")


@pytest.fixture
def listener() -> FailingListener:
    return FailingListener()


@pytest.fixture
def registry(listener: FailingListener) -> CallRegistry:
    engines = Engines(
        transcriber(), synthesizer(), load_playbooks(EXAMPLES), LLMProvider.serving(None)
    )
    config = ServerConfig(max_sessions=1, rate_limit_per_min=0)
    return CallRegistry(config, engines, listener)


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the registry has no event for this
            await asyncio.sleep(0.02)


def _assert_freed(registry: CallRegistry, listener: FailingListener) -> None:
    """The fault fired, and still no slot is held: the next call is admitted."""
    assert listener.raised >= 1
    assert len(registry) == 0
    registry.check_capacity()  # raises OverCapacity if the one slot leaked


async def test_webrtc_frees_its_slot_when_closing_the_session_raises(
    registry: CallRegistry, listener: FailingListener, caplog: pytest.LogCaptureFixture
) -> None:
    peer = RTCPeerConnection()
    try:
        peer.addTrack(AudioStreamTrack())
        peer.createDataChannel("events")
        await peer.setLocalDescription(await peer.createOffer())
        call = await open_webrtc_call(registry, peer.localDescription.sdp, None)
        assert len(registry) == 1
        await call.hangup("test over")
        _assert_freed(registry, listener)
        await asyncio.wait_for(call.ended.wait(), 10)
        await asyncio.wait_for(asyncio.gather(*registry.farewells), 10)
    finally:
        await peer.close()
    assert "closing the session failed" in caplog.text


@pytest.fixture
async def media_stream_server(registry: CallRegistry) -> AsyncIterator[TestServer]:
    async def media(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await serve_media_stream(ws, registry, None)
        return ws

    app = web.Application()
    app.router.add_get("/media", media)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_a_media_stream_frees_its_slot_when_closing_the_session_raises(
    registry: CallRegistry, listener: FailingListener, media_stream_server: TestServer
) -> None:
    start = {"event": "start", "streamSid": "MZ1", "start": {"streamSid": "MZ1"}}
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(media_stream_server.make_url("/media")) as ws,
    ):
        await ws.send_str(json.dumps({"event": "connected"}))
        await ws.send_str(json.dumps(start))
        await _until(lambda: len(registry) == 1)
        await ws.send_str(json.dumps({"event": "stop"}))
        async with asyncio.timeout(10):
            async for _ in ws:  # marks and media until the server closes the socket
                pass
        assert ws.close_code == 1000
    _assert_freed(registry, listener)


async def test_audiosocket_frees_its_slot_when_closing_the_session_raises(
    registry: CallRegistry, listener: FailingListener
) -> None:
    server = AudioSocketServer(registry, "127.0.0.1", 0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(frame_message(UUID, uuid.uuid4().bytes))
        writer.write(frame_message(SLIN_8K, bytes(320)))
        await writer.drain()
        await _until(lambda: len(registry) == 1)
        writer.write(frame_message(HANGUP))
        await writer.drain()
        async with asyncio.timeout(10):
            while await reader.read(4096):  # audio, then our hang-up, then EOF
                pass
        writer.close()
        await _until(lambda: len(registry) == 0)
    finally:
        await server.close()
    _assert_freed(registry, listener)


async def test_sip_frees_its_slot_and_rtp_port_when_closing_the_session_raises(
    registry: CallRegistry, listener: FailingListener
) -> None:
    sip = SipServer(registry, SipSettings(host="127.0.0.1", port=0))
    await sip.start()
    phone = await SipPhone.open(sip.port)
    try:
        assert (await phone.invite()).status_code == 200
        assert len(registry) == 1
        assert len(sip.rtp_ports.leased) == 1
        assert (await phone.bye()).status_code == 200
        await _until(lambda: not sip.calls and not sip.rtp_ports.leased)
    finally:
        await phone.close()
        await sip.close()
    _assert_freed(registry, listener)


async def test_a_refused_sip_call_gives_its_rtp_port_back(registry: CallRegistry) -> None:
    """The RTP port is leased before the call is admitted: a refusal after that (488 for media
    the endpoint cannot use) returns it."""
    sip = SipServer(registry, SipSettings(host="127.0.0.1", port=0))
    await sip.start()
    phone = await SipPhone.open(sip.port)
    try:
        assert (await phone.invite(payload_types=(18,))).status_code == 488  # G.729 only
        assert not sip.rtp_ports.leased
        assert len(registry) == 0
    finally:
        await phone.close()
        await sip.close()


class RecordingCall(TransportCall):
    """A transport whose hooks record the order they run in; closing its connection fails."""

    transport = "test"

    def __init__(self, registry: CallRegistry, call_id: str, session: Session) -> None:
        super().__init__(registry, call_id, session)
        self.steps: list[str] = []

    def ending(self, reason: str) -> None:
        self.steps.append(f"ending: {reason}")

    async def close_transport(self, reason: str) -> None:
        self.steps.append(f"slot held: {self.id in self.registry.calls}")
        raise ConnectionError("the peer is gone")

    def release_resources(self) -> None:
        self.steps.append("resources released")


async def test_the_hang_up_runs_each_step_once_in_order_whatever_fails(
    registry: CallRegistry, listener: FailingListener, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=__name__)  # a call logs as its transport module
    call = registry.open(partial(RecordingCall, registry), rate=16000, playbook="support")
    waiting = call.spawn(asyncio.sleep(60), "waiting")
    await asyncio.gather(call.hangup("first"), call.hangup("second"))
    await call.hangup("third")
    assert call.steps == ["ending: first", "slot held: False", "resources released"]
    assert call.ended.is_set()
    assert call.hung_up
    await asyncio.sleep(0)
    assert waiting.cancelled()
    _assert_freed(registry, listener)
    assert "test call" in caplog.text
    assert "ended: first" in caplog.text
    assert "closing the connection failed" in caplog.text
