"""Outbound calls (``POST /calls``, ``vocable call``) to real SIP peers on 127.0.0.1.

baresip answers automatically as the callee (once through a trunk: Kamailio as the outbound
proxy that challenges with 407 digest authentication and stays on the path with Record-Route),
speaks a WAV file (``aufile``; it hangs up when the file ends) and records what it heard
(``sndfile``), which real Whisper transcribes; sipp plays callees that are busy (486), ring
forever, or answer and wait for our BYE, and fails unless every message of its scenario came
(the ACK of a 486, the CANCEL, the BYE). Real Whisper, Piper and webrtcvad on the server; the
LLM is scripted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from media import Resampler
from media.audio import SAMPLE_RATE, silence
from playbooks import PlaybookError, load_playbooks
from server.config.server import ServerConfig, SipSettings
from server.config.sip_trunks import Secret, Trunk
from server.http.app import CALLS, SIP
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from server.transports.sip.dialer import parse_target
from tests.support.baresip import RATE, Baresip, loud_frames, start_baresip, until
from tests.support.calls import events_of, transcriber, voice_server, word_error_rate
from tests.support.kamailio import PBX_CONFIG, run_kamailio
from tests.support.phone import ANSWER, phone_audio
from tests.support.processes import run_vocable
from tests.support.sipp import sipp_callee

pytestmark = pytest.mark.slow

SIP_FILES = Path(__file__).resolve().parent / "sip"

GREETING = "Hello, this is Acme calling about your parcel delivery."
GREETING_WER = 0.35
"""Of the greeting as the callee heard it: tiny.en hears "Acme" as "acne" every time and "parcel"
as "partial" in about half the calls (2 of 9 words); a third slip under load ("Callin") failed a
clean run once."""
MESSAGE = "This is Acme. Your parcel arrives on Tuesday. Goodbye."
QUESTION = "When will it arrive?"
HELLO = "Hello?"
VOICEMAIL = (
    "Hi, you have reached the voicemail of Sam Taylor, please leave your name and your number "
    "after the tone."
)
PLAYBOOK = f"""
id: outreach
name: Acme delivery calls
initial_stage: call
global_system_prompt: You are Acme's phone agent calling a customer. Answer in short sentences.
voicemail: {{action: leave_message, message: "{MESSAGE}"}}
stages:
  - id: call
    name: Call
    system_prompt: Tell the customer about their parcel delivery.
    greeting: {GREETING}
"""


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    for text in (QUESTION, HELLO, VOICEMAIL):
        phone_audio(text)


def _server(
    llm: ScriptedLLM, folder: Path, trunks: Mapping[str, Trunk] | None = None, **config: Any
) -> AbstractAsyncContextManager[TestServer]:
    """The app with SIP on 127.0.0.1 (with ``trunks``) and ``config``, on the outreach playbook
    (written into ``folder``), its LLM the scripted one."""
    (folder / "outreach.yaml").write_text(PLAYBOOK)
    sip = SipSettings(host="127.0.0.1", port=0, trunks=trunks or {})
    settings = ServerConfig(sip=sip, **config)
    return voice_server(llm.base_url, settings, folder)


@pytest.fixture
async def server(llm: ScriptedLLM, tmp_path: Path) -> AsyncIterator[TestServer]:
    llm.script(answers_by_words({}, ANSWER))
    (tmp_path / "playbooks").mkdir()
    async with _server(llm, tmp_path / "playbooks") as server:
        yield server


async def _post(server: TestServer, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.make_url(path), json=body) as response,
    ):
        return response.status, await response.json()


async def _get(server: TestServer, path: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(server.make_url(path)) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


async def _events(server: TestServer, session_id: str, events: list[dict[str, Any]]) -> None:
    """Every event of the call into ``events`` as it comes, from the server-sent event stream
    (which ends with the call)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(server.make_url(f"/calls/{session_id}/events")) as response,
    ):
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))


# -- baresip, the callee that answers ------------------------------------------------------------


async def _said(pcm8k: bytes) -> str:
    resampler = Resampler(RATE, SAMPLE_RATE)
    return (await transcriber().transcribe(resampler.resample(pcm8k) + resampler.flush())).text


@asynccontextmanager
async def _baresip_callee(
    workdir: Path, speech: bytes, *, wideband: bool = False, opus: bool = False
) -> AsyncIterator[tuple[str, Baresip]]:
    """baresip listening on 127.0.0.1 and answering at once; it says ``speech`` (8 kHz PCM16)
    from the answer on and hangs up at its end (with ``wideband`` on G.722, with ``opus`` on
    Opus). Yields the URI to dial and the phone (what it heard: :meth:`Baresip.heard`); it is
    stopped when the block ends."""
    callee = await start_baresip(
        workdir / "callee",
        speech,
        account="callee;answermode=auto",
        linger_s=40,
        wideband=wideband,
        opus=opus,
    )
    try:
        await until(lambda: "baresip is ready." in callee.log_text(), 10, "not ready", callee)
        yield callee.uri("callee"), callee
    finally:
        await callee.stop()


async def _call_baresip(
    server: TestServer,
    workdir: Path,
    speech: bytes,
    *,
    wideband: bool = False,
    opus: bool = False,
    hang_up_after: int | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
    """Place a call to a baresip callee saying ``speech``; returns the call's final description,
    its events and what baresip heard (8 kHz PCM16 from the answer on). ``hang_up_after``: as
    :func:`_call` takes it."""
    async with _baresip_callee(workdir, speech, wideband=wideband, opus=opus) as (uri, callee):
        return await _call(server, {"to": uri}, speech, callee, hang_up_after)


async def _call(
    server: TestServer,
    body: dict[str, Any],
    speech: bytes,
    callee: Baresip,
    hang_up_after: int | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
    """Place the call ``body`` describes, which reaches ``callee`` saying ``speech``. The call
    ends when baresip's file ends or the server hangs up; with ``hang_up_after``, once the
    agent has finished that many answers (its greeting included: the ``tts_end`` events) and
    baresip has heard them out, baresip hangs up (a SIGTERM: it sends its BYE and quits), its
    file longer than the call needs."""
    seconds = len(speech) / 2 / RATE
    status, placed = await _post(server, "/calls", {**body, "playbook": "outreach"})
    assert status == 201, placed
    session_id = placed["session_id"]
    events: list[dict[str, Any]] = []
    streaming = asyncio.create_task(_events(server, session_id, events))
    hung_up = False
    try:
        if hang_up_after is not None:

            def spoken() -> bool:
                return len([e for e in events if e["type"] == "tts_end"]) >= hang_up_after

            await until(lambda: spoken() or streaming.done(), seconds, "not spoken", callee)
            if not streaming.done():
                # out of its jitter buffer, and half a second of the agent's silence after it
                # (Whisper misreads a recording's last word with no pause after it)
                await callee.hears_more(0.8)
                callee.process.terminate()
                hung_up = True
        await asyncio.wait_for(streaming, seconds + 30)
    finally:
        streaming.cancel()
    described = await _get(server, f"/calls/{session_id}")
    if not hung_up:
        callee.process.terminate()  # the call is over: baresip can go
    await asyncio.wait_for(callee.process.wait(), 5)  # its recordings are complete once it quit
    return described, events, callee.heard()


async def test_a_callee_who_says_hello_hears_the_greeting_after_it_and_talks(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path
) -> None:
    hello, question = phone_audio(HELLO), phone_audio(QUESTION)
    # The question comes 5 s after "Hello?": 0.5 s of silence ends the callee's words, the
    # greeting (3.2 s of audio) starts 0.3 s later (its first phrase synthesized: 0.45 s on a
    # CPU 1.5x slower) and has played out 3.7-4 s after them; over a second to spare. The callee
    # hangs up once it has heard the answer (~4.5 s after the question); the silence after it
    # is only an upper bound.
    gap_s = 5.0
    speech = silence(300, RATE) + hello + silence(round(gap_s * 1000), RATE) + question
    speech += silence(15000, RATE)
    # a wideband phone: the call is on G.722 both ways (offered first, answered)
    described, events, heard = await _call_baresip(
        server, tmp_path, speech, wideband=True, hang_up_after=2
    )

    assert described["codec"] == "G722"
    assert described["state"] == "ended"
    assert described["result"] == "answered"
    assert described["answered_by"] == "person"
    assert described["reason"] == "the callee hung up"
    hello_end = 0.3 + len(hello) / 2 / RATE
    asked = hello_end + gap_s
    loud = loud_frames(heard)
    # not over the callee's "Hello?": the greeting starts once it has ended (500 ms of silence)
    assert not [at for at in loud if at < hello_end + 0.3], loud[:10]
    greeting = [at for at in loud if at < asked]
    assert greeting, "the callee heard no greeting"
    said = await _said(heard[: int(asked * RATE) * 2])
    assert word_error_rate(said, GREETING) <= GREETING_WER, said
    answer = await _said(heard[int(asked * RATE) * 2 :])
    assert word_error_rate(answer, ANSWER) <= 0.3, answer
    (turn,) = llm.user_turns  # the question; "Hello?" was answered by the greeting
    assert word_error_rate(turn, QUESTION) <= 0.3, turn
    calls = [e for e in events if e["type"] == "call"]
    assert [e["state"] for e in calls][:2] == ["ringing", "answered"]
    assert calls[-1]["state"] == "ended"
    assert any(e["type"] == "transcript" for e in events)
    assert len(server.app[CALLS]) == 0


async def test_a_silent_callee_through_a_challenging_trunk_hears_the_greeting_after_a_second(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    # silent until it hangs up, once it has heard the greeting out (~4.5 s in): the silence is
    # only an upper bound
    speech = silence(15000, RATE)
    (tmp_path / "playbooks").mkdir()
    async with _baresip_callee(tmp_path, speech) as (uri, callee):
        pbx = {"PASSWORD": "s3cret", "CALLEE": uri}
        with run_kamailio(tmp_path / "pbx", PBX_CONFIG, pbx) as kamailio:
            trunk = Trunk(
                "pbx",
                proxy=("127.0.0.1", kamailio.port),
                username="vocable",
                password=Secret("s3cret"),
                caller_id="+15551230000",
            )
            async with _server(llm, tmp_path / "playbooks", {"pbx": trunk}) as server:
                body = {"to": "+15557654321", "trunk": "pbx"}
                described, events, heard = await _call(
                    server, body, speech, callee, hang_up_after=1
                )
            log = kamailio.log_text()

    assert "challenged" in log, log
    assert "authenticated, to sip:+15557654321@" in log, log
    # the ACK and the callee's BYE went through the proxy, on the route it recorded
    assert "in-dialog ACK from 127.0.0.1 routed" in log, log
    assert "in-dialog BYE from 127.0.0.1 routed" in log, log
    assert "without a route" not in log, log
    assert (described["result"], described["answered_by"]) == ("answered", "person")
    assert described["codec"] == "PCMU"  # a narrowband phone: G.722 offered, G.711 answered
    loud = loud_frames(heard)
    assert loud, "the callee heard nothing"
    assert 0.9 <= loud[0] <= 4.0, loud[0]  # waits ~1 s for the callee's words, then greets
    said = await _said(heard)
    assert word_error_rate(said, GREETING) <= GREETING_WER, said
    pickup = [e for e in events if e.get("pickup")]
    assert pickup, events
    assert pickup[0]["pickup"] == "silent"


@pytest.mark.parametrize("beep", [True, False], ids=["with a beep", "without"])
async def test_a_voicemail_greeting_gets_the_playbooks_message(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path, beep: bool
) -> None:
    greeting = phone_audio(VOICEMAIL)
    tone = silence(600, RATE) + _tone(1000, 500) if beep else b""
    described, events, heard = await _call_baresip(  # the machine with a beep is on Opus
        server, tmp_path, greeting + tone + silence(10000, RATE), opus=beep
    )

    assert described["codec"] == ("opus" if beep else "PCMU")
    assert described["result"] == "answered"
    assert described["answered_by"] == "voicemail"
    assert described["reason"] == "voicemail answered: message left"
    greeted_until = (len(greeting) + len(tone)) / 2 / RATE
    loud = loud_frames(heard)
    assert not [at for at in loud if at < greeted_until], "the agent talked over the greeting"
    started = loud[0] - greeted_until
    (voicemail,) = [e for e in events if e["type"] == "voicemail"]
    if beep:
        assert voicemail["after"] == "beep"
        assert abs(voicemail["beep_hz"] - 1000) < 10
        assert started <= 0.5, started  # within 500 ms after the beep ends
    else:
        assert voicemail["after"] == "silence"
        # after 2.5 s of silence without a beep (from the last voiced frame of the greeting,
        # which ends a frame or two before its file does); the message was synthesized before
        assert 2.4 <= started <= 3.0, started
    said = await _said(heard[int(greeted_until * RATE) * 2 :])
    assert word_error_rate(said, MESSAGE) <= 0.3, said
    assert llm.requests == []  # no conversation with a machine


def _tone(hz: float, ms: int) -> bytes:
    """A steady tone (a voicemail beep), 8 kHz PCM16 at -12 dBFS."""
    t = np.arange(RATE * ms // 1000) / RATE
    return bytes((np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes())


# -- sipp, the callees that do not answer, and one that waits for our BYE -----------------------


async def _ended(server: TestServer, session_id: str) -> dict[str, Any]:
    sip = server.app[SIP]
    await until(lambda: sip.outbound[session_id].state == "ended", 20, "the call did not end")
    return await _get(server, f"/calls/{session_id}")


async def test_a_busy_callee_is_busy_and_its_486_acknowledged(
    server: TestServer, tmp_path: Path
) -> None:
    async with sipp_callee(tmp_path, "callee_busy") as (uri, finished):
        status, body = await _post(server, "/calls", {"to": uri, "playbook": "outreach"})
        assert status == 201, body
        described = await _ended(server, body["session_id"])
        code, output = await finished()
    assert code == 0, output  # our ACK of the 486 arrived
    assert (described["result"], described["status"]) == ("busy", 486)
    assert "486" in described["reason"]
    assert len(server.app[CALLS]) == 0


async def test_no_answer_is_cancelled_and_a_full_server_refuses_another_call(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    (tmp_path / "playbooks").mkdir()
    async with (
        _server(llm, tmp_path / "playbooks", max_sessions=1) as server,
        sipp_callee(tmp_path, "callee_rings") as (uri, finished),
    ):
        body = {"to": uri, "playbook": "outreach", "ring_timeout_s": 1}
        status, placed = await _post(server, "/calls", body)
        assert status == 201, placed
        assert (await _get(server, f"/calls/{placed['session_id']}"))["state"] == "ringing"
        status, refused = await _post(server, "/calls", body)  # the ringing call holds the slot
        assert status == 503, refused
        assert "at most 1 calls" in refused["error"]
        described = await _ended(server, placed["session_id"])
        code, output = await finished()
    assert code == 0, output  # CANCEL sent, 487 acknowledged
    assert described["result"] == "no_answer"
    assert described["reason"] == "no answer within 1 s"


async def test_delete_ends_an_answered_call_with_a_bye(server: TestServer, tmp_path: Path) -> None:
    async with sipp_callee(tmp_path, "callee_answers") as (uri, finished):
        status, body = await _post(server, "/calls", {"to": uri, "playbook": "outreach"})
        assert status == 201, body
        session_id = body["session_id"]
        call = server.app[SIP].outbound[session_id]
        await until(lambda: call.state == "answered", 10, "sipp did not answer")
        await until(  # the greeting starts (the callee is silent)
            lambda: events_of(call, "tts_start") > 0,
            10,
            "the greeting did not start",
        )
        async with (
            aiohttp.ClientSession() as http,
            http.delete(server.make_url(f"/sessions/{session_id}")) as response,
        ):
            assert response.status == 200
        code, output = await finished()
        described = await _get(server, f"/calls/{session_id}")
    assert code == 0, output  # sipp got our BYE
    assert described["state"] == "ended"
    assert described["result"] == "answered"
    assert described["reason"] == "hung up by the client"
    assert len(server.app[CALLS]) == 0


async def test_vocable_call_places_the_call_and_reports_busy(
    server: TestServer, tmp_path: Path
) -> None:
    async with sipp_callee(tmp_path, "callee_busy") as (uri, finished):
        url = str(server.make_url("/"))
        code, out, err = await run_vocable("call", uri, "--playbook", "outreach", "--url", url)
        await finished()
    assert code == 1, err  # not answered
    lines = [json.loads(line) for line in out.splitlines()]
    assert "session_id" in lines[0]
    assert lines[-1]["state"] == "ended"
    assert lines[-1]["result"] == "busy"


async def test_requests_the_server_refuses(llm: ScriptedLLM, tmp_path: Path) -> None:
    async with voice_server(llm.base_url) as plain:  # no --sip
        status, body = await _post(plain, "/calls", {"to": "sip:a@127.0.0.1:5060"})
        assert status == 409
        assert "--sip" in body["error"]
    (tmp_path / "playbooks").mkdir()
    async with _server(llm, tmp_path / "playbooks", auth_token="s3cret") as server:
        status, _ = await _post(server, "/calls", {"to": "sip:a@127.0.0.1"})
        assert status == 401
    async with _server(llm, tmp_path / "playbooks") as server:
        for body, expected in (
            ({"to": "tel:+15551234567"}, 400),
            ({"to": "sip:a@127.0.0.1:99999"}, 400),
            ({"to": "sip:a@127.0.0.1", "ring_timeout_s": 0}, 400),
            ({"to": "sip:a@127.0.0.1", "playbook": "nope"}, 404),
        ):
            status, answer = await _post(server, "/calls", body)
            assert status == expected, (body, answer)
        async with (
            aiohttp.ClientSession() as http,
            http.get(server.make_url("/calls/nope")) as response,
        ):
            assert response.status == 404


def test_sip_uris() -> None:
    assert parse_target("sip:alice@192.0.2.7:5070;transport=udp") == ("192.0.2.7", 5070)
    assert parse_target("sip:192.0.2.7") == ("192.0.2.7", 5060)
    assert parse_target("sip:bob@[::1]:5062") == ("::1", 5062)
    for bad in ("sips:a@host", "sip:", "sip:a@host:0", "sip:a@host:x", "sip:a b@host"):
        with pytest.raises(ValueError, match=r"sip: URI|host|port"):
            parse_target(bad)


def test_a_voicemail_message_is_required_to_leave_one(tmp_path: Path) -> None:
    path = tmp_path / "outreach.yaml"
    path.write_text(PLAYBOOK.replace(f', message: "{MESSAGE}"', ""))
    with pytest.raises(PlaybookError) as refused:
        load_playbooks(path)
    (line,) = refused.value.lines()
    assert "outreach.yaml:6: voicemail" in line
    assert "needs a message" in line
