"""SIP calls from baresip, a real SIP phone, into the native SIP endpoint
(``server/transports/sip/``).

baresip dials over UDP on 127.0.0.1, speaks a WAV file as the caller (``aufile``; it hangs up
when the file ends) and records what it sends and what it hears (``sndfile``); it is started by
``tests/support/baresip.py``. Real Whisper, Piper and webrtcvad on the server; the LLM is scripted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from media import Resampler
from media.audio import SAMPLE_RATE, silence
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, SIP
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from server.transports.sip.call import SipCall
from tests.support.baresip import RATE, loud_frames, start_baresip, until, utterances
from tests.support.calls import events_of, transcriber, voice_server, word_error_rate, words
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

GREETING_MS = 4500  # the support playbook's greeting plays while the caller is silent


@pytest.fixture(scope="module", autouse=True)
def _speech_ready() -> None:
    prepare_phone_speech()


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
        return utterances(self.sent, gap_s=0.5)

    def heard_loud(self, start: float, end: float) -> list[float]:
        """Start times of the loud 20 ms frames baresip heard in [start, end) seconds."""
        return [at for at in loud_frames(self.heard) if start <= at < end]

    async def heard_said(self, start: float) -> str:
        """Whisper's transcript of what baresip heard from ``start`` seconds on."""
        resampler = Resampler(RATE, SAMPLE_RATE)
        offset = int(start * RATE) * 2
        pcm16k = resampler.resample(self.heard[offset:]) + resampler.flush()
        return (await transcriber().transcribe(pcm16k)).text


async def call_from_baresip(
    server: TestServer,
    speech: bytes,
    workdir: Path,
    user: str = "support",
    *,
    wideband: bool = False,
    opus: bool = False,
    hang_up_when: Callable[[SipCall], bool],
    heard_on_s: float = 0.8,
) -> Recording:
    """baresip dials ``sip:USER@`` the server (offering G.722 too when ``wideband``, G.722 and
    Opus when ``opus``), says ``speech`` (8 kHz PCM16) and hangs up once ``hang_up_when(call)``
    holds and it has heard ``heard_on_s`` more of the call (or at the end of ``speech``, which
    fails the test); returns what it recorded. baresip is always stopped (killed if it must
    be). 0.3 s brings what the server had sent out of baresip's jitter buffer (100-200 ms
    deep) into its recording; the default adds half a second of the agent's silence (Whisper
    misreads a recording's last word with no pause after it: "Callin" for "calling")."""
    sip = server.app[SIP]
    phone = await start_baresip(
        workdir / "caller",
        speech,
        dial=f"sip:{user}@127.0.0.1:{sip.port}",
        wideband=wideband,
        opus=opus,
    )
    seconds = len(speech) / 2 / RATE
    try:
        await until(
            lambda: bool(sip.calls) or phone.process.returncode is not None,
            10,
            "baresip's call was not answered",
            phone,
        )
        if not sip.calls:
            pytest.fail(f"baresip exited ({phone.process.returncode}):\n{phone.log_tail()}")
        (call,) = sip.calls.values()
        await until(  # (ended before: its checks fail)
            lambda: hang_up_when(call) or call.ended.is_set(), seconds, "no hang-up", phone
        )
        await phone.hears_more(heard_on_s)
        phone.process.terminate()  # it hangs up (a BYE) and quits, its recordings complete
        await until(call.ended.is_set, 10, "baresip did not hang up", phone)
        await asyncio.wait_for(phone.process.wait(), 5)
    finally:
        await phone.stop()
    return Recording(phone.sent(), phone.heard(), call)


async def test_baresip_on_opus_hears_the_scripted_answer(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path
) -> None:
    """A wideband phone (PCMU, PCMA, G.722 and Opus offered, in that order) is answered on Opus,
    understood and heard (G.722 both ways: test_outbound_calls)."""
    llm.script(_replies)
    # baresip hangs up once it has heard the answer, ~4.5 s after the question; the silence
    # after it is an upper bound
    speech = silence(GREETING_MS, RATE) + phone_audio(QUESTION) + silence(12000, RATE)
    recording = await call_from_baresip(
        server,
        speech,
        tmp_path,
        opus=True,
        hang_up_when=lambda call: events_of(call, "tts_end") >= 2,
    )

    (asked_text,) = llm.user_turns
    assert _wer(asked_text, QUESTION) <= 0.25, asked_text
    assert "Acme's online shop" in llm.requests[-1]["messages"][0]["content"]  # sip:support@
    ((asked, _), *_) = recording.sent_speech()
    assert recording.heard_loud(0, asked), "baresip heard no greeting"
    said = await recording.heard_said(asked)
    assert _wer(said, ANSWER) <= 0.25, said
    assert recording.call.encoding == "opus"  # preferred, though baresip offers PCMU first
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
        + silence(12000, RATE)  # an upper bound: it hangs up once the agent answers it
    )
    recording = await call_from_baresip(  # the greeting, the long answer, the answer to "Stop"
        server,
        speech,
        tmp_path,
        hang_up_when=lambda call: events_of(call, "tts_start") >= 3,
        heard_on_s=0.3,  # (nothing transcribed from its end)
    )

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
