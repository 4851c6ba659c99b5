"""SIP calls from baresip, a real SIP phone, into the native SIP endpoint
(``server/transports/sip.py``).

baresip dials over UDP on 127.0.0.1, speaks a WAV file as the caller (``aufile``; it hangs up
when the file ends) and records what it sends and what it hears (``sndfile``); its configuration
is ``tests/sip/baresip``. Real Whisper, Piper and webrtcvad on the server; the LLM is scripted.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import wave
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from media import Resampler
from media.audio import SAMPLE_RATE, pcm_rms_dbfs, silence
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, SIP
from server.transports.sip import SipCall
from tests.calls import transcriber, voice_server, word_error_rate, words
from tests.phone import ANSWER, INTERRUPTION, LONG_ANSWER, PARCEL, phone_audio
from tests.processes import spawn, stop_group
from tests.scripted_llm import ScriptedLLM, answers_by_words

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parent / "sip" / "baresip"
RATE = 8000
FRAME_BYTES = RATE * 20 // 1000 * 2
LOUD_DBFS = -45.0
GREETING_MS = 4500  # the support playbook's greeting plays while the caller is silent

QUESTION = "Where is my order?"


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    for text in (QUESTION, PARCEL, INTERRUPTION):
        phone_audio(text)


@pytest.fixture
async def server(llm: ScriptedLLM) -> AsyncIterator[TestServer]:
    config = ServerConfig(sip=SipSettings(host="127.0.0.1", port=0))
    async with voice_server(llm.base_url, config) as server:
        yield server


_replies = answers_by_words({"parcel": LONG_ANSWER}, ANSWER)
"""A question about a parcel gets the long answer; anything else the short one."""


def _wer(heard: str, expected: str) -> float:
    """Word error rate with Whisper's contractions spelled out ("Where's" -> "Where is")."""
    heard = f"{heard} "
    for short, full in (("'s ", " is "), ("'ll ", " will "), ("'re ", " are ")):
        heard = heard.replace(short, full)
    return word_error_rate(heard, expected)


@dataclass
class Recording:
    """A call as baresip recorded it: what it sent (its encoder's input) and what it heard (its
    decoder's output), 8 kHz PCM16 each starting as the call's audio starts, so that offsets in
    seconds line up within a few frames (baresip's jitter buffer delays what it hears)."""

    sent: bytes
    heard: bytes
    call: SipCall

    def sent_speech(self) -> list[tuple[float, float]]:
        """The caller's utterances as (start, end) seconds; pauses under 0.5 s join words."""
        spans: list[tuple[float, float]] = []
        for at in _loud(self.sent):
            if spans and at - spans[-1][1] < 0.5:
                spans[-1] = (spans[-1][0], at + 0.02)
            else:
                spans.append((at, at + 0.02))
        return spans

    def heard_loud(self, start: float, end: float) -> list[float]:
        """Start times of the loud 20 ms frames baresip heard in [start, end) seconds."""
        return [at for at in _loud(self.heard) if start <= at < end]

    async def heard_said(self, start: float) -> str:
        """Whisper's transcript of what baresip heard from ``start`` seconds on."""
        resampler = Resampler(RATE, SAMPLE_RATE)
        offset = int(start * RATE) * 2
        pcm16k = resampler.resample(self.heard[offset:]) + resampler.flush()
        return (await transcriber().transcribe(pcm16k)).text


def _loud(pcm: bytes) -> list[float]:
    return [
        round(i / FRAME_BYTES * 0.02, 2)
        for i in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)
        if pcm_rms_dbfs(pcm[i : i + FRAME_BYTES]) > LOUD_DBFS
    ]


def _baresip() -> str:
    path = shutil.which("baresip")
    if path is None:
        pytest.fail(
            "baresip is required for the SIP interop tests: apt-get install baresip-core",
            pytrace=False,
        )
    return path


def _free_port() -> int:
    """A port free for UDP and TCP on 127.0.0.1 (baresip listens on both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise OSError("no free port for baresip")


def _write_wav(path: Path, pcm: bytes) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(pcm)


def _read_wav(folder: Path, pattern: str) -> bytes:
    (path,) = folder.glob(pattern)
    with wave.open(str(path), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, RATE)
        return wav.readframes(wav.getnframes())


def _configure(workdir: Path, speech: bytes) -> tuple[Path, Path]:
    """Write baresip's configuration and the caller's WAV under ``workdir``; returns the
    configuration folder and the folder sndfile records into."""
    config, recordings, wav = workdir / "baresip", workdir / "recordings", workdir / "caller.wav"
    config.mkdir()
    recordings.mkdir()
    _write_wav(wav, speech)
    template = (TEMPLATES / "config").read_text()
    (config / "config").write_text(
        template.format(sip_port=_free_port(), speech=wav, recordings=recordings)
    )
    shutil.copy(TEMPLATES / "accounts", config / "accounts")
    return config, recordings


def _log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-30:])


async def _wait(condition: Callable[[], bool], timeout_s: float, what: str, log: Path) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():  # noqa: ASYNC110 - baresip and the server both move it
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"{what} within {timeout_s} s; baresip's log ends:\n{_log_tail(log)}")


async def call_from_baresip(
    server: TestServer, speech: bytes, workdir: Path, user: str = "support"
) -> Recording:
    """baresip dials ``sip:USER@`` the server, says ``speech`` (8 kHz PCM16) and hangs up at its
    end; returns what it recorded. baresip is always stopped (killed if it must be)."""
    baresip = _baresip()
    sip = server.app[SIP]
    config, recordings = _configure(workdir, speech)
    seconds = len(speech) / 2 / RATE
    log = workdir / "baresip.log"
    with log.open("wb") as output:
        process = await spawn(
            baresip,
            *("-f", str(config), "-e", f"/dial sip:{user}@127.0.0.1:{sip.port}"),
            *("-t", str(round(seconds + 30))),  # quits by itself even if this test dies
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        await _wait(
            lambda: bool(sip.calls) or process.returncode is not None,
            10,
            "baresip's call was not answered",
            log,
        )
        if not sip.calls:
            pytest.fail(f"baresip exited ({process.returncode}):\n{_log_tail(log)}")
        (call,) = sip.calls.values()
        await _wait(call.ended.is_set, seconds + 10, "baresip did not hang up", log)
        process.terminate()
        await asyncio.wait_for(process.wait(), 5)
    finally:
        await stop_group(process)
    return Recording(
        _read_wav(recordings, "dump-*-enc.wav"), _read_wav(recordings, "dump-*-dec.wav"), call
    )


async def test_baresip_hears_the_scripted_answer(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(_replies)
    speech = silence(GREETING_MS, RATE) + phone_audio(QUESTION) + silence(6000, RATE)
    recording = await call_from_baresip(server, speech, tmp_path)

    (asked_text,) = llm.user_turns
    assert _wer(asked_text, QUESTION) <= 0.25, asked_text
    assert "Acme's online shop" in llm.requests[-1]["messages"][0]["content"]  # sip:support@
    ((asked, _), *_) = recording.sent_speech()
    assert recording.heard_loud(0, asked), "baresip heard no greeting"
    said = await recording.heard_said(asked)
    assert _wer(said, ANSWER) <= 0.25, said
    assert recording.call.encoding == "ulaw"  # baresip offers PCMU first
    assert recording.call.session.barge_ins == 0
    assert len(server.app[CALLS]) == 0


async def test_barge_in_from_baresip_stops_the_agent_audio(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(_replies)
    speech = (
        silence(GREETING_MS, RATE)
        + phone_audio(PARCEL)
        + silence(5000, RATE)  # the long answer is playing
        + phone_audio(INTERRUPTION)
        + silence(2500, RATE)
    )
    recording = await call_from_baresip(server, speech, tmp_path)

    pause = GREETING_MS / 1000 + len(phone_audio(PARCEL)) / 2 / RATE + 2.5  # mid-answer
    interruption = [span for span in recording.sent_speech() if span[0] > pause]
    assert interruption, "baresip did not send the interruption"
    talk_start, talk_end = interruption[0][0], interruption[-1][1]
    assert len(recording.heard_loud(talk_start - 1.0, talk_start)) >= 20, "agent was not talking"
    # the agent stops within ~0.5 s of the caller talking over it (200 ms of voiced speech, then
    # the next 20 ms packet is silence) and stays quiet while the caller talks; 0.1 s of slop for
    # baresip's jitter buffer and the two recordings' start times
    cut = recording.heard_loud(talk_start, talk_end)
    stopped = cut[-1] + 0.02 if cut else talk_start
    assert stopped - talk_start <= 0.6, f"talked over at {talk_start:.2f}, heard to {stopped:.2f}"
    assert recording.call.session.barge_ins == 1
    turns = llm.user_turns
    assert len(turns) == 2, turns
    assert {"stop", "enough"} <= set(words(turns[1])), turns
    assert len(server.app[CALLS]) == 0
