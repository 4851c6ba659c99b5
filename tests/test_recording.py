"""Call recording (``--record DIR``): real calls over WebRTC (aiortc) and SIP leave a stereo WAV
(caller left, agent right) and a JSON Lines transcript; a barge-in shows as the agent's channel
going silent; opt-outs leave nothing; files are 0600; old recordings are swept; a failing disk
ends the recording, never the call. Real Whisper, Piper and webrtcvad; the LLM is scripted."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import stat
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from media.audio import SAMPLE_RATE, silence
from playbooks.models import Playbook
from server.call.recorder import RECORDING_RATE, CallRecorder, FailureReason, StereoTimeline
from server.call.recordings import Recordings, RecordingSettings, wants_recording
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, METRICS, SIP
from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import NO_INTENT, Reply, ScriptedLLM, ScriptedToolCall
from server.testkit.sip_phone import SipPhone
from tests.support.calls import (
    base_url,
    piper_speech,
    synthesize_ahead,
    transcriber,
    voice_server,
    word_error_rate,
)
from tests.support.phone import ANSWER, INTERRUPTION, LONG_ANSWER, PARCEL, phone_audio

pytestmark = pytest.mark.slow

NOTICE = "This call is recorded."
OPTIONS = "What are your delivery options?"
QUESTION = "Please check the status of my order."
GO_AHEAD = "Sure, go ahead."
LOUD_DBFS, QUIET_DBFS = -40.0, -50.0


def _reply(body: dict[str, Any]) -> Reply:
    """An order question looks the order up, then answers ANSWER; the delivery options get the
    long answer; anything else GO_AHEAD."""
    if not body.get("stream"):
        return NO_INTENT
    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(content=ANSWER)
    text = str(last["content"]).lower()
    if "delivery options" in text:
        return Reply(content=LONG_ANSWER)
    if "parcel" in text or "order" in text:
        return Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1001"})])
    return Reply(content=GO_AHEAD)


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    synthesize_ahead(PARCEL, OPTIONS, INTERRUPTION)
    phone_audio(QUESTION)


# -- reading a recording -------------------------------------------------------------------------


class Recording:
    """One call's files: the WAV's two channels and the transcript's lines."""

    def __init__(self, directory: Path) -> None:
        [self.wav] = sorted(directory.glob("*.wav"))
        [self.jsonl] = sorted(directory.glob("*.jsonl"))
        with wave.open(str(self.wav), "rb") as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (2, 2, 16000)
            stereo = np.frombuffer(wav.readframes(wav.getnframes()), np.int16).reshape(-1, 2)
        self.caller = stereo[:, 0].tobytes()
        self.agent = stereo[:, 1].tobytes()
        self.lines = [json.loads(line) for line in self.jsonl.read_text().splitlines()]

    def events(self, type: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["type"] == type]

    def at_s(self, type: str, number: int = 1) -> float:
        """Where the ``number``-th event of ``type`` happened, in seconds of the WAV."""
        return float(self.events(type)[number - 1]["call_ms"]) / 1000


def _clip(pcm: bytes, start_s: float, end_s: float) -> bytes:
    return pcm[max(0, int(start_s * SAMPLE_RATE)) * 2 : int(end_s * SAMPLE_RATE) * 2]


def _levels(pcm: bytes, start_s: float, end_s: float) -> list[float]:
    """dBFS of each 20 ms window of ``pcm`` between the two times."""
    samples = np.frombuffer(_clip(pcm, start_s, end_s), np.int16).astype(np.float64)
    windows = samples[: samples.size // 320 * 320].reshape(-1, 320)
    rms = np.sqrt(np.mean(windows * windows, axis=1)) + 1e-9
    return [float(level) for level in 20 * np.log10(rms / 32768)]


def _onset_s(pcm: bytes, after_s: float) -> float:
    """The start of the first loud 20 ms window after ``after_s``."""
    levels = _levels(pcm, after_s, len(pcm) / 2 / SAMPLE_RATE)
    return after_s + next(i for i, level in enumerate(levels) if level > LOUD_DBFS) * 0.02


async def _said(pcm: bytes) -> str:
    return (await transcriber().transcribe(pcm)).text


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def _private(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- end to end ----------------------------------------------------------------------------------


async def test_a_webrtc_call_is_recorded_as_heard_with_its_turns_and_a_barge_in(
    caller: WebRTCCaller, llm: ScriptedLLM, tmp_path: Path
) -> None:
    directory = tmp_path / "recordings"
    llm.script(_reply)
    config = ServerConfig(recording=RecordingSettings(directory, notice=NOTICE))
    async with voice_server(llm.base_url, config) as server:
        await caller.connect(base_url(server), playbook="support")
        await caller.wait_for("tts_end", count=2, timeout_s=40)  # the notice, the greeting
        caller.say(piper_speech(PARCEL))
        await caller.wait_for("tts_end", count=3, timeout_s=40)
        caller.say(piper_speech(OPTIONS))
        await caller.wait_for("tts_start", count=4, timeout_s=40)  # the long answer plays
        await asyncio.sleep(1.5)
        caller.say(piper_speech(INTERRUPTION))
        await caller.wait_for("interrupted", timeout_s=20)
        await caller.wait_for("tts_end", count=5, timeout_s=40)  # the answer to "Stop..."
        calls = server.app[CALLS]
        await calls.hangup(caller.session_id)
        await calls.recordings.aclose()
    assert [e["text"] for e in caller.of_type("agent_sentence")][:1] == [NOTICE]

    assert _private(directory) == 0o700
    recording = Recording(directory)
    assert _private(recording.wav) == _private(recording.jsonl) == 0o600
    started, ended = recording.lines[0], recording.lines[-1]
    assert (started["type"], started["call_id"], started["playbook"]) == (
        "recording_started",
        caller.session_id,
        "support",
    )
    assert ended["type"] == "recording_ended"
    assert abs(ended["duration_ms"] / 1000 - len(recording.agent) / 2 / SAMPLE_RATE) < 0.05
    types = {line["type"] for line in recording.lines}
    assert {"transcript", "stage_change", "tool_call_start", "tool_call_end"} <= types
    assert {"agent_sentence", "turn_metrics", "interrupted", "state"} <= types
    [tool] = recording.events("tool_call_end")
    assert (tool["name"], tool["error"]) == ("lookup_order", False)
    assert recording.events("turn_metrics")[0]["voice_to_voice_ms"] > 0

    # the agent's channel: the notice, then the answer where its events say it played
    notice = _clip(recording.agent, recording.at_s("tts_start", 1), recording.at_s("tts_end", 1))
    assert "recorded" in (await _said(notice)).lower()
    answer = _clip(
        recording.agent, recording.at_s("tts_start", 3) - 0.1, recording.at_s("tts_end", 3) + 0.2
    )
    said = await _said(answer)
    assert word_error_rate(said, ANSWER) <= 0.25, said
    # the caller's channel: the question, where the VAD heard it
    asked_at = recording.at_s("speech_start", 1)
    assert abs(_onset_s(recording.caller, asked_at - 1.0) - asked_at) < 0.3
    asked = _clip(recording.caller, asked_at - 0.5, recording.at_s("speech_end", 1))
    assert "parcel" in (await _said(asked)).lower()

    # the barge-in: the agent was talking, and its channel is silent from the pause on
    long_from = recording.at_s("tts_start", 4)
    talk_at = _onset_s(recording.caller, long_from + 1.0)
    assert max(_levels(recording.agent, talk_at - 1.0, talk_at)) > LOUD_DBFS
    paused_at = recording.at_s("paused")
    assert paused_at - talk_at < 0.4  # the barge-in time, on the server's own clock
    next_answer = recording.at_s("tts_start", 5)  # (told a moment after its first frame left)
    # (from 250 ms on: the recorder lays a channel's frames one after another, resyncing to the
    # clock only past RESYNC_S = 200 ms of drift, and after a stall of the loop the transport
    # pulls several frames at once, so the fade's last frames can land up to 200 ms later than
    # the event's time: 200 ms once with three test workers on two cores; how fast the agent
    # stops is measured at the caller, in test_barge_in.py)
    assert max(_levels(recording.agent, paused_at + 0.25, next_answer - 0.1)) < QUIET_DBFS
    tail = _clip(recording.agent, next_answer - 0.1, recording.at_s("tts_end", 5) + 0.2)
    assert "ahead" in (await _said(tail)).lower()


async def test_a_sip_call_is_recorded_and_one_that_opts_out_is_not(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    directory = tmp_path / "recordings"
    llm.script(_reply)
    sip = SipSettings(host="127.0.0.1", port=0)
    config = ServerConfig(sip=sip, recording=RecordingSettings(directory))
    async with voice_server(llm.base_url, config) as server:
        calls = server.app[CALLS]
        opted_out = await SipPhone.open(server.app[SIP].port)
        phone = await SipPhone.open(server.app[SIP].port)
        try:
            answer = await opted_out.invite(extra="X-Vocable-Record: off\r\n")
            assert answer.status_code == 200
            [opted_out_id] = calls.calls
            opted_out.start_microphone()  # silence, as a phone sends it
            await opted_out.follow_events(base_url(server))
            await opted_out.wait_for("tts_start")  # the call is up and its greeting plays
            assert (await opted_out.bye()).status_code == 200

            assert (await phone.invite()).status_code == 200
            [recorded_id] = calls.calls
            phone.start_microphone()
            await phone.follow_events(base_url(server))
            await phone.wait_for("tts_end")  # the greeting played
            await phone.say(phone_audio(QUESTION))
            await phone.wait_for("tts_end", 2)  # the answer played
            await phone.say(silence(300, 8000))  # and the 0.2 s after it, transcribed below
            assert (await phone.bye()).status_code == 200
        finally:
            await opted_out.close()
            await phone.close()
        await calls.recordings.aclose()

    recording = Recording(directory)  # one call's files only
    assert recording.lines[0]["call_id"] == recorded_id != opted_out_id
    assert _private(recording.wav) == 0o600
    assert not any(line["type"] == "recording_failed" for line in recording.lines)
    asked_at = recording.at_s("speech_start", 1)
    assert abs(_onset_s(recording.caller, asked_at - 1.0) - asked_at) < 0.3
    asked = await _said(_clip(recording.caller, asked_at - 0.5, recording.at_s("speech_end", 1)))
    assert word_error_rate(asked, QUESTION) <= 0.3, asked
    answered = _clip(
        recording.agent, recording.at_s("tts_start", 2) - 0.1, recording.at_s("tts_end", 2) + 0.2
    )
    said = await _said(answered)
    assert word_error_rate(said, ANSWER) <= 0.25, said


async def test_a_webrtc_call_that_opts_out_leaves_no_files_and_hears_no_notice(
    caller: WebRTCCaller, llm: ScriptedLLM, tmp_path: Path
) -> None:
    directory = tmp_path / "recordings"
    config = ServerConfig(recording=RecordingSettings(directory, notice=NOTICE))
    async with voice_server(llm.base_url, config) as server:
        caller.offer_headers["X-Vocable-Record"] = "off"
        await caller.connect(base_url(server), playbook="support")
        # the first thing said (a notice would be): a recording would have been opened, its
        # files created, as the call began
        await caller.wait_for("agent_sentence", timeout_s=40)
        await server.app[CALLS].hangup(caller.session_id)
    assert caller.of_type("agent_sentence")[0]["text"].startswith("Hello")
    assert list(directory.iterdir()) == []


async def test_a_recording_that_cannot_be_written_is_an_event_and_the_call_goes_on(
    caller: WebRTCCaller, llm: ScriptedLLM, tmp_path: Path
) -> None:
    """The recordings directory is replaced by a file after start-up (so even root cannot
    write there): the call's recording fails at once, the caller and the metrics are told,
    and the call answers as ever."""
    directory = tmp_path / "recordings"
    llm.script([Reply(content="Typed questions work too.")])
    config = ServerConfig(recording=RecordingSettings(directory))
    async with voice_server(llm.base_url, config) as server:
        directory.rmdir()
        directory.write_text("not a directory any more")
        await caller.connect(base_url(server), playbook="support")
        failed = await caller.wait_for("recording_failed", timeout_s=20)
        assert (failed["reason"], failed["message"]) == (
            "write",
            "the recording could not be written",
        )
        await caller.wait_for("tts_end", timeout_s=40)  # the greeting
        caller.send({"type": "text", "text": "Can I type instead?"})
        await caller.wait_for("tts_end", count=2, timeout_s=40)
        assert caller.of_type("agent_sentence")[-1]["text"] == "Typed questions work too."
        assert caller.session_id in server.app[CALLS].calls
        metrics = server.app[METRICS].render().decode()
        assert 'vocable_recording_failures_total{reason="write"} 1.0' in metrics
        await server.app[CALLS].hangup(caller.session_id)


# -- the recorder and the store ------------------------------------------------------------------


def _playbook(**extra: Any) -> Playbook:
    return Playbook.model_validate(
        {
            "id": "p",
            "name": "P",
            "initial_stage": "s",
            "stages": [{"id": "s", "name": "S", "system_prompt": "Help."}],
            **extra,
        }
    )


def _failures() -> tuple[list[tuple[FailureReason, str]], Any]:
    failures: list[tuple[FailureReason, str]] = []
    return failures, lambda reason, message: failures.append((reason, message))


async def test_a_playbook_opts_out_or_says_its_own_notice(tmp_path: Path) -> None:
    recordings = Recordings(RecordingSettings(tmp_path, notice="Server notice."))
    _, failed = _failures()
    assert recordings.open("a", _playbook(recording=False), failed) is None
    assert recordings.open("b", _playbook(), failed, wanted=False) is None
    assert _names(tmp_path) == []
    opened = recordings.open("c", _playbook(recording={"notice": "Playbook notice."}), failed)
    assert opened is not None
    assert opened[1] == "Playbook notice."
    default = recordings.open("d", _playbook(), failed)
    assert default is not None
    assert default[1] == "Server notice."
    await recordings.aclose()
    assert [name.split("_", 1)[1] for name in _names(tmp_path)] == [
        "c.jsonl",
        "c.wav",
        "d.jsonl",
        "d.wav",
    ]
    assert Recordings(None).open("e", _playbook(), failed) is None
    assert [wants_recording(v) for v in (None, "on", "OFF", " no ", "0", "false")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_the_timeline_fills_gaps_with_silence_and_keeps_channels_aligned() -> None:
    timeline = StereoTimeline()
    frame = np.full(320, 1000, np.int16).tobytes()
    timeline.place(0, 0, frame)
    timeline.place(0, 330, frame)  # 10 samples late: jitter, kept contiguous
    assert timeline.take() == b""  # the agent has not reached it yet
    timeline.place(1, 16_000, frame)  # agent audio 1 s in: silence before it
    # the quiet caller is taken as silent up to SLACK_S (0.5 s) behind: written as it goes
    first = timeline.take()
    assert len(first) == (16_320 - 8_000) * 4
    stereo = np.frombuffer(first + timeline.take(everything=True), np.int16).reshape(-1, 2)
    assert stereo.shape == (16_320, 2)
    assert (stereo[:640, 0] == 1000).all()
    assert (stereo[640:, 0] == 0).all()
    assert (stereo[:16_000, 1] == 0).all()
    assert (stereo[16_000:, 1] == 1000).all()


@pytest.fixture
def file_size_limit() -> Iterator[Any]:
    """``limit(n)`` caps the size of files this process writes at ``n`` bytes, as a full disk
    would (EFBIG instead of SIGXFSZ); lifted when the test ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(size: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


async def test_a_disk_that_fills_mid_call_ends_the_recording_once(
    tmp_path: Path, file_size_limit: Any
) -> None:
    failures, failed = _failures()
    recorder = CallRecorder(tmp_path / "c.wav", tmp_path / "c.jsonl", {}, failed)
    frame = np.full(320, 1000, np.int16).tobytes()
    file_size_limit(100_000)
    async with asyncio.timeout(20):
        while not recorder.done:  # about 1.6 s of stereo fills 100 kB
            for _ in range(10):
                recorder.caller(frame)
                recorder.agent(frame, RECORDING_RATE)
            await asyncio.sleep(0.005)
        await recorder.wait()
        await asyncio.sleep(0)  # the failure is reported on the loop
    file_size_limit(resource.RLIM_INFINITY)
    assert failures == [("write", "the recording could not be written")]
    assert recorder.failed == "write"
    assert 0 < (tmp_path / "c.wav").stat().st_size <= 100_000
    recorder.caller(frame)  # taken and dropped: the call goes on unrecorded
    recorder.close()


async def test_a_writer_that_falls_behind_stops_with_an_error_instead_of_growing(
    tmp_path: Path,
) -> None:
    """A burst handed over without yielding to the writer fills a backlog of 3 at once (the
    event loop's thread keeps the interpreter for its whole switch interval)."""
    failures, failed = _failures()
    recorder = CallRecorder(tmp_path / "c.wav", tmp_path / "c.jsonl", {}, failed, max_backlog=3)
    frame = bytes(640)
    for _ in range(10_000):
        recorder.caller(frame)
    assert failures == [("behind", "the recorder fell behind the call")]
    async with asyncio.timeout(10):
        await recorder.wait()
    with wave.open(str(tmp_path / "c.wav"), "rb") as wav:  # what was written is a valid WAV
        assert wav.getnchannels() == 2
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["type"] == "recording_ended"


def _touch(path: Path, age_days: float) -> None:
    path.write_bytes(b"x")
    then = time.time() - age_days * 86400
    os.utime(path, (then, then))


async def test_retention_deletes_old_recordings_at_start_up_and_only_recordings(
    tmp_path: Path,
) -> None:
    old = [tmp_path / "20200101T000000Z_w0.abc.wav", tmp_path / "20200101T000000Z_w0.abc.jsonl"]
    young = tmp_path / "20990101T000000Z_def.wav"
    other = tmp_path / "notes.txt"
    for path in old:
        _touch(path, 40)
    _touch(young, 1)
    _touch(other, 400)
    recordings = Recordings(RecordingSettings(tmp_path, retention_days=30, sweep_period_s=0.05))
    async with recordings.running():
        assert _names(tmp_path) == [young.name, other.name]  # swept before the first call
        _touch(old[0], 31)
        async with asyncio.timeout(10):
            while old[0].exists():  # noqa: ASYNC110 - swept again while the server runs
                await asyncio.sleep(0.02)
    assert _names(tmp_path) == [young.name, other.name]
    assert Recordings(RecordingSettings(tmp_path)).sweep() == 0  # 0 days: kept forever
