"""Call transfers to a person (``transfer_call``): the conversation's side against the scripted
LLM, media streams against a stand-in of Twilio's REST API, and SIP with real peers: sipp as the
caller, answering or refusing REFER, and for bridged transfers baresip as both the caller (which
refuses REFER) and the person (which answers and speaks), each recording what it heard for
Whisper. Real Whisper, Piper and webrtcvad in the calls."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import random
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from media import Speaker
from media.audio import silence
from media.g711 import pcm_to_ulaw
from playbooks import ChatClient, PlaybookOrchestrator, load_playbook
from playbooks.transfer import TRANSFER_TOOL, TransferOutcome, TransferRequest
from server.call.events import VoiceEvent
from server.config.server import ServerConfig, SipSettings, TransferApiSettings
from server.http.app import CALLS, SIP
from server.testkit.loopback import start_on_loopback
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from server.transports.sip.call import SipCall
from server.transports.sip.transfer import MAX_BACKLOG_MS, _Playout
from tests.support.baresip import FRAME_BYTES, RATE, Baresip, start_baresip, until, utterances
from tests.support.calls import answers_spoken, transcriber, voice_server, word_error_rate
from tests.support.phone import phone_audio
from tests.support.processes import free_port, stop_group
from tests.support.sipp import awaits_bye, hangs_up_after, run_sipp, sipp_result, start_sipp
from tests.support.speech import to_16k, tone
from tests.test_telephony import TwilioPhone

PUT_ME_THROUGH = "Please put me through to a person."
SORRY = "Sorry, nobody can take your call right now. How else can I help?"
HOLD = "You are being put through now. Please hold."
SCENARIOS = Path(__file__).parent / "sip"

PLAYBOOK = """
id: desk
name: Desk
initial_stage: help
global_system_prompt: You are a phone agent.
transfer: {to: "DESTINATION", say: Let me put you through., ring_timeout_ms: 4000}
stages:
  - id: help
    name: Help
    system_prompt: Help the caller.
"""


def _playbook(tmp_path: Path, destination: str, **replace: str) -> Path:
    """A folder holding the desk playbook, transferring to ``destination``."""
    text = PLAYBOOK.replace("DESTINATION", destination)
    for old, new in replace.items():
        assert text.count(old) == 1
        text = text.replace(old, new)
    folder = tmp_path / "playbooks"
    folder.mkdir(exist_ok=True)
    (folder / "desk.yaml").write_text(textwrap.dedent(text))
    return folder


def _transfers_then(
    after: str, summary: str = "Wants a human."
) -> Callable[[dict[str, Any]], Reply]:
    """The LLM: a request for a person gets ``transfer_call`` (with ``summary``); a transfer's
    result gets ``after``; anything else a short answer."""

    def reply(body: dict[str, Any]) -> Reply:
        if not body.get("stream"):
            return Reply(content='{"intent": "none", "confidence": 0}')
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply(content=after)
        if "person" in str(last.get("content", "")).lower():
            arguments = {"reason": "the caller asked for a person", "summary": summary}
            return Reply(tool_calls=[ScriptedToolCall(TRANSFER_TOOL, arguments)])
        return Reply(content="I can help with that.")

    return reply


def _tool_results(llm: ScriptedLLM) -> list[dict[str, Any]]:
    """The transfer results the LLM was given, in order."""
    found: list[dict[str, Any]] = []
    for request in llm.requests:
        for message in request["messages"]:
            if message["role"] == "tool" and json.loads(message["content"]) not in found:
                found.append(json.loads(message["content"]))
    return found


async def _wait(condition: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - state spread over the server, LLM and peers
            await asyncio.sleep(0.05)


# -- the conversation ------------------------------------------------------------------------------


@pytest.fixture
async def conversation(
    llm: ScriptedLLM, tmp_path: Path
) -> AsyncIterator[Callable[[], PlaybookOrchestrator]]:
    client = ChatClient.connect(llm.base_url, None, "m")
    playbook = load_playbook(_playbook(tmp_path, "sip:desk@pbx.example.com") / "desk.yaml")
    try:
        yield lambda: PlaybookOrchestrator(playbook, client)
    finally:
        await client.aclose()


async def test_a_failed_transfer_comes_back_to_the_llm_and_the_turn_goes_on(
    llm: ScriptedLLM, conversation: Callable[[], PlaybookOrchestrator]
) -> None:
    llm.script(_transfers_then(SORRY))
    orchestrator = conversation()
    asked: list[TransferRequest] = []

    async def busy(request: TransferRequest) -> TransferOutcome:
        asked.append(request)
        return TransferOutcome.failed("busy", "SIP/2.0 486 Busy Here")

    orchestrator.transferrer = busy
    events: list[str] = []
    orchestrator.on(lambda event: events.append(event.type))
    answer = await orchestrator.respond(PUT_ME_THROUGH)

    assert answer == SORRY
    (request,) = asked
    assert (request.destination, request.mode, request.say) == (
        "sip:desk@pbx.example.com",
        "blind",
        "Let me put you through.",
    )
    first = llm.requests[0]
    (tool,) = [t for t in first["tools"] if t["function"]["name"] == TRANSFER_TOOL]
    assert tool["function"]["parameters"]["required"] == ["reason"]
    assert f"put the caller through to a person with {TRANSFER_TOOL}" in str(
        first["messages"][0]["content"]
    )
    (result,) = _tool_results(llm)
    assert result["transferred"] is False
    assert result["reason"] == "busy"
    assert result["detail"] == "SIP/2.0 486 Busy Here"
    assert result["said_to_caller"] == "Let me put you through."
    assert events.index("transfer_started") < events.index("transfer_failed")
    assert "transfer_answered" not in events
    # the history records the transfer: the call, its result, then the answer
    roles = [m["role"] for m in orchestrator.conversation.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert orchestrator.conversation.messages[1]["tool_calls"][0]["function"]["name"] == (
        TRANSFER_TOOL
    )


async def test_a_transfer_that_went_through_ends_the_turn_without_an_answer(
    llm: ScriptedLLM, conversation: Callable[[], PlaybookOrchestrator]
) -> None:
    llm.script(_transfers_then("never asked"))
    orchestrator = conversation()

    async def answered(request: TransferRequest) -> TransferOutcome:
        return TransferOutcome("answered", how="refer")

    orchestrator.transferrer = answered
    events: list[dict[str, Any]] = []
    orchestrator.on(lambda event: events.append(event.to_dict()))
    assert await orchestrator.respond(PUT_ME_THROUGH) == ""
    assert len(llm.requests) == 1  # no answer round: the caller is with the person
    (result,) = _tool_results_of(orchestrator)
    assert result == {
        "transferred": True,
        "destination": "sip:desk@pbx.example.com",
        "said_to_caller": "Let me put you through.",
        "how": "refer",
    }
    (done,) = [e for e in events if e["type"] == "transfer_answered"]
    assert done == {
        "type": "transfer_answered",
        "destination": "sip:desk@pbx.example.com",
        "mode": "blind",
        "how": "refer",
    }
    assert [m["role"] for m in orchestrator.conversation.messages] == ["user", "assistant", "tool"]


def _tool_results_of(orchestrator: PlaybookOrchestrator) -> list[dict[str, Any]]:
    messages = orchestrator.conversation.messages
    return [json.loads(m["content"]) for m in messages if m["role"] == "tool"]


async def test_without_a_phone_line_a_transfer_is_not_supported(
    llm: ScriptedLLM, conversation: Callable[[], PlaybookOrchestrator]
) -> None:
    llm.script(_transfers_then(SORRY))
    assert await conversation().respond(PUT_ME_THROUGH) == SORRY
    (result,) = _tool_results(llm)
    assert (result["transferred"], result["reason"]) == (False, "not_supported")


async def test_a_warm_transfer_needs_a_summary(
    llm: ScriptedLLM, tmp_path: Path, conversation: Callable[[], PlaybookOrchestrator]
) -> None:
    folder = _playbook(tmp_path, "+15550100", **{"ring_timeout_ms": "mode: warm, ring_timeout_ms"})
    client = ChatClient.connect(llm.base_url, None, "m")
    orchestrator = PlaybookOrchestrator(load_playbook(folder / "desk.yaml"), client)
    asked: list[TransferRequest] = []

    async def busy(request: TransferRequest) -> TransferOutcome:
        asked.append(request)
        return TransferOutcome.failed("no_answer")

    orchestrator.transferrer = busy
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall(TRANSFER_TOOL, {"reason": "wants a person"})]),
            Reply(tool_calls=[ScriptedToolCall(TRANSFER_TOOL, {"reason": "x", "summary": "S."})]),
            Reply(content=SORRY),
        ]
    )
    try:
        assert await orchestrator.respond(PUT_ME_THROUGH) == SORRY
    finally:
        await client.aclose()
    tool = next(t for t in llm.requests[0]["tools"] if t["function"]["name"] == TRANSFER_TOOL)
    assert tool["function"]["parameters"]["required"] == ["reason", "summary"]
    missing, no_answer = _tool_results(llm)
    assert "summary is required" in missing["error"]
    assert no_answer["reason"] == "no_answer"
    (request,) = asked  # the call without a summary never reached the line
    assert (request.mode, request.summary, request.destination) == ("warm", "S.", "+15550100")


# -- a server on the test playbook -----------------------------------------------------------------


def _server(
    llm: ScriptedLLM, folder: Path, config: ServerConfig
) -> AbstractAsyncContextManager[TestServer]:
    """The app with ``config`` on the playbooks in ``folder``, its LLM the scripted one."""
    return voice_server(llm.base_url, config, folder)


async def _metric_lines(server: TestServer, prefix: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics")) as response:
        text = await response.text()
    return [line for line in text.splitlines() if line.startswith(prefix)]


# -- media streams: the stream event and Twilio's REST API -----------------------------------------


@dataclass
class TwilioApi:
    """A stand-in for Twilio's REST API: the Calls resource of one account, as Twilio answers
    it (200 with the call's JSON, or Twilio's error JSON with ``status``)."""

    status: int = 200
    requests: list[tuple[str, str | None, dict[str, str]]] = field(default_factory=list)
    """(path, Authorization header, form fields) of each request."""
    base_url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        form = await request.post()
        self.requests.append(
            (
                request.path,
                request.headers.get("Authorization"),
                {k: str(v) for k, v in form.items()},
            )
        )
        sid = request.match_info["call"]
        if self.status != 200:
            message = f"The requested resource {request.path} was not found"
            body = {"code": 20404, "message": message, "status": self.status}
            return web.json_response(body, status=self.status)
        return web.json_response({"sid": sid, "status": "in-progress"})


@pytest.fixture
async def twilio_api() -> AsyncIterator[TwilioApi]:
    api = TwilioApi()
    app = web.Application()
    app.router.add_post("/2010-04-01/Accounts/{account}/Calls/{call}.json", api.handle)
    runner, port = await start_on_loopback(app)
    api.base_url = f"http://127.0.0.1:{port}"
    try:
        yield api
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _media_stream_asks(
    llm: ScriptedLLM, folder: Path, api: TransferApiSettings | None
) -> AsyncIterator[tuple[TestServer, TwilioPhone]]:
    """A server on the playbooks in ``folder`` transferring media streams through ``api``
    (None: by the stream's ``transfer`` event alone);
    a Twilio media stream to the desk playbook says PUT_ME_THROUGH. Yields the server and the
    phone once it has said it; the server and the HTTP session end with the block."""
    async with (
        _server(llm, folder, ServerConfig(transfer_api=api)) as server,
        aiohttp.ClientSession() as http,
    ):
        phone = TwilioPhone(await http.ws_connect(server.make_url("/twilio/media")))
        await phone.start("desk")
        await phone.say(silence(300, 8000) + phone_audio(PUT_ME_THROUGH) + silence(600, 8000))
        yield server, phone


@pytest.mark.slow
async def test_a_media_stream_is_transferred_through_the_providers_api(
    llm: ScriptedLLM, tmp_path: Path, twilio_api: TwilioApi
) -> None:
    llm.script(_transfers_then("never asked"))
    folder = _playbook(tmp_path, "+15550100")
    api = TransferApiSettings(twilio_api.base_url, password="auth-token")
    async with _media_stream_asks(llm, folder, api) as (server, phone):
        await asyncio.wait_for(phone.reader, 30)  # Vocable closes the stream once handed over
        (path, authorization, form), *_ = twilio_api.requests
        assert path == "/2010-04-01/Accounts/AC0001/Calls/CA0001.json"
        assert authorization == "Basic " + base64.b64encode(b"AC0001:auth-token").decode()
        assert form == {
            "Twiml": '<Response><Dial timeout="4"><Number>+15550100</Number></Dial></Response>'
        }
        (event,) = [d for _, d in phone.heard.control if d["event"] == "transfer"]
        assert event["transfer"]["to"] == "+15550100"
        assert event["transfer"]["twiml"] == form["Twiml"]
        assert "put you through" in (await phone.heard.said()).lower()
        assert phone.closed_with is not None
        assert phone.closed_with[1] == "transferred to +15550100"
        await _wait(lambda: len(server.app[CALLS]) == 0, 5)
        metrics = await _metric_lines(server, "vocable_transfers_total")
    assert 'vocable_transfers_total{outcome="answered",reason=""} 1.0' in metrics
    assert _tool_results(llm) == []  # no request followed the transfer


@pytest.mark.slow
async def test_a_refused_api_call_is_told_to_the_caller_and_the_call_goes_on(
    llm: ScriptedLLM, tmp_path: Path, twilio_api: TwilioApi
) -> None:
    twilio_api.status = 404
    llm.script(_transfers_then(SORRY))
    folder = _playbook(tmp_path, "sip:desk@pbx.example.com")
    api = TransferApiSettings(twilio_api.base_url, username="SK0001", password="secret")
    async with _media_stream_asks(llm, folder, api) as (server, phone):
        await _wait(lambda: any(r["messages"][-1]["role"] == "tool" for r in llm.requests), 30)
        await answers_spoken(server, 1)  # "put you through" and the apology: one answer
        (_, authorization, form), *_ = twilio_api.requests
        assert authorization == "Basic " + base64.b64encode(b"SK0001:secret").decode()
        assert "<Sip>sip:desk@pbx.example.com</Sip>" in form["Twiml"]
        (result,) = _tool_results(llm)
        assert (result["transferred"], result["reason"]) == (False, "refused")
        assert result["detail"] == "the provider's API answered 404"
        said = (await phone.heard.said()).lower()
        assert "put you through" in said
        assert "nobody can take your call" in said
        assert phone.closed_with is None  # the call goes on
        assert len(server.app[CALLS]) == 1
        metrics = await _metric_lines(server, "vocable_transfers_total")
        await phone.stop()
    assert 'vocable_transfers_total{outcome="failed",reason="refused"} 1.0' in metrics
    assert 'vocable_transfers_total{outcome="started",reason=""} 1.0' in metrics


@pytest.mark.slow
async def test_without_a_provider_api_a_media_stream_transfer_is_requested_not_confirmed(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    """Nothing tells Vocable whether the platform acted on the stream's ``transfer`` event
    (Twilio ignores it): the LLM hears so, the agent says no goodbye, and the call stays up."""
    llm.script(_transfers_then(HOLD))
    folder = _playbook(tmp_path, "+15550100")
    async with _media_stream_asks(llm, folder, None) as (server, phone):
        await _wait(lambda: any(r["messages"][-1]["role"] == "tool" for r in llm.requests), 30)
        (event,) = [d for _, d in phone.heard.control if d["event"] == "transfer"]
        assert event["transfer"]["to"] == "+15550100"
        (result,) = _tool_results(llm)
        assert result["transferred"] is False
        assert result["status"] == "requested, not confirmed"
        assert result["how"] == "stream event"
        assert "may still be on the line" in result["note"]
        assert "Do not say goodbye" in result["next"]
        await answers_spoken(server, 1)  # "put you through" and the answer to the result
        said = (await phone.heard.said()).lower()
        assert "put you through" in said
        assert "please hold" in said
        assert phone.closed_with is None  # the platform, not Vocable, ends the call
        assert len(server.app[CALLS]) == 1
        metrics = await _metric_lines(server, "vocable_transfers_total")
        await phone.stop()
    assert 'vocable_transfers_total{outcome="requested",reason=""} 1.0' in metrics
    assert 'vocable_transfers_total{outcome="answered",reason=""}' not in metrics


# -- SIP: REFER with sipp as the caller ------------------------------------------------------------

HOLD_AFTER_THE_RESULT_MS = 2000
"""How long sipp, as a caller whose transfer failed, stays on the line once it has given Vocable
the failure (its NOTIFY, or its refusal of the REFER) before it hangs up. What the tests need
in that time: the call still up (a Vocable that hung up would send a BYE sipp does not expect,
failing the scenario) and the transfer's result given to the LLM, which takes a local dial to
a sipp that answers 486 at once and a request to the scripted LLM: tens of milliseconds, well
inside 2 s on a slower, loaded CPU. The agent's spoken answer is not checked here."""

BYE_FROM_VOCABLE = awaits_bye(20_000)
BYE_FROM_CALLER = hangs_up_after(HOLD_AFTER_THE_RESULT_MS, cseq=3)


async def _sipp_call(
    llm: ScriptedLLM, tmp_path: Path, destination: str, scenario: str, **fill: str
) -> list[str]:
    """A server on the desk playbook, transferring to ``destination``, takes one call from sipp
    with ``scenario`` (a file of tests/sip, its braces filled, the caller saying
    PUT_ME_THROUGH). Asserts that the scenario held (sipp exits 0) and that no call is left
    within 5 s after; returns the server's ``vocable_transfers_total`` lines."""
    speech = tmp_path / "speech.ulaw"
    speech.write_bytes(pcm_to_ulaw(silence(300, 8000) + phone_audio(PUT_ME_THROUGH)))
    text = (SCENARIOS / scenario).read_text().replace("{speech}", str(speech))
    for key, value in fill.items():
        text = text.replace("{" + key + "}", value)
    path = tmp_path / scenario
    path.write_text(text)
    async with _server(llm, _playbook(tmp_path, destination), _sip_config()) as server:
        status, output = await run_sipp(
            tmp_path,
            f"127.0.0.1:{server.app[SIP].port}",
            *("-sf", str(path), "-s", "desk", "-m", "1", "-i", "127.0.0.1", "-p", "0"),
            *("-mi", "127.0.0.1", "-mp", str(random.randrange(30000, 40000, 2))),
            *("-timeout", "90", "-timeout_error"),
        )
        assert status == 0, output
        await _wait(lambda: len(server.app[CALLS]) == 0, 5)
        return await _metric_lines(server, "vocable_transfers_total")


def _sip_config() -> ServerConfig:
    return ServerConfig(sip=SipSettings(host="127.0.0.1", port=0))


@asynccontextmanager
async def _sipp_person(tmp_path: Path, scenario: str) -> AsyncIterator[str]:
    """sipp as the person Vocable dials, running ``tests/sip/SCENARIO`` once on 127.0.0.1;
    yields the URI to dial. When the block ends without an error, asserts that the scenario
    held (sipp exits 0 within 10 s; for a person who answers, Vocable's BYE came); sipp is
    stopped either way."""
    workdir, port = tmp_path / "person", free_port()
    person = await start_sipp(
        workdir,
        *("-sf", str(SCENARIOS / scenario), "-i", "127.0.0.1", "-p", str(port)),
        *("-mi", "127.0.0.1", "-mp", str(free_port() & ~1)),
        *("-m", "1", "-timeout", "60", "-timeout_error"),
    )
    try:
        yield f"sip:human@127.0.0.1:{port}"
        status, output = await sipp_result(person, workdir, 10)
        assert status == 0, output
    finally:
        await stop_group(person)


@pytest.mark.slow
async def test_a_sip_caller_that_takes_refer_is_transferred_blind(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(_transfers_then("never asked"))
    metrics = await _sipp_call(  # Refer-To matched, and Vocable hung up after the NOTIFY
        llm,
        tmp_path,
        "sip:human@127.0.0.1:5999",
        "refer.xml",
        refer_to=r"^ *.sip:human@127\.0\.0\.1:5999.$",
        final="200 OK",
        ending=BYE_FROM_VOCABLE,
    )
    assert 'vocable_transfers_total{outcome="answered",reason=""} 1.0' in metrics
    assert [r["messages"][-1]["role"] for r in llm.requests if r.get("stream")] == ["user"]


@pytest.mark.slow
async def test_a_busy_person_is_told_to_the_llm_and_the_sip_call_goes_on(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(_transfers_then(SORRY))
    metrics = await _sipp_call(
        llm,
        tmp_path,
        "+1 555 0100",
        "refer.xml",
        refer_to=r"^ *.sip:\+15550100@127\.0\.0\.1.$",  # the number, at the caller's side
        final="486 Busy Here",
        ending=BYE_FROM_CALLER,
    )
    (result,) = _tool_results(llm)
    assert (result["transferred"], result["reason"]) == (False, "busy")
    assert result["detail"] == "SIP/2.0 486 Busy Here"
    assert 'vocable_transfers_total{outcome="failed",reason="busy"} 1.0' in metrics


@pytest.mark.slow
async def test_a_refused_refer_without_a_sip_destination_fails_and_the_call_goes_on(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(_transfers_then(SORRY))
    await _sipp_call(
        llm,
        tmp_path,
        "+15550100",  # a number: no bridge can be dialed
        "refer_refused.xml",
        status="405 Method Not Allowed",
        hold_ms=str(HOLD_AFTER_THE_RESULT_MS),
    )
    (result,) = _tool_results(llm)
    assert (result["transferred"], result["reason"]) == (False, "refused")
    assert result["detail"] == "REFER answered 405 Method Not Allowed"


@pytest.mark.slow
async def test_a_refused_refer_is_bridged_and_a_busy_person_comes_back_to_the_agent(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    """The caller's phone refuses REFER: Vocable dials the person itself (sipp as the person,
    busy); the busy line is the tool's result and the call goes on."""
    llm.script(_transfers_then(SORRY))
    async with _sipp_person(tmp_path, "human_busy.xml") as human:  # its 486 was acknowledged
        await _sipp_call(
            llm,
            tmp_path,
            human,
            "refer_refused.xml",
            status="501 Not Implemented",
            hold_ms=str(HOLD_AFTER_THE_RESULT_MS),
        )
    (result,) = _tool_results(llm)
    assert (result["transferred"], result["reason"]) == (False, "busy")
    assert "486" in result["detail"]


# -- SIP: bridged transfers with baresip as the caller and as the person ---------------------------

HUMAN = "You are through to the billing team. My name is Sam."
"""What the person says once they answer."""
LATER = "Thank you, I need to change my delivery address."
"""What the caller says to the person once joined (warm transfer)."""
SUMMARY = "The caller wants to change the delivery address of an order."
"""The warm transfer's summary (the LLM's ``summary`` argument)."""


async def _transcripts(pcm: bytes) -> list[str]:
    """Whisper's words for each utterance of 8 kHz ``pcm``, in order."""
    said = []
    for start, end in utterances(pcm, gap_s=1.0):
        piece = pcm[int(max(0.0, start - 0.2) * RATE) * 2 : int((end + 0.3) * RATE) * 2]
        said.append((await transcriber().transcribe(to_16k(piece, RATE))).text)
    return said


def _said(transcripts: list[str], expected: str) -> bool:
    return any(word_error_rate(text, expected) <= 0.3 for text in transcripts)


def _call_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every event of every SIP call, as (type, data), in order."""
    seen: list[tuple[str, dict[str, Any]]] = []
    original = SipCall.on_event

    def record(call: SipCall, event: VoiceEvent) -> None:
        seen.append((event.type, dict(event.data)))
        original(call, event)

    monkeypatch.setattr(SipCall, "on_event", record)
    return seen


async def _assert_heard(phone: Baresip, *expected: str) -> None:
    """What ``phone`` heard was ``expected``: one utterance for each, in order, each with a
    word error rate of at most 0.25."""
    heard = await _transcripts(phone.heard())
    assert len(heard) == len(expected), heard
    for said, text in zip(heard, expected, strict=True):
        assert word_error_rate(said, text) <= 0.25, heard


@asynccontextmanager
async def _calling_the_desk(
    tmp_path: Path, server: TestServer, speech: bytes
) -> AsyncIterator[tuple[Baresip, SipCall]]:
    """baresip calls the desk playbook on ``server`` saying ``speech`` and refuses REFER
    (``call_transfer=no``); yields it and Vocable's call once that is answered (the test fails
    if not within 10 s). The caller is stopped when the block ends."""
    sip = server.app[SIP]
    caller = await start_baresip(
        tmp_path / "caller",
        speech,
        account="caller;call_transfer=no",
        dial=f"sip:desk@127.0.0.1:{sip.port}",
    )
    try:
        await until(lambda: bool(sip.calls), 10, "no call was answered", caller)
        (call,) = sip.calls.values()
        yield caller, call
    finally:
        await caller.stop()


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    """Piper's take of every phrase, made before any call (not on a call's event loop)."""
    for text in (PUT_ME_THROUGH, HUMAN, LATER, SUMMARY):
        phone_audio(text)


@dataclass
class Bridged:
    """A bridged transfer as the two phones and the server saw it."""

    caller: Baresip
    human: Baresip
    events: list[tuple[str, dict[str, Any]]]
    metrics: list[str]
    ended: str
    """Why Vocable ended the caller's call (its log line)."""


async def _bridged_call(
    llm: ScriptedLLM,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    *,
    caller_speech: bytes,
    human_speech: bytes,
    warm: bool = False,
) -> Bridged:
    """baresip calls the desk playbook saying ``caller_speech`` and refuses REFER
    (``call_transfer=no``), so Vocable dials the person: a second baresip that answers at once
    and says ``human_speech``. Whichever phone's speech ends first hangs up; returns once both
    legs are over."""
    caplog.set_level(logging.INFO, logger="server.transports.sip.call")
    events = _call_events(monkeypatch)
    human = await start_baresip(tmp_path / "human", human_speech, account="human;answermode=auto")
    warm_mode = {"ring_timeout_ms": "mode: warm, ring_timeout_ms"} if warm else {}
    folder = _playbook(tmp_path, human.uri("human"), **warm_mode)
    try:
        async with _server(llm, folder, _sip_config()) as server:
            async with _calling_the_desk(tmp_path, server, caller_speech) as (caller, call):
                longest = max(len(caller_speech), len(human_speech)) / 2 / RATE
                await until(call.ended.is_set, longest + 20, "the call went on", caller, human)
                dialer = server.app[SIP].dialer
                assert dialer is not None
                await until(lambda: not dialer.legs, 5, "the person's leg is left", human)
                for phone in (caller, human):  # each phone's call is over (BYE sent or heard)
                    await until(phone.call_over, 5, f"{phone.folder.name}'s call went on", phone)
            metrics = await _metric_lines(server, "vocable_transfers_total")
    finally:
        await human.stop()
    (ended,) = [r.getMessage() for r in caplog.records if f"call {call.id} ended" in r.getMessage()]
    return Bridged(caller, human, events, metrics, ended)


BridgedCall = Callable[..., Awaitable[Bridged]]
"""``await bridged_call(caller_speech=..., human_speech=..., warm=...)``: see _bridged_call."""


@pytest.fixture
def bridged_call(
    llm: ScriptedLLM,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> BridgedCall:
    """:func:`_bridged_call` with the test's scripted LLM, folder, monkeypatch and log capture:
    the test passes only the phones' speech (and ``warm``)."""
    return functools.partial(_bridged_call, llm, tmp_path, monkeypatch, caplog)


def _assert_bridged(bridged: Bridged, mode: str) -> None:
    types = [t for t, _ in bridged.events if t.startswith("transfer_")]
    assert types == ["transfer_started", "transfer_answered"], types
    (answered,) = [d for t, d in bridged.events if t == "transfer_answered"]
    assert (answered["how"], answered["mode"]) == ("bridge", mode)
    assert 'vocable_transfers_total{outcome="answered",reason=""} 1.0' in bridged.metrics


@pytest.mark.slow
async def test_a_refused_refer_is_bridged_and_the_caller_hears_the_person(
    llm: ScriptedLLM, bridged_call: BridgedCall
) -> None:
    """A blind transfer the caller's phone refuses becomes a bridge: the caller hears the
    person's words, and the person hanging up ends the caller's leg too."""
    llm.script(_transfers_then("never asked"))
    bridged = await bridged_call(
        caller_speech=silence(500, RATE) + phone_audio(PUT_ME_THROUGH) + silence(60_000, RATE),
        # after its words the person hangs up: 1 s for their last frames to reach the caller
        # (relayed as they come, at most 200 ms queued) before the BYE ends the caller's leg
        human_speech=silence(1000, RATE) + phone_audio(HUMAN) + silence(1000, RATE),
    )
    _assert_bridged(bridged, "blind")
    assert bridged.ended.endswith("ended: the person hung up"), bridged.ended
    assert "session closed" in bridged.caller.log_text()  # Vocable's BYE ended the caller's call
    await _assert_heard(bridged.caller, "Let me put you through.", HUMAN)


@pytest.mark.slow
async def test_a_warm_transfer_tells_the_person_the_summary_then_joins_the_caller(
    llm: ScriptedLLM, bridged_call: BridgedCall
) -> None:
    """A warm bridged transfer: the person hears the summary in the agent's voice (and the
    caller does not), then the two hear each other; the caller hanging up ends the person's
    leg too."""
    arguments = {"reason": "the caller asked for a person", "summary": SUMMARY}
    llm.script([Reply(tool_calls=[ScriptedToolCall(TRANSFER_TOOL, arguments)])])
    summary_ms = len(phone_audio(SUMMARY)) * 1000 // 2 // RATE
    # The caller's words to the person must start once the caller is joined, more than a second
    # after the summary (the gap that tells the two utterances apart in the person's
    # recording); the person's words reach the caller whenever they come after the join (the
    # two directions are independent). In the caller's time the join came at 7.1 s on the
    # reference CPU (the caller's 2.1 s, end of turn, the agent's 1.1 s line, a local dial,
    # the summary's synthesis and 3.1 s): LATER starts at 11.1 s, and the caller hangs up at
    # 14.8 s, 3 s after the person's words ended at 11.8 s there: 3 s of slack either way for
    # the parts a slower, loaded CPU makes longer (Whisper, Piper, the event loop).
    bridged = await bridged_call(
        caller_speech=silence(500, RATE)
        + phone_audio(PUT_ME_THROUGH)
        + silence(9000, RATE)  # the agent's line, the dial, the summary, a gap
        + phone_audio(LATER)
        + silence(1000, RATE),  # its last frames on their way to the person
        human_speech=silence(summary_ms + 2500, RATE)  # listens to the summary
        + phone_audio(HUMAN)
        + silence(60_000, RATE),
        warm=True,
    )
    _assert_bridged(bridged, "warm")
    assert bridged.ended.endswith("ended: caller hung up"), bridged.ended
    assert "session closed" in bridged.human.log_text()  # Vocable's BYE ended the person's call
    await _assert_heard(bridged.human, SUMMARY, LATER)  # the summary first, then the caller
    await _assert_heard(bridged.caller, "Let me put you through.", HUMAN)


@pytest.mark.slow
async def test_a_person_who_hangs_up_during_the_summary_is_a_failed_transfer(
    llm: ScriptedLLM, bridged_call: BridgedCall
) -> None:
    """The person answers and hangs up before the warm summary ends: the caller is not joined
    to a dead line; the agent is told, says so, and the call goes on until the caller ends it."""
    llm.script(_transfers_then(SORRY, summary=SUMMARY))
    bridged = await bridged_call(
        # the caller hangs up at 14.1 s of its call: it heard the agent's 4 s apology end at
        # 10.8 s on the reference CPU (the transfer as in the warm test, the summary played
        # out, then the apology), 3.3 s of slack for a slower, loaded CPU
        caller_speech=silence(500, RATE) + phone_audio(PUT_ME_THROUGH) + silence(12_000, RATE),
        human_speech=silence(1000, RATE),  # then baresip hangs up, mid-summary
        warm=True,
    )
    types = [t for t, _ in bridged.events if t.startswith("transfer_")]
    assert types == ["transfer_started", "transfer_failed"], types
    (result,) = _tool_results(llm)
    assert (result["transferred"], result["reason"]) == (False, "rejected")
    assert result["detail"] == "the person hung up before the caller was joined"
    assert bridged.ended.endswith("ended: caller hung up"), bridged.ended
    await _assert_heard(bridged.caller, "Let me put you through.", SORRY)


@pytest.mark.slow
async def test_a_bridge_whose_person_sends_no_audio_ends_after_the_media_timeout(
    llm: ScriptedLLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The person's side answers and then sends no RTP at all (sipp as the person): a vanished
    line is not held open for the caller; both legs end after the media timeout."""
    caplog.set_level(logging.INFO, logger="server.transports.sip.call")
    llm.script(_transfers_then("never asked"))
    # 2 s: the person's side sends nothing at all, the caller's phone its RTP all along
    config = ServerConfig(sip=SipSettings(host="127.0.0.1", port=0, media_timeout_s=2.0))
    speech = silence(500, RATE) + phone_audio(PUT_ME_THROUGH) + silence(40_000, RATE)
    async with (
        _sipp_person(tmp_path, "callee_answers.xml") as human,  # and Vocable's BYE came
        _server(llm, _playbook(tmp_path, human), config) as server,
        _calling_the_desk(tmp_path, server, speech) as (caller, call),
    ):
        await until(call.ended.is_set, 30, "the call went on", caller)
        await until(caller.call_over, 5, "the caller's call went on", caller)
    assert f"SIP call {call.id} ended: no audio from the person" in caplog.text
    assert "session closed" in caller.log_text()


async def test_the_persons_audio_waits_for_the_caller_no_longer_than_a_moment() -> None:
    """A burst of the person's audio (after a network stall, or a faster clock) is cut to
    MAX_BACKLOG_MS queued; quiet frames go first, beyond QUIET_BACKLOG_MS."""
    speaker = Speaker(RATE)
    playout = _Playout(speaker)
    loud, quiet = tone(RATE, 20), bytes(FRAME_BYTES)
    for _ in range(25):  # 500 ms at once
        playout.push(loud)
    assert playout.backlog_ms == MAX_BACKLOG_MS
    assert playout.dropped_ms == 300
    for _ in range(6):  # 120 ms played: 80 ms left
        assert speaker.pull() == loud
    playout.push(quiet)  # a pause in the person's words is dropped while anything waits
    assert (playout.backlog_ms, playout.dropped_ms) == (80, 320)
    playout.push(loud)
    assert playout.backlog_ms == 100
    for _ in range(5):
        speaker.pull()
    assert playout.backlog_ms == 0
    playout.push(quiet)  # nothing waits: a quiet frame is queued like any other
    playout.push(quiet)
    assert (playout.backlog_ms, playout.dropped_ms) == (40, 320)
