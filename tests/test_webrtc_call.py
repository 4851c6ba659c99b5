"""A real aiortc caller against the real server: speech in, the agent's voice out, barge-in."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from media.audio import pcm_rms_dbfs
from server.call.session import SessionSettings
from server.config.server import ServerConfig
from server.http.app import CALLS
from server.runtime.registry import NO_LLM_LINE
from server.testkit.caller import ReplayedOpusPackets, WebRTCCaller
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall, answers_by_words
from server.transports.client_events import CLIENT_ERRORS
from server.transports.webrtc.tracks import (
    OUTPUT_RATE,
    SILENCE_TAIL_FRAMES,
    OpusPackets,
    negotiated_opus,
)
from tests.support.calls import (
    base_url,
    piper_speech,
    quick_playbook,
    synthesize_ahead,
    transcriber,
    voice_server,
    word_error_rate,
    words,
)
from tests.support.speech import tone

pytestmark = pytest.mark.slow


CALLER_PHRASES = (
    "Hello, where is my parcel?",
    "Wait, I have another question.",
    "What are your delivery options?",
)


@pytest.fixture(scope="module", autouse=True)
def _caller_speech_ready() -> None:
    synthesize_ahead(*CALLER_PHRASES)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The playbook ``quick``: a greeting of 0.5 s where the support example's takes 3.2 s, for
    the calls that only sit through it (``tests.support.calls.QUICK_PLAYBOOK``)."""
    return quick_playbook(tmp_path_factory.mktemp("quick"))


@pytest.fixture
async def server(llm: ScriptedLLM, quick: Path) -> AsyncIterator[TestServer]:
    """The server with the playbook ``quick``."""
    async with voice_server(llm.base_url, playbooks=quick) as server:
        yield server


async def test_a_call_over_webrtc_hears_the_scripted_answer(
    server: TestServer, caller: WebRTCCaller, llm: ScriptedLLM
) -> None:
    answer = "Your order is on its way. It will arrive on Tuesday."
    llm.script(answers_by_words({"parcel": answer}, "Go on."))
    await caller.connect(base_url(server), playbook="quick")
    await caller.wait_for("tts_end", timeout_s=30)  # the greeting
    greeting_bytes = len(caller.heard)
    caller.say(piper_speech("Hello, where is my parcel?"))
    await caller.wait_for("tts_end", count=2, timeout_s=40)
    await asyncio.sleep(0.3)  # the last frames in flight

    order = [
        e["type"]
        for e in caller.events
        if e["type"] in ("speech_start", "transcript", "agent_sentence", "tts_end")
    ]
    turn = order[order.index("speech_start") :]
    assert turn == ["speech_start", "transcript", "agent_sentence", "agent_sentence", "tts_end"]
    (transcript,) = caller.of_type("transcript")
    assert {"hello", "my", "parcel"} <= set(words(transcript["text"]))
    said = (await transcriber().transcribe(bytes(caller.heard[greeting_bytes:]))).text
    assert word_error_rate(said, answer) <= 0.2
    (metrics,) = caller.of_type("turn_metrics")
    assert metrics["voice_to_voice_ms"] > 0

    # hang up through the API: the session is freed
    calls = server.app[CALLS]
    assert caller.session_id in calls.calls
    await calls.hangup(caller.session_id)
    assert caller.session_id not in calls.calls
    hangup = await caller.wait_for("hangup", timeout_s=5)
    assert hangup["reason"] == "hung up by the client"


async def test_barge_in_over_webrtc_silences_the_agent_at_the_client(
    server: TestServer, caller: WebRTCCaller, llm: ScriptedLLM
) -> None:
    long_answer = " ".join(
        [
            "Let me tell you everything about our delivery options.",
            "Standard delivery takes three to five working days.",
            "Express delivery arrives the next working day if you order before noon.",
            "Weekend delivery is available in most cities for a small fee.",
        ]
    )
    llm.script(answers_by_words({"delivery options": long_answer}, "Sure, go ahead."))
    await caller.connect(base_url(server), playbook="quick")
    await caller.wait_for("tts_end", timeout_s=30)  # the greeting: one sentence
    caller.say(piper_speech("What are your delivery options?"))
    await caller.wait_for("agent_sentence", count=2, timeout_s=40)  # the answer's first
    caller.say(piper_speech("Wait, I have another question."))
    interrupted = await caller.wait_for("interrupted", timeout_s=10)
    cut_at = interrupted["t_ms"] / 1000  # server monotonic clock; same machine
    await asyncio.sleep(0.6)
    # at the client, the agent's audio is silent shortly after the interrupt decision
    late = [f for f in caller.frames if f.at > cut_at + 0.25]
    assert late
    assert max(f.dbfs for f in late[:10]) < -50
    await caller.wait_for("tts_end", count=3, timeout_s=30)
    assert caller.of_type("agent_sentence")[-1]["text"] == "Sure, go ahead."


async def test_typed_text_mute_and_bad_messages_over_the_data_channel(
    server: TestServer, caller: WebRTCCaller, llm: ScriptedLLM
) -> None:
    llm.script([Reply(content="Typed questions work too.")])
    await caller.connect(base_url(server), playbook="quick")
    await caller.wait_for("tts_end", timeout_s=30)  # the greeting
    caller.send({"type": "mute", "muted": True})
    caller.send({"type": "text", "text": "Can I type instead?"})
    await caller.wait_for("tts_end", count=2, timeout_s=30)
    assert caller.of_type("agent_sentence")[-1]["text"] == "Typed questions work too."
    assert llm.requests[-1]["messages"][-1] == {"role": "user", "content": "Can I type instead?"}
    session = server.app[CALLS].calls[caller.session_id].session
    assert session.muted is True

    caller.send({"type": "dance"})
    caller.channel.send("not json")
    caller.send({"type": "text", "text": "x" * 5000})  # over the 4 KiB a message may have
    first = await caller.wait_for("error", timeout_s=5)
    second = await caller.wait_for("error", count=2, timeout_s=5)
    third = await caller.wait_for("error", count=3, timeout_s=5)
    assert first["message"] == "unsupported message 'dance'"
    assert second["message"] == "expected a JSON object with a type"
    assert third["message"] == "message too large or binary"
    assert caller.session_id in server.app[CALLS].calls  # bad input ends nothing


async def _follow(url: str, events: list[dict[str, Any]]) -> None:
    """Read the server-sent events at ``url`` into ``events`` until the server ends them."""
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))


async def test_keypad_digits_and_a_tool_call_over_webrtc_and_its_event_stream(
    server: TestServer, caller: WebRTCCaller, llm: ScriptedLLM
) -> None:
    """``{"type": "dtmf"}`` messages are taken as a phone's digits (a ``dtmf`` event each,
    then a ``Keypad:`` turn), bad ones get one ``error`` each; ``tool_call_start`` says the
    call's arguments; ``GET /calls/{id}/events`` streams what the data channel carries, until
    the call ends."""
    llm.script(
        [
            Reply(content="Thanks for the digits."),
            Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1001"})]),
            Reply(content="It is on its way."),
        ]
    )
    await caller.connect(base_url(server), playbook="quick")
    streamed: list[dict[str, Any]] = []
    url = f"{base_url(server)}/calls/{caller.session_id}/events"
    following = asyncio.create_task(_follow(url, streamed))
    await caller.wait_for("tts_end", timeout_s=30)  # the greeting

    caller.send({"type": "dtmf", "digits": "12#"})
    await caller.wait_for("tts_end", count=2, timeout_s=30)
    assert [e["digit"] for e in caller.of_type("dtmf")] == ["1", "2", "#"]
    assert llm.user_turns == ["Keypad: 12#"]
    assert caller.of_type("agent_sentence")[-1]["text"] == "Thanks for the digits."

    for bad in ("", "12x", "1" * 33, 7):
        caller.send({"type": "dtmf", "digits": bad})
    caller.send({"type": "dtmf"})
    await caller.wait_for("error", count=5, timeout_s=5)
    empty = 'a "dtmf" message needs a non-empty "digits" string'
    assert [e["message"] for e in caller.of_type("error")] == [
        empty,
        "not a keypad digit: 'x' (0-9, *, #, A-D)",
        'a "dtmf" message carries at most 32 digits',
        empty,
        empty,
    ]
    assert len(caller.of_type("dtmf")) == 3  # nothing of a bad message was taken

    caller.send({"type": "text", "text": "Where is my order?"})
    await caller.wait_for("tts_end", count=3, timeout_s=30)
    (started,) = caller.of_type("tool_call_start")
    assert (started["name"], started["arguments"]) == ("lookup_order", {"order_id": "A1001"})

    await server.app[CALLS].hangup(caller.session_id)
    await asyncio.wait_for(following, 15)  # the stream ends with the call
    assert (streamed[-1]["type"], streamed[-1]["reason"]) == ("hangup", "hung up by the client")
    await caller.wait_for("hangup", timeout_s=5)
    # the stream has what the channel carried before its hang-up (but its answers to the client)
    carried = caller.events[: caller.events.index(caller.of_type("hangup")[0])]
    carried = [e for e in carried if e.get("source") != "client"]
    assert streamed[: len(carried)] == carried
    assert [e["type"] for e in streamed].count("tool_call_start") == 1


async def test_a_vanishing_peer_frees_its_session(caller: WebRTCCaller, llm: ScriptedLLM) -> None:
    async with voice_server(llm.base_url) as server:  # the example playbooks
        await caller.connect(base_url(server), playbook="restaurant")
        await caller.wait_for("agent_sentence", timeout_s=30)
        calls = server.app[CALLS]
        (call,) = calls.calls.values()
        await caller.pc.close()  # no hang-up message: the peer is simply gone
        await asyncio.wait_for(call.ended.wait(), timeout=40)
        assert len(calls) == 0
        assert call.session.state == "closed"
        assert llm.requests == []


@pytest.mark.parametrize(
    ("config", "reason", "after_s"),
    [
        pytest.param(
            ServerConfig(idle_timeout_s=1.0, session=SessionSettings(greet=False)),
            "idle timeout",
            1.0,
            id="idle-timeout",
        ),
        pytest.param(
            ServerConfig(max_call_s=2.0), "maximum call duration reached", 2.0, id="max-call"
        ),
    ],
)
async def test_a_call_is_hung_up_at_the_call_limits(
    caller: WebRTCCaller, llm: ScriptedLLM, config: ServerConfig, reason: str, after_s: float
) -> None:
    """A silent caller: hung up after 1 s idle (no greeting, so the agent is quiet at once), or
    2 s after the call started while the greeting still plays."""
    async with voice_server(llm.base_url, config) as server:
        await caller.connect(base_url(server), playbook="support")
        started = time.monotonic()
        (call,) = server.app[CALLS].calls.values()
        hangup = await caller.wait_for("hangup", timeout_s=after_s + 15)
        assert hangup["reason"] == reason
        await asyncio.wait_for(call.ended.wait(), 5)
        # the clock runs from the offer, and looks once a second from the connection on
        assert after_s - 0.5 <= time.monotonic() - started < after_s + 4
        assert len(server.app[CALLS]) == 0


async def test_without_an_llm_the_agent_says_so_in_one_sentence(
    caller: WebRTCCaller, caplog: pytest.LogCaptureFixture, quick: Path
) -> None:
    """The caller's ``error`` event says what failed in fixed words; the exception's own text
    goes to the server log only."""
    async with voice_server(None, playbooks=quick) as server:
        await caller.connect(base_url(server), playbook="quick")
        await caller.wait_for("tts_end", timeout_s=30)  # the greeting still plays
        caller.send({"type": "text", "text": "Hello?"})
        await caller.wait_for("tts_end", count=2, timeout_s=30)
        assert caller.of_type("tts_end")[-1]["heard"] == NO_LLM_LINE
        (error,) = caller.of_type("error")
        assert set(error) == {"type", "t_ms", "source", "message"}
        assert (error["source"], error["message"]) == ("llm", CLIENT_ERRORS["llm"])
        assert f"call {caller.session_id}: llm error: no LLM endpoint is configured" in caplog.text


def test_the_agents_voice_is_sent_as_opus_packets_and_silence_as_one_cached_packet() -> None:
    opus = OpusPackets()
    voice = tone(OUTPUT_RATE, 200)
    frames = [voice[i : i + 1920] for i in range(0, len(voice), 1920)]
    silence_frame = bytes(1920)
    stream = [(frame, False) for frame in frames] + [(silence_frame, True)] * 8
    packets = [opus.packet(pcm, n * 960, silent=silent) for n, (pcm, silent) in enumerate(stream)]
    assert [p.pts for p in packets] == [n * 960 for n in range(len(stream))]
    assert all(bytes(p)[0] >> 3 >= 16 for p in packets)  # TOC configs 16-31: CELT only
    tail = [bytes(p) for p in packets[len(frames) + SILENCE_TAIL_FRAMES :]]
    assert len(set(tail)) == 1  # after a short encoded tail, one packet stands for silence
    decoder = av.CodecContext.create("libopus", "r")
    decoded = b"".join(
        bytes(frame.planes[0])[: frame.samples * 2 * len(frame.layout.channels)]
        for packet in packets
        for frame in decoder.decode(packet)
    )
    heard = np.frombuffer(decoded, dtype=np.int16)
    sound_end = len(frames) * 960 * len(decoder.layout.channels)
    assert pcm_rms_dbfs(heard[960:sound_end].tobytes()) > -30  # the tone came through
    assert pcm_rms_dbfs(heard[sound_end + 4 * 960 :].tobytes()) < -60  # then silence


def test_harness_callers_replay_a_packet_only_after_the_same_sound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The benchmark's callers share the server's cores: a stretch of sound one caller encoded
    is sent by the others as those packets, not encoded again, and a frame is replayed only
    after the same frames since the last silence (a packet depends on the encoder's state: an
    all-zero frame inside one utterance is not the packet of one inside another). Every stream
    is byte for byte what a live VoIP encoder would have sent."""
    monkeypatch.setattr(ReplayedOpusPackets, "_encoded", {})
    encodes: list[bytes] = []
    own_packet = OpusPackets.packet

    def counting(self: OpusPackets, pcm: bytes, pts: int, *, silent: bool) -> av.Packet[Any]:
        if not silent:
            encodes.append(pcm)
        return own_packet(self, pcm, pts, silent=silent)

    monkeypatch.setattr(OpusPackets, "packet", counting)

    def frames(pcm: bytes) -> list[bytes]:
        return [pcm[i : i + 1920] for i in range(0, len(pcm), 1920)]

    pause = bytes(1920)  # digital silence inside an utterance (a pause in synthesized speech)
    first = [*frames(tone(OUTPUT_RATE, 200, 440)), pause, *frames(tone(OUTPUT_RATE, 100, 440))]
    second = [*frames(tone(OUTPUT_RATE, 100, 300)), pause, *frames(tone(OUTPUT_RATE, 100, 300))]
    changed = first[:6] + frames(tone(OUTPUT_RATE, 100, 600))  # the same start, then not

    def send(caller: OpusPackets, utterance: list[bytes]) -> list[bytes]:
        stream = [(f, False) for f in utterance] + [(bytes(1920), True)] * 4
        packets = [caller.packet(f, n * 960, silent=silent) for n, (f, silent) in enumerate(stream)]
        assert [p.pts for p in packets] == [n * 960 for n in range(len(stream))]
        return [bytes(p) for p in packets]

    def live(utterance: list[bytes]) -> list[bytes]:
        live_packets = send(OpusPackets(application="voip"), utterance)
        encodes.clear()
        return live_packets

    def replayed(utterance: list[bytes]) -> list[bytes]:
        return send(ReplayedOpusPackets(application="voip"), utterance)

    for utterance in (first, second):
        expected = live(utterance)
        assert replayed(utterance) == expected
        assert encodes == utterance  # new: every frame encoded (the second's pause too)
        encodes.clear()
    expected = live(first)
    assert replayed(first) == expected
    assert not encodes  # heard before, from silence: every packet replayed
    expected = live(changed)
    assert replayed(changed) == expected
    assert encodes == changed  # at the first new frame the encoder was given the start too


def test_the_server_encodes_itself_only_when_opus_was_negotiated() -> None:
    opus_first = (
        "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n"
        "m=audio 9 UDP/TLS/RTP/SAVPF 111 0\r\nc=IN IP4 127.0.0.1\r\n"
        "a=rtpmap:111 opus/48000/2\r\na=rtpmap:0 PCMU/8000\r\n"
    )
    pcmu_first = opus_first.replace("SAVPF 111 0", "SAVPF 0 111")
    assert negotiated_opus(opus_first)
    assert not negotiated_opus(pcmu_first)
