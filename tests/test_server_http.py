"""The HTTP surface of ``vocable serve`` through aiohttp's test client (real app, real models)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from aiohttp import WSCloseCode, WSMsgType, WSServerHandshakeError, web
from aiohttp.test_utils import TestClient, TestServer
from aiortc import RTCPeerConnection

from playbooks import ChatClient, load_playbooks
from server.admission.cgroup import cpu_limit
from server.admission.overload import OverloadSettings
from server.config.server import ServerConfig
from server.http.app import MAX_SDP_BYTES, create_app
from server.http.auth import bearer_matches
from server.http.middleware import errors_as_json, remember_prepared
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.testkit.scripted_llm import ScriptedLLM
from tests.conftest import EXAMPLES
from tests.support.calls import synthesizer, transcriber
from tests.support.raw_http import raw_request

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


def engines(llm_url: str | None) -> Engines:
    client = ChatClient.connect(llm_url, None, "scripted") if llm_url else None
    return Engines(
        transcriber(), synthesizer(), load_playbooks(EXAMPLES), LLMProvider.serving(client)
    )


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
    load = health.pop("load")
    # a call's cost, assumed until measured, and how many calls fit at it in the CPU this
    # process may use (a neighbour outside its control group takes none of that room)
    limit = cpu_limit()
    assert load.pop("cpu_limit") == {"cores": limit.cores, "source": limit.source}
    assert limit.cores <= len(os.sched_getaffinity(0))
    assert load.pop("call_cpu_percent") == 15.0
    if not limit.quota:
        share = OverloadSettings().capacity_cpu_percent / 100
        assert load.pop("capacity_calls") == max(1, math.floor(limit.cores * share / 0.15 + 1e-6))
    assert set(load) <= {
        "loop_lag_ms",
        "decode_backlog",
        "synthesis_backlog",
        "cpu_percent",
        "others_cpu_percent",
        "capacity_calls",
    }
    assert health.pop("refused_overloaded") == 0
    assert health == {
        "status": "ok",
        "models_loaded": True,
        "llm_configured": True,
        "llm": {
            "state": "ready",
            "source": "endpoint",
            "model": "scripted",
            "detail": "",
            "progress": None,
        },
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
    assert config["llm"]["state"] == "ready"
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


async def test_a_token_guards_offers_hangups_and_event_streams(make_client: MakeClient) -> None:
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
    assert (await client.get("/calls/abc/events")).status == 401
    response = await client.get("/calls/abc/events", headers=good)
    assert (response.status, await response.json()) == (404, {"error": "no such call"})


@pytest.mark.parametrize(
    "value",
    [b"Bearer \xff\xfe", b"Bearer s3cr\xe9t", "Bearer s3crét".encode(), b"\xff", b"Bearer "],
)
async def test_a_token_that_is_not_ascii_or_utf8_is_a_401(
    make_client: MakeClient, value: bytes
) -> None:
    """Header bytes that are not UTF-8 once made ``given.encode()`` raise: a 500 (regression)."""
    client = await make_client(ServerConfig(auth_token="s3cret"))
    host, port = client.server.host, client.server.port
    assert port is not None
    headers = b"Authorization: " + value + b"\r\nContent-Type: application/json\r\n"
    body = b'{"type": "offer", "sdp": "x"}'
    for method, path in (("POST", "/offer"), ("DELETE", "/sessions/x")):
        status, payload = await raw_request(host, port, method, path, headers, body)
        assert (status, payload) == (401, {"error": "missing or wrong bearer token"})
    status, _ = await raw_request(host, port, "POST", "/offer", b"Authorization: Bearer s3cret\r\n")
    assert status == 400  # the same raw request with the right token passes the gate


def test_a_token_configured_with_odd_characters_still_compares() -> None:
    assert bearer_matches("Bearer s3crét", "s3crét")
    assert bearer_matches("Bearer \udcff", "\udcff")  # the raw byte 0xff, both sides
    assert not bearer_matches("Bearer \ud800", "\ud800")  # no bytes make a lone surrogate
    assert not bearer_matches("Bearer s3cret", "s3crét")
    assert not bearer_matches("", "")


async def test_the_media_websocket_needs_the_token(make_client: MakeClient) -> None:
    client = await make_client(ServerConfig(auth_token="s3cret"))
    for query, headers in (
        ("", {}),
        ("?token=wrong", {}),
        ("", {"Authorization": "Bearer wrong"}),
        ("?token=s3cret", {"Authorization": "Bearer wrong"}),  # the header wins
    ):
        with pytest.raises(WSServerHandshakeError) as refused:
            await client.ws_connect(f"/twilio/media{query}", headers=headers)
        assert refused.value.status == 401
    for query, headers in (("?token=s3cret", {}), ("", {"Authorization": "Bearer s3cret"})):
        ws = await client.ws_connect(f"/twilio/media{query}", headers=headers)
        await ws.send_json({"event": "stop"})  # before any start: nothing to hang up
        assert (await ws.receive()).type == WSMsgType.CLOSE
        await ws.close()


async def test_offers_over_64_kib_are_413(make_client: MakeClient) -> None:
    client = await make_client()
    sdp = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0\r\n" + "a=x\r\n" * (MAX_SDP_BYTES // 5)
    body = json.dumps({"type": "offer", "sdp": sdp}).encode()
    response = await client.post("/offer", data=body)  # with Content-Length
    assert response.status == 413
    assert "at most 65536 bytes" in (await response.json())["error"]

    async def chunked(data: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(data), 8192):
            yield data[start : start + 8192]

    response = await client.post("/offer", data=chunked(body))  # no Content-Length: read
    assert response.status == 413
    assert "at most 65536 bytes" in (await response.json())["error"]
    response = await client.post("/offer", data=chunked(body * 3))  # past the body limit
    assert response.status == 413
    assert "error" in await response.json()
    assert (await (await client.get("/healthz")).json())["active_sessions"] == 0


async def test_an_error_after_a_websocket_upgrade_closes_it_without_an_http_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The error middleware on a handler failing after its WebSocket was prepared: the socket
    is closed with 1011; no HTTP 500 is written onto the upgraded connection."""

    async def failing(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        raise RuntimeError("boom")

    app = web.Application(middlewares=[errors_as_json])
    app.on_response_prepare.append(remember_prepared)
    app.router.add_get("/ws", failing)
    async with TestClient(TestServer(app)) as client:
        ws = await client.ws_connect("/ws")
        await ws.send_str("go")
        closing = await ws.receive()
        assert (closing.type, closing.data, closing.extra) == (
            WSMsgType.CLOSE,
            WSCloseCode.INTERNAL_ERROR,
            "internal server error",
        )
        await ws.close()
        assert (await client.get("/nope")).status == 404  # the server goes on
    assert "unhandled error on GET /ws" in caplog.text


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

    from server.config.server import add_serve_arguments

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

    from server.config.llm import ConfigError
    from server.config.server import add_serve_arguments

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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--max-sessions", "0"],
            "--max-sessions / VOCABLE_MAX_SESSIONS: must be at least 1, not 0",
        ),
        (
            ["--max-sessions", "two"],
            "--max-sessions / VOCABLE_MAX_SESSIONS: 'two' is not a whole number",
        ),
        (
            ["--idle-timeout-s", "0"],
            "--idle-timeout-s / VOCABLE_IDLE_TIMEOUT_S: must be a number above 0",
        ),
        (["--max-call-s", "-60"], "--max-call-s / VOCABLE_MAX_CALL_S: must be a number above 0"),
        (["--max-call-s", "nan"], "--max-call-s / VOCABLE_MAX_CALL_S: must be a number above 0"),
    ],
)
def test_call_limits_must_be_positive(flags: list[str], message: str) -> None:
    # `vocable serve` prints this in one line and exits 2: tests/test_serve_options.py
    import argparse

    from server.config.llm import ConfigError
    from server.config.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env={})
    with pytest.raises(ConfigError) as refused:
        ServerConfig.from_args(parser.parse_args(flags), env={})
    assert message in str(refused.value)


def test_call_limits_from_the_environment_are_checked_too() -> None:
    import argparse

    from server.config.llm import ConfigError
    from server.config.server import add_serve_arguments

    for name, value in (("MAX_SESSIONS", "0"), ("IDLE_TIMEOUT_S", "-1"), ("MAX_CALL_S", "0")):
        refusing = argparse.ArgumentParser()
        add_serve_arguments(refusing, env={f"VOCABLE_{name}": value})
        with pytest.raises(ConfigError, match=f"VOCABLE_{name}: must be .*, not {value}$"):
            ServerConfig.from_args(refusing.parse_args([]), env={})
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env={"VOCABLE_IDLE_TIMEOUT_S": "45", "VOCABLE_MAX_CALL_S": "600"})
    config = ServerConfig.from_args(parser.parse_args(["--max-sessions", "2"]), env={})
    assert (config.max_sessions, config.idle_timeout_s, config.max_call_s) == (2, 45.0, 600.0)
    text = parser.format_help()
    for documented in ("VOCABLE_MAX_SESSIONS", "VOCABLE_IDLE_TIMEOUT_S", "VOCABLE_MAX_CALL_S"):
        assert documented in text
    assert "DELETE /sessions/ID" in text
    assert "/twilio/media" in text


def test_the_preemption_lead_comes_from_a_flag_or_the_environment() -> None:
    import argparse

    from server.config.llm import ConfigError
    from server.config.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env={"VOCABLE_PREEMPT_LEAD_MS": "100"})
    config = ServerConfig.from_args(parser.parse_args([]), env={})
    assert config.session.endpoint.preempt_lead_ms == 100
    flagged = ServerConfig.from_args(parser.parse_args(["--preempt-lead-ms", "0"]), env={})
    assert flagged.session.endpoint.preempt_lead_ms == 0
    questions = ServerConfig.from_args(parser.parse_args(["--question-lead-ms", "150"]), env={})
    assert questions.session.endpoint.question_lead_ms == 150
    for bad in ("-1", "400"):  # a lead as long as the end-of-turn silence is no preemption rule
        with pytest.raises(
            ConfigError, match="--preempt-lead-ms / VOCABLE_PREEMPT_LEAD_MS: must be 0 to 399"
        ):
            ServerConfig.from_args(parser.parse_args(["--preempt-lead-ms", bad]), env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"VOCABLE_BARGE_IN": "Immediate"},
            "--barge-in / VOCABLE_BARGE_IN: must be one of immediate, confirmed, pause_resume, "
            "disabled, not 'Immediate'",
        ),
        (
            {"VOCABLE_LOG_FORMAT": "xml"},
            "--log-format / VOCABLE_LOG_FORMAT: must be one of text, json, not 'xml'",
        ),
        (
            {"VOCABLE_VAD_AGGRESSIVENESS": "7"},
            "--vad-aggressiveness / VOCABLE_VAD_AGGRESSIVENESS: must be one of 0, 1, 2, 3",
        ),
        (
            {"VOCABLE_END_SILENCE_MS": "5"},
            "--end-silence-ms / VOCABLE_END_SILENCE_MS: must be at least 20",
        ),
        (
            {"VOCABLE_SPECULATION_PAUSE_MS": "-1"},
            "--speculation-pause-ms / VOCABLE_SPECULATION_PAUSE_MS: must be at least 0",
        ),
    ],
)
def test_environment_values_are_checked_like_flags(env: dict[str, str], message: str) -> None:
    """A value the flag would refuse is refused from the environment too, in one line: an
    unknown barge-in policy once left callers unable to interrupt the agent."""
    import argparse

    from server.config.llm import ConfigError
    from server.config.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env=env)
    with pytest.raises(ConfigError) as refused:
        ServerConfig.from_args(parser.parse_args([]), env={})
    assert str(refused.value).startswith(message), refused.value


def test_the_llm_timeout_has_one_default_for_the_server_and_the_library() -> None:
    import argparse

    from playbooks import OrchestratorOptions
    from server.config.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env={})
    config = ServerConfig.from_args(parser.parse_args([]), env={})
    assert config.llm_timeout_s * 1000 == OrchestratorOptions().llm_timeout_ms == 10_000
