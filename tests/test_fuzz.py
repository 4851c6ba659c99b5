"""Fuzzing every input the server takes from outside, with hypothesis: ``POST /offer`` bodies,
messages on a call's ``events`` data channel, SIP datagrams, playbook files (YAML, JSON and
Markdown), the ``Authorization`` header, and the media WebSocket's ``start`` and later messages.

Whatever arrives, the answer is a clear 4xx (or a one-line validation message), never a 5xx, a
crash or a logged traceback, and the server goes on serving. Runs are derandomized (the same
examples every run) and bounded; each regression found by fuzzing is an ``@example``.

The server-side targets run hypothesis in a worker thread (:func:`fuzz_on_loop`) while the server,
its shared models and the peers stay on the test's event loop, so models load and calls connect
once per target, not once per example.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import re
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aioice import stun
from aiortc import RTCPeerConnection
from aiosipua import SipResponse, parse_sdp
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from playbooks import PlaybookError, load_playbook, load_playbooks
from playbooks.errors import MAX_PROBLEMS, Problem
from playbooks.models import (
    CustomCondition,
    IntentCondition,
    KeywordCondition,
    LLMConfig,
    MaxTurnsCondition,
    NamedToolChoice,
    Playbook,
    Stage,
    TimeoutCondition,
    ToolCallCondition,
    Transition,
    TransitionAction,
)
from server import cli
from server.call.session import SessionSettings
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, SIP, create_app
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from server.testkit.sip_phone import SipPhone, offer_sdp
from server.transports.phone.media_streams import TwilioCall
from tests.conftest import EXAMPLES
from tests.support.calls import synthesizer, transcriber, voice_server
from tests.support.raw_http import raw_request

T = TypeVar("T")
Client = TestClient[web.Request, web.Application]


def fuzz(max_examples: int) -> settings:
    """Bounded, reproducible runs: the same examples every time, no example database."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


class LoopBridge:
    """Runs coroutines on the test's event loop from hypothesis' worker thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()
            raise


LOOP_USES_RANDOM = "ignore:Do not use the `random` module inside strategies"
"""The server (aiortc, aioice) draws from ``random`` on its loop while hypothesis generates an
example in its thread; hypothesis takes that for a strategy using ``random``."""


async def fuzz_on_loop(test: Callable[[], None]) -> None:
    """Run a ``@given`` test (whose examples use a :class:`LoopBridge`) in a worker thread."""
    await asyncio.to_thread(test)


# -- generic values ----------------------------------------------------------------------------


def _field_names() -> list[str]:
    models = (
        Playbook,
        Stage,
        Transition,
        TransitionAction,
        LLMConfig,
        NamedToolChoice,
        KeywordCondition,
        ToolCallCondition,
        IntentCondition,
        MaxTurnsCondition,
        TimeoutCondition,
        CustomCondition,
    )
    names = {"type", "from", "in"}
    for model in models:
        for name, info in model.model_fields.items():
            names.add(name)
            if isinstance(info.alias, str):
                names.add(info.alias)
    return sorted(names)


FIELD_NAMES = _field_names()
WORDS = ["offer", "text", "mute", "hangup", "greeting", "support", "keyword", "*", "auto", ""]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(WORDS),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), children, max_size=5),
    ),
    max_leaves=20,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- 1. POST /offer ------------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[Client]:
    """The real app on the shared models, without an LLM and without a rate limit (the fuzzer
    sends far more offers a minute than a browser would)."""
    engines = Engines(
        transcriber(), synthesizer(), load_playbooks(EXAMPLES), LLMProvider.serving(None)
    )
    client = TestClient(TestServer(create_app(ServerConfig(rate_limit_per_min=0), engines)))
    await client.start_server()
    yield client
    await client.close()


async def _audio_offer() -> str:
    """A real browser-like offer: audio both ways and the ``events`` data channel."""
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = str(pc.localDescription.sdp)
    await pc.close()
    return sdp


SDP_LINES = [
    "m=audio 0 RTP/AVP 0",
    "m=audio x UDP/TLS/RTP/SAVPF 111",
    "m=video 9 UDP/TLS/RTP/SAVPF 96",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
    "c=IN IP4 999.0.0.1",
    "c=IN IP6 zz",
    "a=rtpmap:111 opus/x/2",
    "a=rtpmap:x PCMU/8000",
    "a=fmtp:111 minptime=x",
    "a=fingerprint:sha-256 ZZ",
    "a=fingerprint:md5 00",
    "a=setup:bogus",
    "a=ice-ufrag:",
    "a=ice-pwd:",
    "a=candidate:x",
    "a=candidate:1 1 UDP 1 999.1.1.1 99999 typ host",
    "a=sctp-port:x",
    "a=max-message-size:-1",
    "a=mid:",
    "a=group:BUNDLE 7 8",
    "a=ssrc:x cname:y",
    "a=extmap:x y",
    "a=rtcp:x",
    "a=msid:",
    "a=sendonly",
    "a=inactive",
]


def sdp_mutants(sdp: str) -> st.SearchStrategy[str]:
    """``sdp`` with lines deleted, duplicated, swapped, replaced or garbled."""
    lines = sdp.rstrip("\r\n").split("\r\n")
    new_line = st.sampled_from(SDP_LINES) | st.text(max_size=40)

    @st.composite
    def mutant(draw: st.DrawFn) -> str:
        out = list(lines)
        for _ in range(draw(st.integers(1, 4))):
            if not out:
                out.append(draw(new_line))
                continue
            i = draw(st.integers(0, len(out) - 1))
            op = draw(
                st.sampled_from(["delete", "duplicate", "swap", "insert", "value", "chars", "cut"])
            )
            if op == "delete":
                del out[i]
            elif op == "duplicate":
                out.insert(i, out[i])
            elif op == "swap":
                j = draw(st.integers(0, len(out) - 1))
                out[i], out[j] = out[j], out[i]
            elif op == "insert":
                out.insert(i, draw(new_line))
            elif op == "value":
                out[i] = out[i].partition("=")[0] + "=" + draw(st.text(max_size=30))
            elif op == "chars":
                line = list(out[i]) or [""]
                for _ in range(draw(st.integers(1, 3))):
                    line[draw(st.integers(0, len(line) - 1))] = draw(st.characters())
                out[i] = "".join(line)
            else:
                out[i] = out[i][: draw(st.integers(0, len(out[i])))]
        separator = draw(st.sampled_from(["\r\n", "\n"]))
        return separator.join(out) + separator

    return mutant()


def offer_bodies(sdp: str) -> st.SearchStrategy[bytes]:
    sdps = st.one_of(st.just(sdp), sdp_mutants(sdp), st.text(max_size=200), json_values)
    kinds = st.sampled_from(["offer", "answer", "pranswer", "", "OFFER"]) | json_values
    playbooks = st.sampled_from(["support", "restaurant", "nope", ""]) | json_values
    objects = st.builds(
        lambda base, extra: {**extra, **base},
        st.fixed_dictionaries({}, optional={"sdp": sdps, "type": kinds, "playbook": playbooks}),
        st.dictionaries(st.text(max_size=8), json_values, max_size=2),
    )
    offers = st.builds(
        lambda offer, playbook: {"type": "offer", "sdp": offer, "playbook": playbook},
        st.just(sdp) | sdp_mutants(sdp),
        st.none() | st.sampled_from(["support", "restaurant", "nope"]),
    )
    return st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        json_values.map(lambda value: json.dumps(value).encode()),
        objects.map(lambda value: json.dumps(value).encode()),
        offers.map(lambda value: json.dumps(value).encode()),
    )


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_offer_bodies_get_an_answer_or_a_clear_4xx(http: Client) -> None:
    sdp = await _audio_offer()
    bridge = LoopBridge()
    statuses: Counter[int] = Counter()

    async def post(body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        response = await http.post("/offer", data=body, headers=headers)
        text = await response.text()
        assert response.status < 500, (response.status, text)
        statuses[response.status] += 1
        payload = json.loads(text)
        if response.status == 200:
            assert payload["type"] == "answer"
            assert "m=audio" in payload["sdp"]
            hangup = await http.delete(f"/sessions/{payload['session_id']}")
            assert hangup.status == 200
        else:
            assert 400 <= response.status < 500
            assert isinstance(payload, dict)
            assert set(payload) == {"error"}
            assert isinstance(payload["error"], str)
            assert payload["error"].strip()
            assert not payload["error"].endswith(":")  # a reason, not an empty exception

    def without(line: str) -> bytes:
        """The offer without its first line starting with ``line``."""
        lines = sdp.split("\r\n")
        lines.remove(next(x for x in lines if x.startswith(line)))
        return json.dumps({"type": "offer", "sdp": "\r\n".join(lines)}).encode()

    @given(body=offer_bodies(sdp))
    @example(body=json.dumps({"type": "offer", "sdp": sdp}).encode())
    # aiortc took these offers but raised in createAnswer (AttributeError, ValueError): a 500,
    # then pc.close() raised too and the call was never released; 8 such offers and the server
    # refused every call (regressions)
    @example(body=without("a=mid:0"))
    @example(body=without("a=sendrecv"))
    @example(body=without("m=application"))
    # aiortc asserts on this one: "cannot use this SDP offer: " with no reason (regression)
    @example(body=json.dumps({"type": "offer", "sdp": "v=0\r\nm=audio 9 x\r\n"}).encode())
    @example(body=_deep(5000).encode())  # RecursionError in request.json() (regression)
    @example(body=b'{"type": "offer", "sdp": "v=0 m=audio \\ud800"}')  # (regression)
    @example(body=b"")
    @example(body=b"\xff\xfe")
    @example(body=b"NaN")
    @example(body=b'{"type": "offer", "sdp": "v=0\\r\\nm=audio 1 x\\r\\n", "playbook": []}')
    @fuzz(500)
    def check(body: bytes) -> None:
        bridge.run(post(body))

    await fuzz_on_loop(check)
    health = await http.get("/healthz")
    assert health.status == 200
    assert (await health.json())["active_sessions"] == 0
    assert statuses[200] > 0  # the fuzzer reached real calls, not only the early refusals
    assert statuses[400] > 0


ONCE_500 = [
    pytest.param(_deep(5000).encode(), id="deep-json"),
    pytest.param(b'{"type": "offer", "sdp": "v=0\\r\\nm=audio \\ud800"}', id="lone-surrogate"),
]
"""Bodies ``/offer`` once answered 500: ``request.json()`` raised RecursionError on deep nesting,
and ``len(sdp.encode())`` raised UnicodeEncodeError on a lone surrogate escape (regressions)."""


@pytest.mark.slow
@pytest.mark.parametrize("body", ONCE_500)
async def test_offer_bodies_that_once_gave_500_get_400(http: Client, body: bytes) -> None:
    response = await http.post("/offer", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert (await response.json())["error"]


# -- 2. the events data channel -----------------------------------------------------------------

MAX_MESSAGE_BYTES = 4 * 1024
channel_types = st.sampled_from(["text", "mute", "dtmf", "interrupt", "dance", "", "TEXT", "Text"])
channel_fields = json_values | st.text(max_size=30)
channel_objects = st.fixed_dictionaries(
    {"type": channel_types | json_values},
    optional={"text": channel_fields, "muted": channel_fields | st.booleans(), "x": json_values},
)
channel_turns = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text}, st.text(min_size=1, max_size=40)),
    st.builds(lambda muted: {"type": "mute", "muted": muted}, st.booleans()),
)
channel_messages: st.SearchStrategy[str | bytes] = st.one_of(
    channel_turns.map(json.dumps),
    st.text(max_size=100),
    st.binary(max_size=100),
    json_values.map(json.dumps),
    channel_objects.map(json.dumps),
    st.integers(1, MAX_MESSAGE_BYTES // 2).map(_deep),
    st.integers(MAX_MESSAGE_BYTES - 30, MAX_MESSAGE_BYTES + 100).map(
        lambda n: json.dumps({"type": "text", "text": "x" * n})
    ),
)


def expected_valid(message: str | bytes) -> bool | None:
    """Whether the server takes ``message`` (a typed turn or a mute switch); None for a hang-up,
    which would end the call under test."""
    if isinstance(message, bytes) or len(message.encode()) > MAX_MESSAGE_BYTES:
        return False
    try:
        data = json.loads(message)
    except (ValueError, RecursionError):
        return False
    if not isinstance(data, dict) or "type" not in data:
        return False
    kind = data["type"]
    if isinstance(kind, str) and kind == "hangup":
        return None
    text, muted = data.get("text"), data.get("muted")
    return bool(
        (kind == "text" and isinstance(text, str) and text.strip())
        or (kind == "mute" and isinstance(muted, bool))
    )


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_data_channel_messages_get_a_clear_error_and_the_call_stays_up(
    llm: ScriptedLLM, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    llm.script(answers_by_words({}, "OK."))
    # no greeting: the fuzzing starts as soon as the channel is open, not after ~4 s of spoken
    # greeting (the call is in the same state, listening, either way)
    config = ServerConfig(rate_limit_per_min=0, session=SessionSettings(greet=False))
    async with voice_server(llm.base_url, config) as server:
        caller = WebRTCCaller()
        try:
            await caller.connect(str(server.make_url("")).rstrip("/"), playbook="support")
            opened = asyncio.Event()
            caller.channel.on("open", opened.set)
            if caller.channel.readyState != "open":
                await asyncio.wait_for(opened.wait(), 30)
            await _fuzz_channel(caller)
            assert caller.session_id in server.app[CALLS].calls
            answers = len(caller.of_type("agent_sentence"))
            caller.send({"type": "text", "text": "Are you still there?"})
            reply = await caller.wait_for("agent_sentence", count=answers + 1, timeout_s=30)
            assert reply["text"] == "OK."
            call = server.app[CALLS].calls[caller.session_id]
            caller.send({"type": "hangup"})
            await asyncio.wait_for(call.ended.wait(), 10)
            assert len(server.app[CALLS]) == 0
        finally:
            await caller.close()
    assert not _problems(caplog.records)


async def _fuzz_channel(caller: WebRTCCaller) -> None:
    bridge = LoopBridge()
    probes = iter(range(1_000_000))
    outcomes: Counter[bool] = Counter()

    async def exchange(message: str | bytes, valid: bool) -> None:
        """Send ``message`` then a probe the server refuses; the errors up to the probe's are
        those ``message`` caused (the channel is ordered)."""
        errors_before = len(caller.of_type("error"))
        probe = f"probe-{next(probes)}"
        caller.channel.send(message)
        caller.channel.send(json.dumps({"type": probe}))
        expected = errors_before + (0 if valid else 1) + 1
        last = await caller.wait_for("error", count=expected, timeout_s=10)
        assert probe in last["message"], (message, caller.of_type("error")[errors_before:])
        if not valid:
            error = caller.of_type("error")[errors_before]
            assert error["source"] == "client"
            assert probe not in error["message"]
            assert isinstance(error["message"], str)
            assert len(error["message"].strip()) > 10
        outcomes[valid] += 1

    @given(message=channel_messages)
    @example(message=_deep(2000))  # RecursionError escaped the handler (regression)
    @example(message='{"type": "text", "text": "   "}')
    @example(message='{"type": "mute", "muted": "yes"}')
    @example(message='{"type": {"nested": ["type"]}}')
    @example(message=b"")
    @example(message="")
    @fuzz(300)
    def check(message: str | bytes) -> None:
        valid = expected_valid(message)
        assume(valid is not None)
        assert valid is not None
        bridge.run(exchange(message, valid))

    await fuzz_on_loop(check)
    assert outcomes[True] > 0
    assert outcomes[False] > 0
    caller.send({"type": "mute", "muted": False})


# -- 3. SIP datagrams ----------------------------------------------------------------------------

SIP_METHODS = ["INVITE", "OPTIONS", "BYE", "CANCEL", "ACK", "REGISTER", "INFO", "FOO"]
BAD_CSEQS = [
    "banana {method}",
    "1",
    "",
    "-1 {method}",
    "99999999999 {method}",
    "2147483648 {method}",
    "1 NOTIFY",
    "1 {method} extra",
    "\uff11 {method}",
]
BAD_LENGTHS = ["-5", "abc", "", "{more}", "99999999999999999999", "1e3"]
BAD_SDPS = [
    b"v=0\r\nm=audio banana RTP/AVP 0\r\n",
    b"v=0\r\nc=IN IP4 127.0.0.1\r\nm=audio 4000 RTP/AVP x\r\n",
    b"v=0\r\nc=IN IP4 127.0.0.1\r\nm=audio 4000 RTP/AVP 0\r\na=rtpmap:x PCMU/8000\r\n",
    b"v=0\r\nc=IN IP4 127.0.0.1\r\nm=audio 4000 RTP/AVP 0\r\nb=AS:x\r\n",
    b"v=x\r\n",
    b"t=a b\r\n",
]
UNREACHABLE_SDPS = [  # well-formed, but no address we can send RTP to: 488
    offer_sdp(4000).replace("c=IN IP4 127.0.0.1", "c=IN IP4 999.1.1.1").encode(),
    offer_sdp(70000).encode(),
    offer_sdp(0).encode(),
    offer_sdp(4000).replace("c=IN IP4 127.0.0.1", "c=IN IP6 ::1").encode(),
    offer_sdp(4000).replace("c=IN IP4 127.0.0.1", "c=IN IP4 example.invalid").encode(),
]
ODD_VIAS = [  # where answers would go: nowhere sendable, or somewhere harmless on 127.0.0.1
    "SIP/2.0/UDP 127.0.0.1:99999;branch={branch}",
    "SIP/2.0/UDP 127.0.0.1:0;branch={branch}",
    "SIP/2.0/UDP 127.0.0.1:-1;branch={branch}",
    "SIP/2.0/UDP 127.0.0.1:9;branch={branch}",
    "SIP/2.0/UDP [zz]:5060;branch={branch};rport",
    "SIP/2.0/UDP 127.0.0.1:9;branch={branch};rport=abc",
    "SIP/2.0/UDP 127.0.0.1;branch={branch};received=a\x00b",
    "garbage;branch={branch}",
    "SIP/2.0/UDP 127.0.0.1:9",
]
REQUIRED = ("From", "To", "Call-ID", "CSeq")


@dataclass(frozen=True)
class SipCase:
    """A request to render with a fresh Call-ID and branch, and what it must be answered."""

    method: str
    headers: tuple[tuple[str, bytes], ...] = ()
    """Header lines replacing (or, for a new name, added to) the valid request's."""
    drop: tuple[str, ...] = ()
    repeat: tuple[str, ...] = ()
    """Headers sent twice."""
    body: bytes | None = None
    """None: an SDP offer for INVITE, empty otherwise."""
    length: str | None = None
    """The Content-Length value; None: the true length."""
    flips: tuple[tuple[float, int], ...] = ()
    """(position as a fraction of the datagram, new byte)."""
    cut: float | None = None
    newline: bytes = b"\r\n"
    expect: int | None = None
    """The status the request must be answered with; None: any answer, or none."""

    def render(self, call_id: str, branch: str, phone_port: int, server_port: int) -> bytes:
        body = self.body
        if body is None:
            body = offer_sdp(40000).encode() if self.method == "INVITE" else b""
        length = str(len(body)) if self.length is None else self.length
        lines: dict[str, bytes] = {
            "Via": f"SIP/2.0/UDP 127.0.0.1:{phone_port};branch={branch};rport".encode(),
            "From": f"<sip:fuzz@127.0.0.1:{phone_port}>;tag=fz".encode(),
            "To": f"<sip:support@127.0.0.1:{server_port}>".encode(),
            "Call-ID": call_id.encode(),
            "CSeq": f"1 {self.method}".encode(),
            "Contact": f"<sip:fuzz@127.0.0.1:{phone_port}>".encode(),
            "Max-Forwards": b"70",
            "Content-Type": b"application/sdp" if body else b"",
            "Content-Length": length.replace("{more}", str(len(body) + 1)).encode(),
        }
        for name, value in self.headers:
            lines[name] = value.replace(b"{branch}", branch.encode()).replace(
                b"{method}", self.method.encode()
            )
        request_line = f"{self.method} sip:support@127.0.0.1:{server_port} SIP/2.0".encode()
        head = [request_line]
        for name, value in lines.items():
            if name not in self.drop and not (name == "Content-Type" and not value):
                head += [name.encode() + b": " + value] * (2 if name in self.repeat else 1)
        data = bytearray(self.newline.join(head) + self.newline * 2 + body)
        for where, byte in self.flips:
            data[min(int(where * len(data)), len(data) - 1)] = byte
        if self.cut is not None:
            data = data[: max(1, int(self.cut * len(data)))]
        return bytes(data)


def _sdp_is_malformed(body: bytes) -> bool:
    try:
        parse_sdp(body.decode("utf-8", errors="replace"))
    except ValueError:
        return True
    return False


@st.composite
def sip_cases(draw: st.DrawFn) -> SipCase:
    method = draw(st.sampled_from(SIP_METHODS))
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "drop",
                "duplicate",
                "huge",
                "cseq",
                "length",
                "sdp",
                "media",
                "non-utf8",
                "via",
                "flips",
                "cut",
                "lf",
            ]
        )
    )
    answered = method != "ACK"  # an ACK is never answered
    if kind == "drop":
        names = draw(st.lists(st.sampled_from(["Via", *REQUIRED, "Contact"]), min_size=1))
        required_gone = any(name in REQUIRED for name in names)
        expect = 400 if answered and "Via" not in names and required_gone else None
        return SipCase(method, drop=tuple(names), expect=expect)
    if kind == "duplicate":
        names = draw(st.lists(st.sampled_from(["Via", *REQUIRED, "Content-Length", "Contact"])))
        return SipCase(method, repeat=tuple(names))
    if kind == "huge":
        size = draw(st.integers(1000, 60000))
        name = draw(st.sampled_from(["X-Flood", "Subject", "User-Agent", "To"]))
        return SipCase(method, headers=((name, b"A" * size),))
    if kind == "cseq":
        value = draw(st.sampled_from(BAD_CSEQS))
        return SipCase(
            method, headers=(("CSeq", value.encode()),), expect=400 if answered else None
        )
    if kind == "length":
        value = draw(st.sampled_from(BAD_LENGTHS))
        return SipCase(method, length=value, expect=400 if answered else None)
    if kind == "sdp":
        body = draw(st.sampled_from(BAD_SDPS) | st.binary(min_size=1, max_size=100))
        malformed = _sdp_is_malformed(body)
        return SipCase("INVITE", body=body, expect=400 if malformed else None)
    if kind == "media":
        return SipCase("INVITE", body=draw(st.sampled_from(UNREACHABLE_SDPS)), expect=488)
    if kind == "non-utf8":
        name = draw(st.sampled_from(["From", "To", "Contact", "Call-ID", "Subject"]))
        junk = draw(st.binary(min_size=1, max_size=8)) + b"\xff\xfe"
        return SipCase(method, headers=((name, junk),))
    if kind == "via":
        return SipCase(method, headers=(("Via", draw(st.sampled_from(ODD_VIAS)).encode()),))
    if kind == "flips":
        flips = draw(
            st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8)
        )
        return SipCase(method, flips=tuple(flips))
    if kind == "cut":
        return SipCase(method, cut=draw(st.floats(0, 1)))
    if kind == "lf":
        return SipCase(method, newline=b"\n")
    return SipCase(method, expect=200 if method in ("OPTIONS", "INVITE") else None)


sip_datagrams = st.one_of(st.binary(max_size=400).map(lambda data: (data, None)), sip_cases())


STUN_ANSWER = bytes(
    stun.Message(
        stun.Method.BINDING, stun.Class.RESPONSE, attributes={"XOR-MAPPED-ADDRESS": ("1.2.3.4", 5)}
    )
)
"""A STUN Binding answer, as a registrar sends to a keep-alive (cut short, it is malformed)."""


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_sip_datagrams_never_disturb_the_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    settings_ = SipSettings(host="127.0.0.1", port=0)
    config = ServerConfig(sip=settings_, max_sessions=1, rate_limit_per_min=0)
    async with voice_server(None, config) as server:
        sip = server.app[SIP]
        phone = await SipPhone.open(sip.port)
        try:
            await _fuzz_sip(server, phone, caplog)
        finally:
            await phone.close()
            for call in list(sip.calls.values()):
                await call.hangup("test over", by_peer=True)


def _problems(records: list[logging.LogRecord]) -> list[str]:
    """Error records of the server and the libraries it drives: an exception nobody handled."""
    return [
        f"{record.name}: {record.getMessage()[:300]}"
        for record in records
        if record.levelno >= logging.ERROR
        and record.name.split(".")[0] in ("server", "aiosipua", "aiortp", "asyncio")
    ]


async def _fuzz_sip(server: TestServer, phone: SipPhone, caplog: pytest.LogCaptureFixture) -> None:
    sip = server.app[SIP]
    bridge = LoopBridge()
    numbers = iter(range(1_000_000))
    answers: Counter[int | None] = Counter()

    async def replies_to(branch: str, until: Callable[[SipResponse], bool]) -> list[SipResponse]:
        """Responses to the request with Via ``branch``, up to one ``until`` accepts."""
        seen: list[SipResponse] = []
        async with asyncio.timeout(10):
            while True:
                message = await phone.endpoint.inbox.get()
                if not isinstance(message, SipResponse):
                    continue
                if branch in (message.headers.get_first("via") or ""):
                    seen.append(message)
                if branch in (message.headers.get_first("via") or "") and until(message):
                    return seen

    async def exchange(datagram: bytes | SipCase, expect: int | None) -> None:
        number = next(numbers)
        branch = f"z9hG4bKfuzz{number}x"
        if isinstance(datagram, SipCase):
            data = datagram.render(f"fuzz-{number}", branch, phone.port, sip.port)
        else:
            data = datagram
        records = len(caplog.records)
        phone.send_raw(data)
        # an OPTIONS after every datagram: the endpoint still answers, and everything it said
        # synchronously about the datagram (400s, 100 Trying) has arrived before the 200
        probe = f"z9hG4bKprobe{number}x"
        phone.send_raw(SipCase("OPTIONS").render(f"probe-{number}", probe, phone.port, sip.port))
        phone_inbox = phone.endpoint.inbox
        before: list[SipResponse] = []
        async with asyncio.timeout(10):
            while True:
                message = await phone_inbox.get()
                if not isinstance(message, SipResponse):
                    continue
                via = message.headers.get_first("via") or ""
                if probe in via:
                    assert message.status_code == 200
                    break
                if branch in via:
                    before.append(message)
        statuses = [m.status_code for m in before]
        if 100 in statuses and not any(code >= 200 for code in statuses):  # an INVITE in hand
            final = await replies_to(branch, lambda m: m.status_code >= 200)
            statuses += [m.status_code for m in final]
        answering = [t for t in asyncio.all_tasks() if t.get_name().startswith("sip-invite:")]
        if answering:  # an INVITE whose answers went nowhere (an odd Via) may still start a call
            await asyncio.wait(answering, timeout=10)
        for call in list(sip.calls.values()):  # no BYE: the mutated Contact is no one's
            await call.hangup("fuzz example over", by_peer=True)
        finals = [code for code in statuses if code >= 200]
        answers[finals[0] if finals else None] += 1
        if expect is not None:
            assert expect in finals, (data[:300], statuses)
        if 400 in finals:
            (bad,) = [m for m in before if m.status_code == 400]
            assert bad.reason_phrase
        assert not _problems(caplog.records[records:]), data[:300]

    @given(case=sip_datagrams)
    # a Via port of 99999 made asyncio close the SIP socket for good: deaf from then on
    @example(case=SipCase("OPTIONS", headers=(("Via", ODD_VIAS[0].encode()),)))
    # these raised inside aiosipua's handler (a logged traceback) and went unanswered
    @example(case=SipCase("INVITE", headers=(("CSeq", b"banana INVITE"),), expect=400))
    @example(case=SipCase("INVITE", body=BAD_SDPS[0], expect=400))
    # these were taken as they were (RFC 3261: 400)
    @example(case=SipCase("INVITE", length="{more}", expect=400))
    @example(case=SipCase("INVITE", headers=(("CSeq", b"1"),), expect=400))
    # these started calls whose RTP went nowhere: a warning every 20 ms, or asyncio closing the
    # RTP socket (port 70000)
    @example(case=SipCase("INVITE", body=UNREACHABLE_SDPS[0], expect=488))
    @example(case=SipCase("INVITE", body=UNREACHABLE_SDPS[1], expect=488))
    @example(case=SipCase("INVITE", expect=200))
    @example(case=(b"", None))
    # STUN on the SIP socket (keep-alives' answers): a request, and a truncated answer
    @example(case=(bytes(stun.Message(stun.Method.BINDING, stun.Class.REQUEST)), None))
    @example(case=(STUN_ANSWER[:-4], None))
    @fuzz(600)
    def check(case: tuple[bytes, None] | SipCase) -> None:
        if isinstance(case, SipCase):
            bridge.run(exchange(case, case.expect))
        else:
            bridge.run(exchange(*case))

    await fuzz_on_loop(check)
    assert answers[400] > 0
    assert answers[200] > 0


# -- 4. playbook files ---------------------------------------------------------------------------

EXAMPLE_DOCS: dict[str, Any] = {
    path.name: yaml.safe_load(path.read_text()) for path in sorted(EXAMPLES.glob("*.yaml"))
}
WRONG_TYPES: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], {}, [1], {"a": 1}, "nowhere"]


def _spots(tree: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in a parsed document."""
    found: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            found.append((node, key))
            if isinstance(value, dict | list):
                stack.append(value)
    return found


@st.composite
def mutated_examples(draw: st.DrawFn) -> Any:
    """A real example playbook with keys dropped, values of the wrong type, unknown keys and
    stages, duplicated entries, huge strings."""
    return _mutated(draw, EXAMPLE_DOCS[draw(st.sampled_from(sorted(EXAMPLE_DOCS)))])


def _mutated(draw: st.DrawFn, original: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``original`` with one to four of the mutations of :func:`mutated_examples`."""
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 4))):
        spots = _spots(doc)
        container, key = spots[draw(st.integers(0, len(spots) - 1))]
        op = draw(st.sampled_from(["drop", "type", "value", "key", "stage", "duplicate", "huge"]))
        if op == "drop":
            del container[key]
        elif op == "type":
            container[key] = copy.deepcopy(draw(st.sampled_from(WRONG_TYPES)))
        elif op == "value":
            container[key] = draw(json_values)
        elif op == "key" and isinstance(container, dict):
            container[draw(st.sampled_from(FIELD_NAMES) | st.text(max_size=10))] = draw(scalars)
        elif op == "stage" and doc.get("transitions"):
            transition = draw(st.sampled_from(doc["transitions"]))
            unknown = draw(st.text(max_size=10) | st.sampled_from(["*", "nowhere"]))
            if isinstance(transition, dict) and isinstance(transition.get("action"), dict):
                field = draw(st.sampled_from(["from", "target_stage"]))
                target = transition if field == "from" else transition["action"]
                target[field] = unknown
        elif op == "duplicate" and isinstance(container, list):
            container.append(copy.deepcopy(container[key]))
        elif op == "huge":
            container[key] = draw(st.sampled_from(["x", "é", "\n"])) * 100_000
        if not doc:
            break
    return doc


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, bytes]:
    """(file suffix, contents): random trees or mutated examples, as YAML or JSON."""
    tree = draw(mutated_examples() | json_values)
    suffix = draw(st.sampled_from([".yaml", ".yml", ".json"]))
    if suffix == ".json":
        text = json.dumps(tree, ensure_ascii=draw(st.booleans()))
    else:
        text = yaml.safe_dump(tree, allow_unicode=draw(st.booleans()), sort_keys=False)
    return suffix, text.encode()


BYTE_NOISE = [b"\xff", b"\xc3", b"\x00", b"\t", b"&a ", b"*a ", b"!!binary ", b"<<: ", b"? ", b"{"]


@st.composite
def garbled_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """A real example file with lines deleted or duplicated, bytes inserted (non-UTF-8, tabs,
    stray anchors, aliases and tags) or the end cut off."""
    name = draw(st.sampled_from(sorted(EXAMPLE_DOCS)))
    lines = (EXAMPLES / name).read_bytes().split(b"\n")
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "insert", "cut"]))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "insert":
            at = draw(st.integers(0, len(lines[i])))
            noise = draw(st.sampled_from(BYTE_NOISE) | st.binary(min_size=1, max_size=4))
            lines[i] = lines[i][:at] + noise + lines[i][at:]
        else:
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    return ".yaml", b"\n".join(lines)


def _bomb(width: int, depth: int) -> str:
    """A YAML value whose aliases expand to ``width ** depth`` scalars (a billion laughs)."""
    value = "&l0 [" + ", ".join(["lol"] * width) + "]"
    for level in range(1, depth):
        value = f"&l{level} [{value}, " + ", ".join([f"*l{level - 1}"] * (width - 1)) + "]"
    return value


@st.composite
def alias_bombs(draw: st.DrawFn) -> tuple[str, bytes]:
    """An example playbook with one value replaced by an alias bomb, a self-referencing alias or
    a deep nest of lists."""
    doc = copy.deepcopy(EXAMPLE_DOCS[draw(st.sampled_from(sorted(EXAMPLE_DOCS)))])
    spots = _spots(doc)
    container, key = spots[draw(st.integers(0, len(spots) - 1))]
    container[key] = "BOMB_GOES_HERE"
    value = draw(
        st.builds(_bomb, st.integers(2, 10), st.integers(1, 8))
        | st.sampled_from(["&r [x, *r]", "&r {a: *r}"])
        | st.integers(1, 1500).map(_deep)
    )
    text = yaml.safe_dump(doc, sort_keys=False).replace("BOMB_GOES_HERE", value, 1)
    return ".yaml", text.encode()


playbook_files = st.one_of(documents(), garbled_files(), alias_bombs())

DOCUMENT_PROBLEMS = (  # errors about the whole file, which has no single field or line to name
    "a playbook must be a mapping",
    "more than",
    "nested",
    "a YAML alias",
    "invalid JSON value",
    "YAML error",
)


LOAD_BUDGET_S = 10.0
"""Longest a fuzzed file may take to load or fail (the slowest take milliseconds): a parser or
validator stuck on a huge line or an alias bomb fails instead of hanging the run."""


def load_error(path: Path) -> PlaybookError | None:
    """What loading ``path`` raised; None when it loaded. Any other exception propagates."""
    try:
        load_playbook(path)
    except PlaybookError as error:
        return error
    return None


def check_playbook_file(folder: Path, suffix: str, content: bytes) -> None:
    """Loads within a few seconds, or raises one PlaybookError listing its problems, one clear
    line each (at most MAX_PROBLEMS, then a count), each naming the file and the line or field
    (a Markdown file's always a line of it)."""
    path = folder / f"fuzzed{suffix}"
    path.write_bytes(content)
    started = time.monotonic()
    error = load_error(path)
    assert time.monotonic() - started < LOAD_BUDGET_S, f"loading took over {LOAD_BUDGET_S} s"
    if error is None:
        return
    assert error.problems
    assert (error.source, error.path, error.message, error.line) == astuple(error.problems[0])
    shown = [str(problem) for problem in error.problems[:MAX_PROBLEMS]]
    hidden = len(error.problems) - len(shown)
    counted = [f"... and {hidden} more problem{'s' if hidden > 1 else ''}"] if hidden else []
    assert str(error) == "\n".join(shown + counted)
    for problem, message in zip(error.problems, shown, strict=False):
        check_problem(path, content, problem, message)


def check_problem(path: Path, content: bytes, problem: Problem, message: str) -> None:
    """One problem of ``path``: its line names the file and the line or field."""
    where = path.name if problem.line is None else f"{path.name}:{problem.line}"
    assert message.startswith(f"{where}: "), message
    assert problem.source == path.name
    assert problem.message.strip()
    assert "\n" not in message
    assert "\r" not in message
    assert len(message) < 1000, message[:300]
    if path.suffix == ".md":
        lines = _line_count(content)
        assert problem.line is not None or " at line " in message, message
        assert problem.line is None or 1 <= problem.line <= lines, f"{lines} lines: {message}"
        return
    named = problem.path or " at line " in message
    assert named or any(known in message for known in DOCUMENT_PROBLEMS), message


def _line_count(content: bytes) -> int:
    """Lines as an editor shows them: ended by ``\\n``, ``\\r\\n`` or ``\\r`` (as in CommonMark),
    the last one maybe not."""
    lines = re.split(rb"\r\n|\r|\n", content)
    return max(1, len(lines) - (lines[-1] == b""))


@pytest.fixture
def playbook_dir(tmp_path: Path) -> Path:
    """A folder with the examples' tools modules, so mutated examples reach the checks of
    tools and condition functions."""
    for tools in EXAMPLES.glob("*_tools.py"):
        shutil.copy(tools, tmp_path / tools.name)
    return tmp_path


@given(file=playbook_files)
@example(file=(".yaml", b"id: \xff\xfe\n"))  # UnicodeDecodeError escaped (regression)
@example(file=(".yaml", _deep(3000).encode()))  # RecursionError
@example(file=(".json", _deep(3000).encode()))  # RecursionError
@example(file=(".yaml", b"id: " + b"1" * 5000))  # ValueError: int of more than 4300 digits
@example(file=(".json", b'{"id": ' + b"1" * 5000 + b"}"))  # the same, from json
@example(file=(".yaml", b"id: 2001-02-30\n"))  # ValueError: day is out of range for month
@example(file=(".yaml", b"id: 2001-01-01 00:00:00 +99:00\n"))  # ValueError: bad UTC offset
@example(file=(".yaml", b"id: a\x00b\n"))  # multi-line ReaderError message
@example(file=(".yaml", b"id: a\ntools_module: " + b"m" * 5000 + b"\n"))  # OSError: too long
@example(  # pydantic spent forever on a discriminator holding 10**8 aliased scalars
    file=(
        ".yaml",
        b"id: a\nname: a\ninitial_stage: s\nstages: [{id: s, name: s, system_prompt: x}]\n"
        b"transitions: [{id: t, from: s, action: {target_stage: s}, condition: {type: "
        + _bomb(10, 8).encode()
        + b"}}]\n",
    )
)
@example(file=(".yaml", b"x: &r [x, *r]\n"))  # a value holding itself
@example(file=(".yaml", b"? " + b"A" * 100_000 + b"\n: x\n"))  # to_snake took minutes on the key
@fuzz(300)
def test_playbook_files_load_or_fail_with_one_clear_line(
    playbook_dir: Path, file: tuple[str, bytes]
) -> None:
    check_playbook_file(playbook_dir, *file)


INVALID_FILES = {
    "non_utf8.yaml": b"id: caf\xe9\n",
    "bomb.yaml": b"id: " + _bomb(10, 8).encode() + b"\n",
    "deep.json": _deep(3000).encode(),
    "digits.yaml": b"id: " + b"9" * 5000 + b"\n",
    "date.yaml": b"id: x\nname: x\ninitial_stage: 2024-02-30\n",
    "stage.yaml": (EXAMPLES / "support.yaml")
    .read_bytes()
    .replace(b"target_stage: farewell", b"target_stage: 'far\\nwell'", 1),
    "types.json": json.dumps({"id": 3, "name": [], "initial_stage": {}, "stages": "x"}).encode(),
}


@pytest.mark.parametrize("name", sorted(INVALID_FILES))
def test_chat_refuses_an_invalid_playbook_with_a_line_per_problem_and_status_2(
    playbook_dir: Path,
    name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda *args, **kwargs: None)  # keep pytest's
    path = playbook_dir / name
    path.write_bytes(INVALID_FILES[name])
    code = cli.main(["chat", str(path), "--llm-base-url", "http://127.0.0.1:9/v1"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    error = load_error(path)
    assert error is not None
    assert lines == [f"vocable: {line}" for line in error.lines()], err
    assert len(lines) == (4 if name == "types.json" else 1), err  # types.json: four bad fields
    for line in lines:
        assert re.match(rf"vocable: {re.escape(name)}(:\d+)?: ", line), line
        assert len(line) < 300


# -- 4b. Markdown playbook files -----------------------------------------------------------------

MARKDOWN_EXAMPLE = EXAMPLES / "markdown" / "support.md"
_, _FRONT_TEXT, _ = MARKDOWN_EXAMPLE.read_text().split("---\n", 2)
MARKDOWN_FRONT: dict[str, Any] = yaml.safe_load(_FRONT_TEXT)
STAGE_TITLES = ["Greeting", "Identify the order {#identify}", "Order help", "Farewell", "A"]
STAGE_REFS = ["greeting", "identify", "order_help", "farewell", "Order help", "`farewell`", "x"]
TOOL_NAMES = ["lookup_order", "`cancel_order`", "mcp:stock", "set_language", "delegate", "1x"]
ODD_CHARS = [
    *"\u2028\u2029\x85\x0b\x0c\x1c\r\x00\t\ufeff\u200b\u202e\u0301",
    *"→—–＃#{}`\\:-*>|'\"&!%@",
    "🙂",
    "\U0010ffff",
]
odd_text = st.text(st.characters(codec="utf-8") | st.sampled_from(ODD_CHARS), max_size=24)
words = st.sampled_from(["Ask.", "Say hello.", "x", "", " ", "{#x}", "# x", "--- ", "..."])
prose = words | odd_text


headings = st.builds(
    lambda hashes, space, title, anchor, closing: f"{hashes}{space}{title}{anchor}{closing}",
    st.sampled_from(["#", "##", "###", "####", " ##", "\t#", "＃"]),
    st.sampled_from([" ", "\t", "", "   "]),
    st.sampled_from([*STAGE_TITLES, "Steps", "Triggers", "Tools", "!!!", ""]) | odd_text,
    st.sampled_from(["", " {#identify}", "{#x}", " {#}", " {#a b}", " {#{#x}}"])
    | odd_text.map(lambda text: f" {{#{text}}}"),
    st.sampled_from(["", " #", " ###", "#", " {#y}"]),
)
stage_headings = st.sampled_from(STAGE_TITLES).map(lambda title: f"## {title}") | headings
steps = st.builds(
    lambda number, mark, text: f"{number}{mark} {text}",
    st.sampled_from(["1", "2", "10", "0", "1234", ""]),
    st.sampled_from([".", ")", "", ":"]),
    prose,
) | prose.map(lambda text: f"   {text}")
triggers = st.builds(
    lambda bullet, condition, arrow, target: f"{bullet}{condition}{arrow}{target}",
    st.sampled_from(["- ", "* ", "+ ", "-", ""]),
    st.sampled_from(["The caller asks about an order", "x.", ""]) | odd_text,
    st.sampled_from([" → ", " -> ", "=>", " → → ", " ", ""]),
    st.sampled_from(STAGE_REFS) | odd_text,
)
tools = st.builds(
    lambda bullet, name, note: f"{bullet}{name}{note}",
    st.sampled_from(["- ", "* ", "-", ""]),
    st.sampled_from(TOOL_NAMES) | odd_text,
    st.sampled_from(["", ": only after a confirmation", " - a note", " — a note", " x"]),
)
SECTION_LINES = {"Steps": steps, "Triggers": triggers, "Tools": tools}
fences = st.sampled_from(["```", "~~~", "   ```text", "````", "    ```", "~~~ ```"])
fills = st.sampled_from([" ", "\t", "x", "A", "#", "é", "→", " #", "-", "{", "`", "\x85", "\u2028"])
huge_lines = st.builds(
    lambda start, fill, end: start + fill * 100_000 + end,
    st.sampled_from(["", "# a", "## a", "### ", "- a", "- ", "1. ", "id: "]),
    fills,
    st.sampled_from(["", "b", "{#b}", " → a", " #", ": x"]),
)
any_lines = st.one_of(
    headings, stage_headings, steps, triggers, tools, fences, prose, huge_lines, st.just("---")
)
YAML_NOISE = ["id: [x", "- a", "a: &r [x, *r]", "stages: x", "stages: {zz: {}}", "\tid: x", "? x"]


@st.composite
def front_matters(draw: st.DrawFn) -> list[str]:
    """No front matter, or one holding the example's (mutated), a random YAML tree, YAML noise
    or an alias bomb; closed by ``---``, ``...`` or never."""
    kind = draw(st.sampled_from(["none", "example", "example", "tree", "noise", "bomb"]))
    if kind == "none":
        return []
    if kind == "example":
        tree: Any = _mutated(draw, MARKDOWN_FRONT) if draw(st.booleans()) else MARKDOWN_FRONT
        text = yaml.safe_dump(tree, allow_unicode=draw(st.booleans()), sort_keys=False)
    elif kind == "tree":
        text = yaml.safe_dump(draw(json_values), allow_unicode=draw(st.booleans()))
    elif kind == "noise":
        text = "\n".join(draw(st.lists(st.sampled_from(YAML_NOISE) | odd_text, max_size=4)))
    else:
        value = draw(
            st.builds(_bomb, st.integers(2, 10), st.integers(1, 8))
            | st.sampled_from(["&r [x, *r]", "&r {a: *r}"])
            | st.integers(1, 1500).map(_deep)
        )
        text = f"stages: {{greeting: {{description: {value}}}}}"
    closing = draw(st.sampled_from([["---"], ["---"], ["..."], ["--- "], []]))
    return ["---", *text.splitlines(), *closing]


@st.composite
def markdown_playbooks(draw: st.DrawFn) -> list[str]:
    """A playbook built from the grammar: front matter, ``#`` title and text, ``##`` stages with
    their text and ``### Steps``/``Triggers``/``Tools`` sections; then a few lines of any kind
    inserted anywhere."""
    lines = draw(front_matters())
    lines.append(draw(st.just("# Acme support") | headings))
    lines += draw(st.lists(prose, max_size=2))
    for _ in range(draw(st.integers(0, 4))):
        lines.append(draw(stage_headings))
        lines += draw(st.lists(prose, max_size=2))
        for section in draw(st.lists(st.sampled_from(sorted(SECTION_LINES)), max_size=3)):
            lines.append(f"### {section}")
            lines += draw(st.lists(SECTION_LINES[section], max_size=3))
    for _ in range(draw(st.integers(0, 3))):
        lines.insert(draw(st.integers(0, len(lines))), draw(any_lines))
    return lines


@st.composite
def garbled_markdown(draw: st.DrawFn) -> list[str]:
    """The Markdown example with lines deleted, duplicated, swapped, cut, replaced by any line
    of the grammar, or with odd characters inserted."""
    lines = MARKDOWN_EXAMPLE.read_text().splitlines()
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "cut", "replace", "insert"]))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif op == "replace":
            lines[i] = draw(any_lines)
        else:
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(st.sampled_from(ODD_CHARS) | odd_text) + lines[i][at:]
    return lines


MARKDOWN_LINES = MARKDOWN_EXAMPLE.read_text().splitlines()
MARKED_LINES = [line for line in MARKDOWN_LINES if re.match(r"#|- |\d\.", line)]


@st.composite
def stretched_markdown(draw: st.DrawFn) -> list[str]:
    """The Markdown example with 100,000 of one character (often a space) inserted into one
    line, often a heading, trigger, tool or step: a regular expression that backtracks over
    such a run takes hours."""
    lines = list(MARKDOWN_LINES)
    line = draw(st.sampled_from(MARKED_LINES) | st.sampled_from(MARKDOWN_LINES))
    i = lines.index(line)
    at = draw(st.integers(0, len(line)))
    lines[i] = line[:at] + draw(st.just(" ") | fills) * 100_000 + line[at:]
    return lines


@st.composite
def markdown_files(draw: st.DrawFn) -> bytes:
    """A grammar-built, garbled or stretched playbook with ``\\n``, ``\\r\\n`` or ``\\r`` line
    ends, maybe a byte-order mark, maybe a byte that is not UTF-8."""
    lines = draw(markdown_playbooks() | garbled_markdown() | stretched_markdown())
    end = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    last = draw(st.sampled_from([end, end, ""]))
    content = (draw(st.sampled_from(["", "", "\ufeff"])) + end.join(lines) + last).encode()
    if draw(st.sampled_from([False] * 9 + [True])):
        at = draw(st.integers(0, len(content)))
        noise = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"]))
        content = content[:at] + noise + content[at:]
    return content


@pytest.fixture
def markdown_dir(playbook_dir: Path) -> Path:
    """A folder beside the examples' tools modules, as the Markdown example's is (it names
    ``../support_tools.py``)."""
    folder = playbook_dir / "markdown"
    folder.mkdir()
    return folder


def _support_md(old: str, new: str) -> bytes:
    """The Markdown example with the first ``old`` replaced by ``new``."""
    text = MARKDOWN_EXAMPLE.read_text()
    assert old in text
    return text.replace(old, new, 1).encode()


@given(content=markdown_files())
@example(content=MARKDOWN_EXAMPLE.read_bytes())
# regressions: regular expressions backtracking for hours over 100,000 spaces (the heading, the
# {#id}, the trigger's arrow, the bullet), and pydantic's to_snake for minutes over a key
@example(content=_support_md("## Identify the", "## Identify" + " " * 100_000 + "the"))
@example(content=_support_md("cancellation →", "cancellation" + " " * 100_000 + "x →"))
@example(content=_support_md("- lookup_order\n\n## Order", "- " + " " * 100_000 + "\n\n## Order"))
@example(content=_support_md("id: support", "? " + "A" * 100_000 + "\n: x"))
@example(content=_support_md("## Greeting", "## " + "x" * 100_000))  # a 100,000-character error
@example(content=_support_md("- id: identify_found", "- id: [x]"))  # TypeError: unhashable
@example(content=_support_md("Close the call politely.", "&r [x, *r]"))  # RecursionError
# errors at line 100 of a 91-line file: U+2028 and U+0085 counted as line ends
@example(content=_support_md("say goodbye.", "say goodbye." + "\u2028" * 9 + "```"))
@example(content=_support_md("id: support", "id: support" + "\x85" * 99 + "x: ["))
@example(content=("# Many\n" + "".join(f"## S{i}\nx\n" for i in range(30_000))).encode())  # n²
@fuzz(300)
def test_markdown_playbooks_load_or_fail_with_one_clear_line(
    markdown_dir: Path, content: bytes
) -> None:
    check_playbook_file(markdown_dir, ".md", content)


# -- 5. the Authorization header -----------------------------------------------------------------

TOKEN = "s3cret-Tok"
GOOD_AUTH = f"Bearer {TOKEN}".encode()
ROUTES = [("POST", "/offer"), ("DELETE", "/sessions/x")]
auth_values = st.one_of(
    st.binary(max_size=40),
    st.binary(max_size=30).map(lambda tail: b"Bearer " + tail),
    st.text(max_size=30).map(lambda text: f"Bearer {text}".encode()),
    st.sampled_from([GOOD_AUTH, GOOD_AUTH.upper(), GOOD_AUTH + b"x", b"Basic czNjcmV0", b"Bearer"]),
    st.integers(0, len(GOOD_AUTH)).map(lambda n: GOOD_AUTH[:n]),
).filter(lambda value: b"\r" not in value and b"\n" not in value)  # one header, not two


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_authorization_headers_get_401_unless_right_and_never_a_5xx() -> None:
    engines = Engines(
        transcriber(), synthesizer(), load_playbooks(EXAMPLES), LLMProvider.serving(None)
    )
    app = create_app(ServerConfig(auth_token=TOKEN, rate_limit_per_min=0), engines)
    bridge = LoopBridge()
    statuses: Counter[int] = Counter()
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        host, port = client.server.host, client.server.port
        assert port is not None

        async def send(value: bytes, route: tuple[str, str]) -> None:
            headers = b"Authorization: " + value + b"\r\nContent-Type: application/json\r\n"
            status, payload = await raw_request(host, port, *route, headers, b'{"sdp": "x"}')
            statuses[status] += 1
            if value.strip(b" \t") == GOOD_AUTH:  # past the gate: refused for the body or id
                assert status == (400 if route[0] == "POST" else 404), (value, status, payload)
            elif any((byte < 0x20 and byte != 0x09) or byte == 0x7F for byte in value):
                assert status in (400, 401), (value, status)  # the HTTP parser may refuse it
            else:
                assert (status, payload) == (401, {"error": "missing or wrong bearer token"})

        @given(value=auth_values, route=st.sampled_from(ROUTES))
        @example(value=b"Bearer \xff\xfe", route=("POST", "/offer"))  # once a 500 (regression)
        @example(value=b"Bearer \xff\xfe", route=("DELETE", "/sessions/x"))
        @example(value=GOOD_AUTH, route=("DELETE", "/sessions/x"))
        @fuzz(200)
        def check(value: bytes, route: tuple[str, str]) -> None:
            bridge.run(send(value, route))

        await fuzz_on_loop(check)
    assert statuses[401] > 100
    assert max(statuses) < 500


# -- 6. the media WebSocket (/twilio/media) ------------------------------------------------------

media_events = st.sampled_from(["media", "dtmf", "mark", "start", "connected", "clear", "x"])
media_fields = st.fixed_dictionaries(
    {},
    optional={
        "track": st.sampled_from(["inbound", "inbound_track", "outbound"]) | json_values,
        "payload": st.binary(max_size=160).map(lambda data: base64.b64encode(data).decode())
        | json_values,
        "digit": st.sampled_from(["1", "#", "*", "A", "", "12"]) | json_values,
        "name": json_values,
    },
)
media_messages: st.SearchStrategy[str | bytes] = st.one_of(
    st.builds(
        lambda event, key, body, extra: json.dumps({"event": event, key: body, **extra}),
        media_events | json_values,
        st.sampled_from(["media", "dtmf", "mark", "start"]),
        media_fields | json_values,
        st.dictionaries(st.text(max_size=8), json_values, max_size=2),
    ),
    json_values.map(json.dumps),
    st.text(max_size=100),
    st.binary(max_size=100),
    st.integers(1, 3000).map(_deep),
)
start_rates = st.sampled_from([8000, 16000, 48000, 0, -8000, 7999, 48001, "8000", "abc", 8000.5])
start_details = st.fixed_dictionaries(
    {},
    optional={
        "streamSid": st.text(max_size=10) | json_values,
        "customParameters": st.dictionaries(
            st.sampled_from(["playbook", "caller"]),
            st.sampled_from(["support", "restaurant", "nope", ""]) | json_values,
            max_size=2,
        )
        | json_values,
        "mediaFormat": st.fixed_dictionaries(
            {},
            optional={
                "encoding": st.sampled_from(["audio/x-mulaw", "audio/x-alaw", "audio/l16"])
                | json_values,
                "sampleRate": start_rates | json_values,
                "channels": json_values,
            },
        )
        | json_values,
    },
)
start_messages = st.builds(
    lambda top, details: json.dumps({"event": "start", **top, "start": details}),
    st.fixed_dictionaries({}, optional={"streamSid": json_values, "stream_id": json_values}),
    start_details | json_values,
)


def _media_problems(records: list[logging.LogRecord]) -> list[str]:
    """Errors, or tracebacks at any level, from the server or aiohttp."""
    return [
        f"{record.name}: {record.getMessage()[:300]}"
        for record in records
        if (record.levelno >= logging.ERROR or record.exc_info)
        and record.name.split(".")[0] in ("server", "aiohttp", "asyncio")
    ]


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_media_stream_starts_start_a_call_or_get_1008(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each example a new stream: its ``start`` begins a call (which a ``stop`` then ends, 1000)
    or is refused with 1008 and a reason; never 1011, a 5xx or a traceback."""
    caplog.set_level(logging.WARNING)
    config = ServerConfig(rate_limit_per_min=0, session=SessionSettings(greet=False))
    bridge = LoopBridge()
    outcomes: Counter[int] = Counter()
    async with voice_server(None, config) as server, aiohttp.ClientSession() as http:
        calls = server.app[CALLS]

        async def open_stream(start: str) -> None:
            records = len(caplog.records)
            ws = await http.ws_connect(server.make_url("/twilio/media"))
            try:
                await ws.send_str(start)
                await ws.send_str(json.dumps({"event": "stop"}))
                closing = await asyncio.wait_for(ws.receive(), 10)
            finally:
                await ws.close()
            assert closing.type == aiohttp.WSMsgType.CLOSE, (start, closing)
            code, reason = closing.data, str(closing.extra)
            if code == 1008:
                assert reason.startswith(("invalid start message: ", "unknown playbook")), reason
            else:
                assert (code, reason) == (1000, "stream ended"), (start, closing)
            outcomes[code] += 1
            async with asyncio.timeout(5):
                while len(calls):  # noqa: ASYNC110 - the registry has no event for this
                    await asyncio.sleep(0.01)
            assert not _media_problems(caplog.records[records:]), start

        @given(start=start_messages)
        @example(
            start=json.dumps({"event": "start", "start": {"mediaFormat": {"sampleRate": "abc"}}})
        )
        @example(
            start=json.dumps({"event": "start", "start": {"mediaFormat": {"sampleRate": -8000}}})
        )
        @example(start=json.dumps({"event": "start", "start": {"customParameters": ["support"]}}))
        @example(
            start=json.dumps({"event": "start", "start": {"mediaFormat": {"sampleRate": 1e400}}})
        )
        @example(start=json.dumps({"event": "start", "start": {}}))
        @fuzz(120)
        def check(start: str) -> None:
            bridge.run(open_stream(start))

        await fuzz_on_loop(check)
    assert outcomes[1000] > 0
    assert outcomes[1008] > 0


@pytest.mark.slow
@pytest.mark.filterwarnings(LOOP_USES_RANDOM)
async def test_media_stream_messages_never_end_the_call(caplog: pytest.LogCaptureFixture) -> None:
    """One call; each example a message and then a ``mark`` probe, which the call must record:
    the message was taken or ignored, and the call goes on."""
    caplog.set_level(logging.WARNING)
    config = ServerConfig(rate_limit_per_min=0, session=SessionSettings(greet=False))
    bridge = LoopBridge()
    probes = iter(range(1_000_000))
    async with voice_server(None, config) as server, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.make_url("/twilio/media"))
        await ws.send_json({"event": "start", "streamSid": "MZ1", "start": {}})
        calls = server.app[CALLS]
        async with asyncio.timeout(5):
            while not calls.calls:  # noqa: ASYNC110 - the registry has no event for this
                await asyncio.sleep(0.01)
        (call,) = calls.calls.values()
        assert isinstance(call, TwilioCall)

        async def exchange(message: str | bytes) -> None:
            probe = f"probe-{next(probes)}"
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_str(message)
            await ws.send_json({"event": "mark", "mark": {"name": probe}})
            async with asyncio.timeout(10):
                while probe not in call.marks_played:  # noqa: ASYNC110 - no event for this
                    await asyncio.sleep(0.005)
            assert not ws.closed
            assert calls.calls.get(call.id) is call

        @given(message=media_messages)
        @example(message=json.dumps({"event": "media", "media": ["payload"]}))  # AttributeError
        @example(message=json.dumps({"event": "dtmf", "dtmf": "1"}))  # (regressions)
        @example(message=json.dumps({"event": "mark", "mark": 5}))
        @example(message=_deep(3000))  # RecursionError in json.loads ended the call
        @example(message=json.dumps({"event": "start", "start": {"customParameters": []}}))
        @fuzz(200)
        def check(message: str | bytes) -> None:
            assume(not (isinstance(message, str) and '"stop"' in message))
            bridge.run(exchange(message))

        try:
            await fuzz_on_loop(check)
        finally:
            await ws.close()
        await asyncio.wait_for(call.ended.wait(), 10)
    assert not _media_problems(caplog.records)
