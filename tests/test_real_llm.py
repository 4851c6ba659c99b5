"""A real model in the loop: llama.cpp (in process) with SmolLM2-135M-Instruct.

The model loads once for this module. Its answers are weak (135M parameters) and not
deterministic, so the tests assert what does not depend on their wording: what the caller
hears is English words the model wrote, never markup; a tool call forced by the stage runs and
its result goes back; a barge-in stops the generation in llama.cpp itself; a busy server or an
overflowing history still gets the caller a spoken sentence, and the call goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from media.audio import silence
from playbooks import OrchestratorOptions, PlaybookOrchestrator, load_playbook
from playbooks.llm import ChatClient
from server.call.session import SessionSettings
from server.llm.gguf import read_gguf
from server.llm.llamacpp import EmbeddedLLM, EmbeddedSettings, ModelThreads, model_cpu_time
from server.testkit.browser import microphone_file
from server.testkit.caller import WebRTCCaller
from tests.conftest import REPO
from tests.support.browser import Browser
from tests.support.calls import (
    base_url,
    piper_speech,
    start_call,
    synthesize_ahead,
    transcriber,
    voice_server,
    words,
)
from tests.support.models import smollm2_gguf

pytestmark = pytest.mark.slow

PLAYBOOKS = REPO / "tests" / "playbooks" / "real_model"
MARKUP = re.compile(r"[{}<>`\[\]]|\"name\"|tool_call")

QUESTION = "Hello, how are you today?"
STORY = "Please tell me a long story about a dragon."
BARGE_IN = "Stop, stop, I have a question."
AGAIN = "What is your name?"


@pytest.fixture(scope="module", autouse=True)
def _caller_speech_ready() -> None:
    synthesize_ahead(QUESTION, STORY, BARGE_IN, AGAIN)


@pytest.fixture(scope="module")
def model() -> Iterator[EmbeddedLLM]:
    """SmolLM2 served by llama.cpp in this process: 2 slots of 2048 tokens."""
    embedded = EmbeddedLLM.start(
        read_gguf(smollm2_gguf()), EmbeddedSettings(slots=2, context_per_slot=2048)
    )
    yield embedded
    asyncio.run(embedded.aclose())


@pytest.fixture
async def client(model: EmbeddedLLM) -> AsyncIterator[ChatClient]:
    """A client as the server makes one for its embedded model."""
    llm = ChatClient.connect(
        model.base_url, model.api_key, model.model, constrain_forced_calls=True, prefills=True
    )
    yield llm
    await llm.aclose()


async def slots(model: EmbeddedLLM) -> list[dict[str, Any]]:
    """llama.cpp's own view of its slots (``is_processing`` while it generates)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{model.origin}/slots", headers={"Authorization": f"Bearer {model.api_key}"}
        ) as response,
    ):
        answer: list[dict[str, Any]] = await response.json()
        return answer


async def wait_slots_idle(model: EmbeddedLLM, timeout_s: float) -> float:
    """Seconds until no slot is processing; fails after ``timeout_s``."""
    started = time.monotonic()
    await poll_slots(model, lambda busy: busy == 0, timeout_s)
    return time.monotonic() - started


async def poll_slots(model: EmbeddedLLM, until: Callable[[int], bool], timeout_s: float) -> None:
    """Ask llama.cpp every 50 ms until ``until(slots generating)``; fails after ``timeout_s``
    (llama.cpp tells no one when a slot starts or stops: polling is all there is)."""
    async with asyncio.timeout(timeout_s):
        while not until(sum(slot["is_processing"] for slot in await slots(model))):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_a_webrtc_caller_hears_english_the_model_wrote(model: EmbeddedLLM) -> None:
    async with voice_server(
        model.base_url, playbooks=PLAYBOOKS / "chat.yaml", llm_api_key=model.api_key
    ) as server:
        caller = WebRTCCaller()
        try:
            await caller.connect(base_url(server), playbook="chat")
            caller.say(piper_speech(QUESTION))
            await caller.wait_for("tts_end", timeout_s=60)
            await asyncio.sleep(0.3)  # the last frames in flight
            answer = " ".join(e["text"] for e in caller.of_type("agent_sentence"))
            heard = (await transcriber().transcribe(bytes(caller.heard))).text
        finally:
            await caller.close()
    (transcript,) = caller.of_type("transcript")
    assert {"how", "are", "you"} <= set(words(transcript["text"]))
    assert answer.strip(), "the model said nothing"
    assert not MARKUP.search(answer), answer
    said = words(heard)
    assert len(said) >= 2, heard
    # what the caller heard is what the model wrote (tiny.en mishears some words of it)
    assert len(set(said) & set(words(answer))) >= len(set(said)) // 2, (heard, answer)
    assert caller.of_type("turn_metrics")[0]["voice_to_voice_ms"] > 0


@pytest.mark.timeout(120)
async def test_chromium_plays_an_answer_the_model_wrote(model: EmbeddedLLM, tmp_path: Path) -> None:
    """The web client, in a real browser, shows and plays what the model answered."""
    pcm = silence(1500) + piper_speech(QUESTION) + silence(20000)  # (Chromium loops the file)
    microphone = microphone_file(tmp_path / "mic.wav", pcm)
    async with (
        voice_server(
            model.base_url, playbooks=PLAYBOOKS / "chat.yaml", llm_api_key=model.api_key
        ) as server,
        Browser(tmp_path / "profile", microphone) as browser,
    ):
        await browser.goto(f"{base_url(server)}/?raw=1&playbook=chat")
        await browser.evaluate("document.getElementById('call').click()")
        await browser.wait_until("call && call.pc.connectionState === 'connected'", 20)
        agent = await browser.wait_until(
            "[...document.querySelectorAll('.line.agent .text')].map(e => e.textContent)"
            ".find(t => t.trim().length > 0)",
            60,
        )
        assert not MARKUP.search(agent), agent
        energy = 0.0
        async with asyncio.timeout(20):  # (wait_until takes a promise for a truthy value)
            while not energy:
                energy = await browser.evaluate(
                    "(async () => { let e = 0; (await call.pc.getStats()).forEach((r) => {"
                    " if (r.type === 'inbound-rtp' && r.kind === 'audio')"
                    " e = r.totalAudioEnergy || 0; }); return e; })()"
                )
                await asyncio.sleep(0.1)
        assert energy > 0  # the answer's audio played, not just silence frames
        assert await browser.evaluate("document.getElementById('banner').hidden") is True


@pytest.mark.timeout(60)
async def test_a_forced_tool_call_runs_and_its_result_goes_back(client: ChatClient) -> None:
    playbook = load_playbook(PLAYBOOKS / "weather.yaml")
    orchestrator = PlaybookOrchestrator(playbook, client)
    events: list[tuple[str, dict[str, Any]]] = []
    orchestrator.on(lambda event: events.append((event.type, event.data)))
    spoken: list[str] = []
    async with orchestrator.turn("What's the weather like in Paris today?") as turn:
        async for delta in turn:
            spoken.append(str(delta))
    starts = [data["call"] for kind, data in events if kind == "tool_call_start"]
    assert starts, events
    assert starts[0]["name"] == "get_weather"
    assert isinstance(json.loads(starts[0]["arguments"]).get("city"), str)
    assert [kind for kind, _ in events].count("tool_call_complete") >= 1
    # the result went back to the model as a tool message answering the call, in order
    messages = orchestrator.conversation.messages
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in messages if m["role"] == "tool"]
    assert calls
    assert results
    assert results[0]["tool_call_id"] == calls[0]["tool_calls"][0]["id"]
    assert "sunny and 21 degrees" in results[0]["content"]
    answer = "".join(spoken)
    assert answer.strip()
    assert answer == turn.answer
    assert not MARKUP.search(answer), answer  # the call the model wrote as JSON is not spoken


@pytest.mark.timeout(120)
async def _prompt_tokens_read(model: EmbeddedLLM) -> int:
    """Prompt tokens llama.cpp has read (not found in its cache) so far."""
    for line in (await model.metrics_text()).splitlines():
        if line.startswith("llamacpp:prompt_tokens_total "):
            return int(float(line.split()[1]))
    raise AssertionError("llama.cpp's metrics have no llamacpp:prompt_tokens_total")


async def test_words_read_ahead_while_the_caller_speaks_are_cached_when_the_turn_ends(
    model: EmbeddedLLM, client: ChatClient
) -> None:
    orchestrator = PlaybookOrchestrator(load_playbook(PLAYBOOKS / "chat.yaml"), client)
    so_far = "I would like to hear about the old lighthouse on the northern cliffs, the one near"
    before = await _prompt_tokens_read(model)
    assert await orchestrator.read_ahead(so_far)  # a pause the caller went on after
    read_ahead = await _prompt_tokens_read(model) - before
    async with orchestrator.turn(so_far + " the harbour?") as turn:
        async for _ in turn:
            pass
    read_at_the_end = await _prompt_tokens_read(model) - before - read_ahead
    assert read_ahead >= 15  # the words so far (and any of the prompt not cached before)
    # the turn read its last words and the template's close, not the words read ahead
    assert read_at_the_end <= 12, (read_ahead, read_at_the_end)
    assert turn.answer.strip()


async def test_a_barge_in_stops_llama_cpp_generating_and_the_next_turn_is_answered(
    model: EmbeddedLLM,
) -> None:
    call = start_call(
        load_playbook(PLAYBOOKS / "story.yaml"),
        model.base_url,
        api_key=model.api_key,
        settings=SessionSettings(greet=False),
    )
    try:
        await call.say(piper_speech(STORY), trailing_silence_ms=1000)
        await call.wait_event("agent_sentence", timeout_s=40)
        story = {slot["id_task"] for slot in await slots(model) if slot["is_processing"]}
        assert story, "the model is not generating the story any more"
        await call.say(piper_speech(BARGE_IN), trailing_silence_ms=1000)
        await call.wait_event("interrupted", timeout_s=15)
        sentences = len(call.of_type("agent_sentence"))
        # the closed stream ends the generation in llama.cpp, not only at the caller (the
        # barge-in's own turn may have started a new task meanwhile)
        async with asyncio.timeout(3):
            while story & {s["id_task"] for s in await slots(model) if s["is_processing"]}:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # the words spoken over the agent are a turn of their own, and answered
        await call.wait_event("agent_sentence", count=sentences + 1, timeout_s=60)
        later = call.of_type("agent_sentence")[sentences:]
        assert any(e.data["text"].strip() for e in later)
        assert not any(MARKUP.search(e.data["text"]) for e in later)
    finally:
        await call.line.stop()


@pytest.mark.timeout(120)
async def test_a_busy_server_gets_the_caller_a_sentence_and_the_call_goes_on(
    model: EmbeddedLLM, client: ChatClient
) -> None:
    """Both slots are taken by long generations: the turn's request waits in llama.cpp's
    queue until the turn gives up and speaks its fallback line; once a slot is free, the next
    turn is answered by the model."""
    # a short fallback line: the call waits for it to be heard out before the caller speaks
    options = OrchestratorOptions(llm_timeout_ms=1500, fallback_answer="Sorry, one moment.")
    call = start_call(
        load_playbook(PLAYBOOKS / "chat.yaml"),
        model.base_url,
        api_key=model.api_key,
        options=options,
    )
    hogs = [asyncio.create_task(_generate_at_length(model, 6000)) for _ in range(2)]
    try:
        await poll_slots(model, lambda busy: busy == 2, timeout_s=10)
        await call.say(piper_speech(QUESTION), trailing_silence_ms=1000)
        first = await call.wait_event("agent_sentence", timeout_s=30)
        assert first.data["text"] == options.fallback_answer
        for hog in hogs:
            hog.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        await wait_slots_idle(model, timeout_s=5)
        await call.wait_idle(timeout_s=30)
        await call.say(piper_speech(AGAIN), trailing_silence_ms=1000)
        answer = await call.wait_event("agent_sentence", count=2, timeout_s=60)
        assert answer.data["text"] != options.fallback_answer
        assert answer.data["text"].strip()
    finally:
        for hog in hogs:
            hog.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        await call.line.stop()


async def _generate_at_length(model: EmbeddedLLM, tokens: int) -> None:
    """A streamed request that keeps a slot generating (its end of text ignored)."""
    body = {
        "messages": [{"role": "user", "content": "Count from one to ten thousand."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {model.api_key}"}
    timeout = aiohttp.ClientTimeout(total=None)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(f"{model.base_url}/chat/completions", json=body, headers=headers) as response,
    ):
        async for _ in response.content:
            pass


@pytest.mark.timeout(60)
async def test_a_history_beyond_the_context_is_shed_and_the_turn_answered(
    client: ChatClient,
) -> None:
    # reading what is left of the history takes seconds, more on a busy machine: not timed here
    options = OrchestratorOptions(history_limit=200, llm_timeout_ms=60_000)
    orchestrator = PlaybookOrchestrator(load_playbook(PLAYBOOKS / "chat.yaml"), client, options)
    events: list[tuple[str, dict[str, Any]]] = []
    orchestrator.on(lambda event: events.append((event.type, event.data)))
    # ~3,500 tokens, beyond the slot's 2,048: two long early exchanges, then short ones. The
    # history is shed from the oldest to ~0.7 of what fits (~1,400 tokens), which here drops
    # both long exchanges and leaves ~300 tokens to read, not ~1,400 (seconds on this model)
    filler = "We talked about the weather, the trains and the price of bread in the city. " * 90
    for n in range(2):
        orchestrator.conversation.append({"role": "user", "content": f"{n}. {filler}"})
        orchestrator.conversation.append({"role": "assistant", "content": "I see."})
    for n in range(2, 14):
        orchestrator.conversation.append({"role": "user", "content": f"{n}. And the trains."})
        orchestrator.conversation.append({"role": "assistant", "content": "I see."})
    before = len(orchestrator.conversation)
    answer = await orchestrator.respond(AGAIN)
    trimmed = [data for kind, data in events if kind == "history_trimmed"]
    assert trimmed, events
    assert "context" in trimmed[0]["reason"]
    errors = [data for kind, data in events if kind == "error"]
    assert not errors, errors  # the request sent again fitted
    assert answer.strip()
    assert len(orchestrator.conversation) < before
    # the history stays shed: the next turn fits at once
    events.clear()
    assert (await orchestrator.respond(QUESTION)).strip()
    assert not [kind for kind, _ in events if kind in ("history_trimmed", "error")]


def _niced_threads(niceness: int) -> set[int]:
    """This process's threads ``niceness`` nicer than it, now (a thread that ends meanwhile is
    left out)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    found = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            if os.getpriority(os.PRIO_PROCESS, int(task)) == own + niceness:
                found.add(int(task))
    return found


def test_the_model_threads_run_below_speech_work(model: EmbeddedLLM) -> None:
    """llama.cpp's threads (HTTP, inference, OpenMP's pool) inherited the loader's niceness."""
    nicer = _niced_threads(model.settings.niceness)
    assert len(nicer) >= 3, nicer
    assert os.environ.get("OMP_WAIT_POLICY") is None  # set only while llama.cpp loaded
    # and by that niceness admission tells the model's CPU from the calls' (the model loaded
    # and warmed up here): some, and less than the whole process's
    used = model_cpu_time()
    assert used is not None
    assert 0 < used < time.process_time()
    # the gauge's reader finds the same threads, then reads only theirs
    cached = ModelThreads()
    assert cached() == pytest.approx(used, abs=0.2)
    after = _niced_threads(model.settings.niceness)
    found = {int(task.name) for task in cached._threads}
    # every such thread alive throughout, and nothing else (another module's pool thread, as
    # niced, may end or start meanwhile: CI once counted 9 of 10)
    assert nicer & after <= found <= nicer | after
