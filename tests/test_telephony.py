"""Phone transports with test clients speaking their documented protocols: Twilio-style media
streams over a WebSocket and Asterisk AudioSocket over TCP. Real Whisper, Piper and webrtcvad."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from media import Resampler
from media.audio import SAMPLE_RATE, pcm_rms_dbfs, silence
from media.g711 import pcm_to_ulaw, ulaw_to_pcm
from server.call.clock import IDLE_GOODBYE
from server.call.session import SessionSettings
from server.config.server import ServerConfig
from server.http.app import AUDIOSOCKET, CALLS
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from server.transports.phone.audiosocket import (
    DTMF,
    HANGUP,
    SLIN_8K,
    UUID,
    frame_message,
    read_message,
)
from server.transports.phone.media_streams import MAX_MESSAGE_BYTES, TwilioCall
from tests.support.calls import (
    answers_spoken,
    assert_cut_off,
    events_of,
    greeted,
    only_call,
    transcriber,
    voice_server,
    word_error_rate,
)
from tests.support.phone import (
    ANSWER,
    INTERRUPTION,
    LONG_ANSWER,
    PARCEL,
    QUESTION,
    phone_audio,
    prepare_phone_speech,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    prepare_phone_speech()


@pytest.fixture
async def server(llm: ScriptedLLM) -> AsyncIterator[TestServer]:
    async with voice_server(llm.base_url, ServerConfig(audiosocket=("127.0.0.1", 0))) as server:
        yield server


@dataclass
class Received:
    """What a test phone heard: 8 kHz PCM16 with the arrival time of each 20 ms chunk."""

    pcm: bytearray = field(default_factory=bytearray)
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, dBFS)
    control: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def add(self, pcm: bytes) -> None:
        self.pcm += pcm
        self.chunks.append((time.monotonic(), pcm_rms_dbfs(pcm)))

    def loud_after(self, t: float) -> list[float]:
        return [at for at, dbfs in self.chunks if at > t and dbfs > -45]

    async def said(self) -> str:
        resampler = Resampler(8000, SAMPLE_RATE)
        pcm16k = resampler.resample(bytes(self.pcm)) + resampler.flush()
        return (await transcriber().transcribe(pcm16k)).text


async def _paced(chunks: list[bytes], send: Any) -> None:
    """Send 20 ms chunks at real-time pace, like a phone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    for chunk in chunks:
        await send(chunk)
        deadline += 0.02
        await asyncio.sleep(max(0.0, deadline - loop.time()))


def _chunks(pcm8k: bytes, ms: int = 20) -> list[bytes]:
    size = 8000 * ms // 1000 * 2
    return [pcm8k[i : i + size].ljust(size, b"\0") for i in range(0, len(pcm8k), size)]


class TwilioPhone:
    """Speaks the Twilio Media Streams protocol like Twilio does."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.heard = Received()
        self.sequence = 0
        self.closed_with: tuple[int | None, str | None] | None = None
        """The server's close code and reason, once the socket has closed."""
        self.reader = asyncio.create_task(self._read())

    async def start(self, playbook: str, **details: Any) -> None:
        """``connected`` then ``start`` as Twilio sends them; ``details`` replace fields of
        ``start``."""
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send(
            {
                "event": "start",
                "streamSid": "MZ0001",
                "start": {
                    "accountSid": "AC0001",
                    "callSid": "CA0001",
                    "streamSid": "MZ0001",
                    "tracks": ["inbound"],
                    "customParameters": {"playbook": playbook},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    **details,
                },
            }
        )

    async def say(self, pcm8k: bytes) -> None:
        await _paced(_chunks(pcm8k), self._media)

    async def mark(self, name: str, pad_to: int = 0) -> None:
        """Echo a mark as a phone does, its message padded (with an extra field) to ``pad_to``
        bytes."""
        message = {"event": "mark", "mark": {"name": name}, "padding": ""}
        size = len(
            json.dumps({"sequenceNumber": str(self.sequence + 1), "streamSid": "MZ0001", **message})
        )
        message["padding"] = "x" * max(0, pad_to - size)
        await self._send(message)

    async def dtmf(self, digit: str) -> None:
        await self._send({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": digit}})

    async def stop(self) -> None:
        if not self.ws.closed:
            await self._send({"event": "stop", "stop": {"callSid": "CA0001"}})
        try:  # the server hangs up: the socket closes and the reader ends
            await asyncio.wait_for(self.reader, 5)
        except TimeoutError:
            self.reader.cancel()

    async def _media(self, chunk: bytes) -> None:
        payload = base64.b64encode(pcm_to_ulaw(chunk)).decode()
        await self._send({"event": "media", "media": {"track": "inbound", "payload": payload}})

    async def _send(self, message: dict[str, Any]) -> None:
        self.sequence += 1
        await self.ws.send_str(
            json.dumps({"sequenceNumber": str(self.sequence), "streamSid": "MZ0001", **message})
        )

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message.type == aiohttp.WSMsgType.CLOSE:
                self.closed_with = (message.data, message.extra)
                return
            if message.type != aiohttp.WSMsgType.TEXT:
                self.closed_with = (self.ws.close_code, None)
                return
            data = json.loads(message.data)
            if data["event"] == "media":
                assert data["streamSid"] == "MZ0001"
                self.heard.add(ulaw_to_pcm(base64.b64decode(data["media"]["payload"])))
            else:
                self.heard.control.append((time.monotonic(), data))
                if data["event"] == "mark":  # a phone echoes marks as playback reaches them
                    await self._send({"event": "mark", "mark": data["mark"]})


@pytest.fixture
async def twilio(server: TestServer) -> AsyncIterator[TwilioPhone]:
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.make_url("/twilio/media"))
        phone = TwilioPhone(ws)
        yield phone
        with contextlib.suppress(Exception):
            await phone.stop()
        await ws.close()


async def _wait(condition: Any, timeout_s: float) -> None:
    """Poll a condition over state of several peers (the phone, the scripted LLM)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - no single event covers every peer's state
            await asyncio.sleep(0.05)


_replies = answers_by_words({"keypad": LONG_ANSWER, "parcel": LONG_ANSWER}, ANSWER)
"""A keypad input or a question about a parcel gets the long answer; anything else the short."""


def _events(phone: TwilioPhone, kind: str) -> list[tuple[float, dict[str, Any]]]:
    return [(t, d) for t, d in phone.heard.control if d["event"] == kind]


async def test_a_twilio_stream_hears_the_answer_with_marks(
    server: TestServer, twilio: TwilioPhone, llm: ScriptedLLM
) -> None:
    llm.script(_replies)
    await twilio.start("support")
    await _wait(lambda: len(_events(twilio, "mark")) >= 2, 20)  # the greeting's sentences
    await answers_spoken(server, 1)
    greeting_end = len(twilio.heard.pcm)
    await twilio.say(phone_audio(QUESTION) + silence(600, 8000))
    await _wait(lambda: len(_events(twilio, "mark")) >= 4, 20)  # the answer's two sentences
    await answers_spoken(server, 2)
    await asyncio.sleep(0.1)  # the last frames on their way over the socket
    said = await Received(pcm=twilio.heard.pcm[greeting_end:]).said()
    assert word_error_rate(said, ANSWER) <= 0.25
    names = [d["mark"]["name"] for _, d in _events(twilio, "mark")]
    assert names == ["sentence-1", "sentence-2", "sentence-3", "sentence-4"]
    (call,) = server.app[CALLS].calls.values()
    assert isinstance(call, TwilioCall)
    assert call.marks_played == names  # the phone's echoes came back
    await twilio.stop()
    await asyncio.wait_for(call.ended.wait(), 5)
    assert len(server.app[CALLS]) == 0


async def test_barge_in_on_a_twilio_stream_sends_clear_and_stops_the_audio(
    server: TestServer, twilio: TwilioPhone, llm: ScriptedLLM
) -> None:
    llm.script(_replies)
    await twilio.start("support")
    await _wait(lambda: len(_events(twilio, "mark")) >= 2, 20)
    await answers_spoken(server, 1)  # the greeting
    await twilio.say(phone_audio(PARCEL) + silence(600, 8000))
    await _wait(lambda: len(_events(twilio, "mark")) >= 4, 20)  # well into the long answer
    await asyncio.sleep(0.5)
    # a question answered (even one prepared ahead of the end of its turn) gets no clear
    assert _events(twilio, "clear") == []
    # the whole phrase: a clipped "Stop," may end its turn, and be answered, within the window
    talking = asyncio.create_task(twilio.say(phone_audio(INTERRUPTION)))
    await _wait(lambda: bool(_events(twilio, "clear")), 5)
    (cleared_at, _) = _events(twilio, "clear")[0]
    await talking
    # until the window below has passed, every chunk in it arrived (it has, mostly: the phrase,
    # 2.4 s, outlasts it)
    await _wait(lambda: time.monotonic() > cleared_at + 1.2, 5)
    # after the clear the agent's audio stops: nothing loud until it answers the interruption
    assert [t for t in twilio.heard.loud_after(cleared_at + 0.1) if t < cleared_at + 1.2] == []


async def test_audiosocket_call_with_dtmf_and_barge_in(
    server: TestServer, llm: ScriptedLLM
) -> None:
    llm.script(_replies)
    port = server.app[AUDIOSOCKET].port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    heard = Received()

    async def read() -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                kind, payload = await read_message(reader)
                if kind == SLIN_8K:
                    assert len(payload) == 320  # 20 ms frames at 8 kHz
                    heard.add(payload)
                elif kind == HANGUP:
                    return

    async def send_audio(chunk: bytes) -> None:
        writer.write(frame_message(SLIN_8K, chunk))
        await writer.drain()

    reading = asyncio.create_task(read())
    try:
        writer.write(frame_message(UUID, uuid.uuid4().bytes))
        # the greeting plays (waited for by its event: a lull between its sentences can pass
        # for its end on a loaded machine)
        async with asyncio.timeout(30):
            while not greeted(server):
                await _paced(_chunks(silence(100, 8000)), send_audio)
        await _paced(_chunks(silence(300, 8000)), send_audio)
        start = len(heard.pcm)
        await _paced(_chunks(phone_audio(QUESTION)), send_audio)
        # silence until the answer has played (its tts_end: its audio has left the speaker),
        # then half a second more: its last frames come over the socket, and the quiet after
        # them (Whisper misreads a recording's last word with no pause after it)
        async with asyncio.timeout(30):
            while events_of(only_call(server), "tts_end") < 2:  # the greeting's, the answer's
                await _paced(_chunks(silence(100, 8000)), send_audio)
        await _paced(_chunks(silence(500, 8000)), send_audio)
        answer = Received(pcm=heard.pcm[start:])
        assert word_error_rate(await answer.said(), ANSWER) <= 0.25

        for digit in "12#":
            writer.write(frame_message(DTMF, digit.encode()))
        await writer.drain()
        await _wait(lambda: llm.requests[-1]["messages"][-1]["content"] == "Keypad: 12#", 10)
        # the long answer is playing (waited for: on a loaded machine a later sentence may
        # start late)
        async with asyncio.timeout(10):
            while not heard.loud_after(time.monotonic() - 0.2):
                await _paced(_chunks(silence(100, 8000)), send_audio)
        call = only_call(server)
        mark = call.events.published
        talk_at = time.monotonic()
        await _paced(_chunks(phone_audio(INTERRUPTION)[: 8000 * 2]), send_audio)
        assert_cut_off(heard.chunks, call, talk_at, mark)  # paused at once, never resumed
    finally:
        writer.write(frame_message(HANGUP))
        await writer.drain()
        writer.close()
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    calls = server.app[CALLS]
    await _wait(lambda: len(calls) == 0, 5)


# -- limits and malformed input ----------------------------------------------------------------

LIMITS = [
    pytest.param(
        ServerConfig(idle_timeout_s=1.0, session=SessionSettings(greet=False)),
        "idle timeout",
        1.0,
        id="idle-timeout",
    ),
    pytest.param(ServerConfig(max_call_s=1.0), "maximum call duration reached", 1.0, id="max-call"),
]
"""A silent caller on a server that hangs up after 1 s idle (no greeting, so the agent is quiet
at once), or after 1 s whatever happens (the greeting, 3 s long, is playing then)."""


@pytest.mark.parametrize(("config", "reason", "after_s"), LIMITS)
async def test_a_twilio_stream_is_hung_up_at_the_call_limits(
    llm: ScriptedLLM, config: ServerConfig, reason: str, after_s: float
) -> None:
    llm.script(_replies)
    async with voice_server(llm.base_url, config) as server, aiohttp.ClientSession() as http:
        phone = TwilioPhone(await http.ws_connect(server.make_url("/twilio/media")))
        started = time.monotonic()
        await phone.start("support")
        await asyncio.wait_for(phone.reader, after_s + 10)
        elapsed = time.monotonic() - started
        assert phone.closed_with == (aiohttp.WSCloseCode.OK, reason)
        assert after_s <= elapsed < after_s + 3  # the clock looks once a second
        await _wait(lambda: len(server.app[CALLS]) == 0, 5)


QUIET_PLAYBOOK = """
id: quiet
name: A caller who goes quiet
initial_stage: main
global_system_prompt: You are a phone agent.
idle: {prompt_after_s: 1, prompt: "Are you still there?", hangup_after_s: 1, goodbye: "Goodbye."}
stages:
  - {id: main, name: Main, system_prompt: Help the caller., greeting: Hello.}
"""


async def test_a_quiet_caller_is_asked_then_told_goodbye(llm: ScriptedLLM, tmp_path: Path) -> None:
    (tmp_path / "quiet.yaml").write_text(QUIET_PLAYBOOK)
    config = ServerConfig(idle_timeout_s=60.0)  # the playbook's setting replaces it
    async with (
        voice_server(llm.base_url, config, tmp_path) as server,
        aiohttp.ClientSession() as http,
    ):
        phone = TwilioPhone(await http.ws_connect(server.make_url("/twilio/media")))
        await phone.start("quiet")
        await asyncio.wait_for(phone.reader, 20)
    assert phone.closed_with == (aiohttp.WSCloseCode.OK, IDLE_GOODBYE)
    said = await phone.heard.said()
    assert word_error_rate(said, "Hello. Are you still there? Goodbye.") <= 0.25, said
    assert llm.requests == []  # nothing the caller said: no turn


@pytest.mark.parametrize(("config", "reason", "after_s"), LIMITS)
async def test_an_audiosocket_call_is_hung_up_at_the_call_limits(
    llm: ScriptedLLM,
    config: ServerConfig,
    reason: str,
    after_s: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="server.transports.phone.audiosocket")
    llm.script(_replies)
    config = replace(config, audiosocket=("127.0.0.1", 0))
    async with voice_server(llm.base_url, config) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.app[AUDIOSOCKET].port)

        async def send_audio(chunk: bytes) -> None:
            writer.write(frame_message(SLIN_8K, chunk))
            await writer.drain()

        started = time.monotonic()
        writer.write(frame_message(UUID, uuid.uuid4().bytes))
        sending = asyncio.create_task(_paced(_chunks(silence(20_000, 8000)), send_audio))
        try:
            async with asyncio.timeout(after_s + 10):
                while (await read_message(reader))[0] != HANGUP:  # the agent's audio, then
                    pass
            elapsed = time.monotonic() - started
            with contextlib.suppress(ConnectionResetError):  # our audio was still arriving
                assert await reader.read() == b""  # ...the connection is closed
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await sending
            writer.close()
        assert after_s <= elapsed < after_s + 3
        await _wait(lambda: len(server.app[CALLS]) == 0, 5)
    assert f"ended: {reason}" in caplog.text


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            {"start": {"mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": "abc"}}},
            "start.mediaFormat.sampleRate: Input should be a valid integer",
        ),
        (
            {"start": {"mediaFormat": {"sampleRate": -8000}}},
            "start.mediaFormat.sampleRate: Input should be greater than or equal to 8000",
        ),
        ({"start": {"customParameters": ["support"]}}, "start.customParameters: must be an object"),
        ({"start": {"customParameters": {"playbook": 3}}}, "start.customParameters.playbook:"),
        ({"start": "now"}, "start: must be an object"),
        ({"streamSid": 7, "start": {}}, "streamSid: Input should be a valid string"),
        ({"start": {"customParameters": {"playbook": "nope"}}}, "unknown playbook 'nope'"),
    ],
)
async def test_a_bad_start_closes_that_stream_with_1008_and_others_go_on(
    server: TestServer,
    twilio: TwilioPhone,
    llm: ScriptedLLM,
    message: dict[str, Any],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """These raised in the handler ("unhandled error", a traceback) and the error middleware
    wrote an HTTP 500 onto the upgraded socket (regression)."""
    llm.script(_replies)
    await twilio.start("support")
    calls = server.app[CALLS]
    await _wait(lambda: len(calls) == 1, 5)
    async with aiohttp.ClientSession() as http:
        bad = await http.ws_connect(server.make_url("/twilio/media"))
        await bad.send_json({"event": "start", **message})
        closing = await asyncio.wait_for(bad.receive(), 5)
        await bad.close()
    assert closing.type == aiohttp.WSMsgType.CLOSE
    assert closing.data == aiohttp.WSCloseCode.POLICY_VIOLATION
    assert reason in str(closing.extra)
    assert f"media stream refused: {closing.extra}" in caplog.text  # one line, no traceback
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    assert len(calls) == 1
    assert twilio.closed_with is None  # the call already up is untouched


async def test_a_media_message_over_64_kib_closes_the_stream_with_1009(
    server: TestServer, twilio: TwilioPhone, llm: ScriptedLLM
) -> None:
    llm.script(_replies)
    await twilio.start("support")
    calls = server.app[CALLS]
    await _wait(lambda: len(calls) == 1, 5)
    (call,) = calls.calls.values()
    assert isinstance(call, TwilioCall)
    await twilio.mark("under-the-limit", pad_to=MAX_MESSAGE_BYTES - 100)
    await _wait(lambda: "under-the-limit" in call.marks_played, 5)
    await twilio.mark("over-the-limit", pad_to=MAX_MESSAGE_BYTES + 1)
    await asyncio.wait_for(twilio.reader, 5)
    assert twilio.closed_with is not None
    assert twilio.closed_with[0] == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    await asyncio.wait_for(call.ended.wait(), 5)
    assert len(calls) == 0
    assert "over-the-limit" not in call.marks_played
