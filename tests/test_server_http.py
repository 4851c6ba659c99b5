"""The HTTP surface of ``vocable serve`` through aiohttp's test client (real app, real models)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiortc import RTCPeerConnection

from playbooks import ChatClient, load_playbooks
from server.app import create_app
from server.config import ServerConfig
from server.engines import Engines
from tests.calls import synthesizer, transcriber
from tests.conftest import EXAMPLES
from tests.scripted_llm import ScriptedLLM

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


def engines(llm_url: str | None) -> Engines:
    client = ChatClient.connect(llm_url, None, "scripted") if llm_url else None
    return Engines(transcriber(), synthesizer(), load_playbooks(EXAMPLES), client)


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[Client] = []

    async def make(config: ServerConfig | None = None, llm_url: str | None = None) -> Client:
        app = create_app(config or ServerConfig(), engines(llm_url))
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def _data_only_offer() -> str:
    pc = RTCPeerConnection()
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = str(pc.localDescription.sdp)
    await pc.close()
    return sdp


async def test_health_config_playbooks_and_page(make_client: MakeClient, llm: ScriptedLLM) -> None:
    client = await make_client(llm_url=llm.base_url)
    health = await (await client.get("/healthz")).json()
    process = health.pop("process")
    assert health == {
        "status": "ok",
        "models_loaded": True,
        "llm_configured": True,
        "active_sessions": 0,
        "max_sessions": 8,
        "worker": 0,
    }
    assert process["pid"] == os.getpid()
    assert process["rss_mb"] > 50  # the models are loaded
    assert process["open_files"] > 3
    assert process["threads"] >= process["python_threads"] >= 1
    assert process["asyncio_tasks"] >= 1  # this very request
    config = await (await client.get("/config")).json()
    assert config["auth_required"] is False
    assert config["ice_servers"] == []
    assert config["default_playbook"] in ("restaurant", "support")
    playbooks = await (await client.get("/playbooks")).json()
    assert {p["id"] for p in playbooks} == {"restaurant", "support"}
    assert all(p["name"] and p["description"] for p in playbooks)
    page = await client.get("/")
    assert page.status == 200
    assert '<button id="call"' in await page.text()
    script = await client.get("/client/app.js")
    assert script.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert "vocable_active_sessions 0.0" in metrics
    assert "vocable_turn_latency_seconds" in metrics


async def test_without_an_llm_the_server_says_so(make_client: MakeClient) -> None:
    client = await make_client()
    assert (await (await client.get("/config")).json())["llm_configured"] is False
    assert (await (await client.get("/healthz")).json())["llm_configured"] is False


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"not json", 400, "must be JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"sdp": "v=0", "type": "answer"}', 400, "type must be"),
        (b'{"type": "offer"}', 400, "sdp must be"),
        (b'{"type": "offer", "sdp": "v=0\\r\\nm=audio garbage\\r\\n"}', 400, "cannot use this SDP"),
        (b'{"type": "offer", "sdp": "v=0\\r\\n", "playbook": 3}', 400, "playbook must be"),
    ],
)
async def test_bad_offers_get_a_clear_json_error(
    make_client: MakeClient, body: bytes, status: int, message: str
) -> None:
    client = await make_client()
    response = await client.post("/offer", data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    assert message in (await response.json())["error"]
    assert (await (await client.get("/healthz")).json())["active_sessions"] == 0


async def test_an_offer_without_audio_or_for_an_unknown_playbook_is_refused(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    sdp = await _data_only_offer()
    response = await client.post("/offer", json={"sdp": sdp, "type": "offer"})
    assert response.status == 400
    assert "no audio" in (await response.json())["error"]
    response = await client.post(
        "/offer",
        json={
            "sdp": sdp.replace("m=application", "m=audio 9 UDP/TLS/RTP/SAVPF 0\r\nm=application"),
            "type": "offer",
            "playbook": "nope",
        },
    )
    assert response.status == 404
    assert "unknown playbook 'nope'" in (await response.json())["error"]


async def test_over_capacity_is_503_with_retry_after(make_client: MakeClient) -> None:
    client = await make_client(ServerConfig(max_sessions=0))
    response = await client.post("/offer", json={"sdp": "v=0\r\nm=audio 9\r\n", "type": "offer"})
    assert response.status == 503
    assert response.headers["Retry-After"] == "5"
    assert "at most 0 calls" in (await response.json())["error"]


async def test_a_token_guards_offers_and_hangups(make_client: MakeClient) -> None:
    client = await make_client(ServerConfig(auth_token="s3cret"))
    assert (await (await client.get("/config")).json())["auth_required"] is True
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = await client.post("/offer", json={"type": "offer", "sdp": "x"}, headers=headers)
        assert response.status == 401
        assert "bearer token" in (await response.json())["error"]
    response = await client.delete("/sessions/abc")
    assert response.status == 401
    good = {"Authorization": "Bearer s3cret"}
    response = await client.post("/offer", json={"type": "offer", "sdp": "x"}, headers=good)
    assert response.status == 400  # past the gate, refused for its content
    response = await client.delete("/sessions/abc", headers=good)
    assert response.status == 404
    assert (await response.json()) == {"error": "no such session"}


async def test_cors_allows_only_configured_origins(make_client: MakeClient) -> None:
    config = ServerConfig(cors_origins=("https://app.example",))
    client = await make_client(config)
    allowed = await client.options("/offer", headers={"Origin": "https://app.example"})
    assert allowed.status == 204
    assert allowed.headers["Access-Control-Allow-Origin"] == "https://app.example"
    other = await client.get("/healthz", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers


async def test_unknown_routes_and_methods_are_json_errors(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    missing = await client.get("/nope")
    assert missing.status == 404
    assert "error" in await missing.json()
    wrong = await client.get("/offer")
    assert wrong.status == 405
    assert "error" in await wrong.json()


def test_config_reads_the_environment() -> None:
    import argparse

    from server.config import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(
        parser,
        env={
            "VOCABLE_PORT": "9090",
            "VOCABLE_MAX_SESSIONS": "3",
            "VOCABLE_ICE_SERVERS": "stun:stun.example.org:3478, turn:turn.example.org:3478",
            "VOCABLE_TURN_USERNAME": "u",
            "VOCABLE_TURN_CREDENTIAL": "p",
            "VOCABLE_BARGE_IN_MIN_MS": "300",
        },
    )
    args = parser.parse_args([])
    config = ServerConfig.from_args(args, env={"VOCABLE_LLM_BASE_URL": "http://127.0.0.1:1/v1"})
    assert config.port == 9090
    assert config.max_sessions == 3
    assert [s.to_client() for s in config.ice_servers] == [
        {"urls": "stun:stun.example.org:3478"},
        {"urls": "turn:turn.example.org:3478", "username": "u", "credential": "p"},
    ]
    assert config.session.barge_in_min_ms == 300
    assert config.llm is not None
    assert config.llm.base_url == "http://127.0.0.1:1/v1"
    assert replace(config, llm=None).llm is None
    args = parser.parse_args(["--port", "7000"])
    assert ServerConfig.from_args(args, env={}).port == 7000
    assert ServerConfig.from_args(args, env={}).llm is None
    assert ServerConfig.from_args(args, env={}).sip is None


def test_sip_settings_from_flags_and_environment() -> None:
    import argparse
    from ipaddress import ip_network

    from server.config import add_serve_arguments
    from server.settings import ConfigError

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env={"VOCABLE_SIP_ALLOW": "10.0.0.0/8, 192.0.2.7"})
    args = parser.parse_args(["--sip", "0.0.0.0:5080", "--rtp-ports", "20000-20099"])
    sip = ServerConfig.from_args(args, env={}).sip
    assert sip is not None
    assert (sip.host, sip.port, sip.rtp_ports) == ("0.0.0.0", 5080, (20000, 20100))
    assert sip.allow == (ip_network("10.0.0.0/8"), ip_network("192.0.2.7/32"))
    assert ServerConfig.from_args(parser.parse_args(["--sip", "5070"]), env={}).sip == replace(
        sip, host="127.0.0.1", port=5070, rtp_ports=(10000, 20000)
    )
    for bad in (["--sip", "5060", "--rtp-ports", "99-5"], ["--sip", "x:y"]):
        with pytest.raises(ConfigError):
            ServerConfig.from_args(parser.parse_args(bad), env={})
    bad_allow = argparse.ArgumentParser()
    add_serve_arguments(bad_allow, env={"VOCABLE_SIP_ALLOW": "10.0.0.0/33"})
    with pytest.raises(ConfigError, match="sip-allow"):
        ServerConfig.from_args(bad_allow.parse_args(["--sip", "5060"]), env={})
