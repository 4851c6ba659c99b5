"""The web client in real headless Chromium with a fake microphone, against the real server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from media.audio import silence
from server.testkit.browser import microphone_file
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.support.browser import Browser
from tests.support.calls import piper_speech, voice_server

pytestmark = pytest.mark.slow

ANSWER = "Your order is on its way. It will arrive on Tuesday."
STATS = """(async () => {
    const stats = await call.pc.getStats();
    let bytes = 0, energy = 0;
    stats.forEach((report) => {
        if (report.type === "inbound-rtp" && report.kind === "audio") {
            bytes = report.bytesReceived;
            energy = report.totalAudioEnergy || 0;
        }
    });
    return {bytes, energy};
})()"""


@pytest.fixture
async def server(llm: ScriptedLLM) -> AsyncIterator[TestServer]:
    async with voice_server(llm.base_url) as server:
        yield server


def _microphone(path: Path) -> Path:
    """Greeting-length silence, the question, then a long pause (Chromium loops the file)."""
    pcm = silence(6000) + piper_speech("Hello, I am calling about my order.") + silence(20000)
    return microphone_file(path, pcm)


async def test_a_browser_call_shows_both_sides_and_plays_the_agent(
    server: TestServer, llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(answers_by_words({"order": ANSWER}, "Go on."))
    base = str(server.make_url("")).rstrip("/")
    async with Browser(tmp_path / "profile", _microphone(tmp_path / "mic.wav")) as browser:
        try:
            await browser.goto(f"{base}/?raw=1&playbook=support")
            assert await browser.evaluate("document.getElementById('call').textContent") == "Call"
            await browser.evaluate("document.getElementById('call').click()")
            await browser.wait_until("call && call.pc.connectionState === 'connected'", 20)
            first = await browser.evaluate(STATS)

            user_line = await browser.wait_until(
                "[...document.querySelectorAll('.line.user .text')].map(e => e.textContent)"
                ".find(t => /order/i.test(t))",
                40,
            )
            assert "calling" in user_line.lower()
            agent_text = await browser.wait_until(
                "[...document.querySelectorAll('.line.agent .text')].map(e => e.textContent)"
                ".find(t => t.includes('Tuesday'))",
                30,
            )
            assert agent_text == ANSWER
            stage = await browser.evaluate("document.getElementById('stage').textContent")
            assert stage == "Stage: Identify the order"
            metrics = await browser.wait_until(
                "document.querySelector('#metrics tbody').rows.length", 10
            )
            assert metrics == 8
            # the page's own voice to voice, for the turn the server timed
            turn = await browser.wait_until(
                "window.vocable.turns.find(t => t.server && t.server.voice_to_voice_ms)", 10
            )
            # it hears what the server cannot: the question's way to the server (capture, a
            # 20 ms packet) and the answer's way to the ear (the jitter buffer, decoding: 40-200
            # ms); its end of speech is a level, not webrtcvad's frames (a window either way)
            gap_ms = turn["graph_ms"] - turn["server"]["voice_to_voice_ms"]
            assert -60 <= gap_ms <= 350, turn
            assert turn["heard_ms"] == turn["graph_ms"] + turn["output_latency_ms"]
            shown = await browser.evaluate("document.getElementById('heard-ms').textContent")
            assert shown == f"{int(turn['heard_ms'] + 0.5)} ms"  # Math.round

            later = await browser.wait_until(f"{STATS}.then(s => s.energy > 0 && s)", 10)
            assert later["bytes"] > first["bytes"]
            # the audio that arrived carried sound, not just silence frames
            assert later["energy"] > 0
            banner_hidden = await browser.evaluate("document.getElementById('banner').hidden")
            assert banner_hidden is True

            await browser.evaluate("document.getElementById('call').click()")
            status = await browser.wait_until(
                "document.getElementById('status').textContent.startsWith('Call ended') && 'ok'", 5
            )
            assert status == "ok"
        except BaseException:
            await browser.screenshot(tmp_path / "failure.png")
            raise
