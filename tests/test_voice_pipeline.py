"""End-to-end voice turns with real webrtcvad, Whisper and Piper; only the LLM is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from media import Synthesizer, Transcriber
from media.audio import FRAME_MS, SAMPLE_RATE, frame_bytes, pcm_rms_dbfs, silence
from playbooks import load_playbook
from playbooks.loader import LoadedPlaybook
from server.call.session import SessionSettings
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES
from tests.support.calls import (
    VoiceCall,
    espeak_speech,
    loudest,
    piper_speech,
    start_call,
    synthesize_ahead,
    synthesizer,
    transcriber,
    word_error_rate,
    words,
)
from tests.support.timed_stt import DECODE_TIMES, primed

pytestmark = pytest.mark.slow


CALLER_PHRASES = (
    "Check my account please.",
    "Hello again.",
    "Hello there.",
    "Hello, I am calling about my order.",
    "Is anybody there?",
    "Stop, stop, that is enough.",
    "Tell me about my order.",
    "What happened to order A1003?",
    "Where is my order?",
    "Where is my parcel?",
    "Yes, yes.",
)


@pytest.fixture(scope="module", autouse=True)
def _caller_speech_ready() -> None:
    synthesize_ahead(*CALLER_PHRASES)


@pytest.fixture(scope="module")
def support() -> LoadedPlaybook:
    return load_playbook(EXAMPLES / "support.yaml")


@pytest.fixture
async def call_factory(llm: ScriptedLLM, support: LoadedPlaybook) -> AsyncIterator[list[VoiceCall]]:
    calls: list[VoiceCall] = []
    yield calls
    for call in calls:
        await call.line.stop()


def _call(
    calls: list[VoiceCall], playbook: LoadedPlaybook, base_url: str, **kwargs: object
) -> VoiceCall:
    call = start_call(playbook, base_url, **kwargs)  # type: ignore[arg-type]
    calls.append(call)
    return call


async def _agent_said(call: VoiceCall, since: int = 0) -> str:
    """What Whisper hears in the agent's audio."""
    return (await transcriber().transcribe(call.heard_since(since))).text


@DECODE_TIMES
async def test_a_spoken_question_gets_a_spoken_answer_with_turn_metrics(
    decode_s: float, llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    answer = "Your order is on its way. It will arrive on Tuesday."
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1001"})]),
            Reply(content=answer),
        ]
    )
    question = piper_speech("Hello, I am calling about my order.") + silence(200)
    stt = await primed(decode_s, question)
    call = _call(call_factory, support, llm.base_url, stt=stt)
    await call.say(question)
    await call.wait_idle()

    transcripts = call.of_type("transcript")
    assert len(transcripts) == 1
    assert {"hello", "calling", "about", "my", "order"} <= set(words(transcripts[0].data["text"]))
    # the whole utterance reached the LLM as one user message: the pause after "Hello," did
    # not start an answer, however soon its words were known
    assert len(llm.requests) == 2, llm.user_turns
    assert llm.requests[0]["messages"][-1]["role"] == "user"
    assert {"hello", "calling", "order"} <= set(words(llm.requests[0]["messages"][-1]["content"]))
    assert call.session.speculations["preempted_wasted"] == 0

    assert word_error_rate(await _agent_said(call), answer) <= 0.2
    assert [e.data["text"] for e in call.of_type("agent_sentence")] == [
        "Your order is on its way.",
        "It will arrive on Tuesday.",
    ]
    (metrics,) = call.of_type("turn_metrics")
    for name in (
        "end_of_speech_ms",
        "stt_ms",
        "llm_first_token_ms",
        "first_sentence_ms",
        "tts_first_audio_ms",
        "first_frame_out_ms",
        "voice_to_voice_ms",
    ):
        assert isinstance(metrics.data[name], float), name
        assert metrics.data[name] >= 0, name
    # the turn ends after 400 ms of silence once the words (decoded from the 160 ms pause) say
    # the sentence is complete, and after 900 ms while they are still unknown; the answer then
    # waits only for what is left of the decode
    if decode_s == 0:
        assert 380 <= metrics.data["end_of_speech_ms"] <= 460, metrics.data
        assert metrics.data["stt_ms"] < 50, metrics.data
    else:
        assert 880 <= metrics.data["end_of_speech_ms"] <= 960, metrics.data
        assert 160 <= metrics.data["stt_ms"] <= 320, metrics.data
    assert stt.misses == 0
    parts = sum(v for k, v in metrics.data.items() if k != "voice_to_voice_ms")
    assert metrics.data["voice_to_voice_ms"] == pytest.approx(parts, abs=1.0)
    print("turn_metrics:", metrics.to_dict())
    assert call.orchestrator.conversation.messages[-1] == {"role": "assistant", "content": answer}


async def test_a_second_voice_is_understood(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    llm.script([Reply(content="Of course.")])
    speech = espeak_speech("I would like to cancel my order please")  # before the call's clock
    call = _call(call_factory, support, llm.base_url)
    await call.say(speech, 200)
    await call.wait_idle()
    (transcript,) = call.of_type("transcript")
    assert {"cancel", "my", "order"} <= set(words(transcript.data["text"]))


async def test_the_first_sentence_plays_while_the_llm_is_still_streaming(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    long_tail = " ".join(["It will be delivered by our courier on Tuesday morning."] * 3)
    llm.script([Reply(content=f"Good news. {long_tail}", chunk_delay_s=0.12)])
    call = _call(call_factory, support, llm.base_url)
    await call.say(piper_speech("Where is my parcel?"), 200)
    first_sentence = await call.wait_event("agent_sentence")

    def finished() -> list[float]:
        return [t for t, e in call.llm_events if e.type == "phase2_complete"]

    # the stream's end is what is asserted: the call ends there, its last sentences unplayed
    await call.line.wait_until(lambda: bool(finished()), 60)
    (finished_at,) = finished()
    assert first_sentence.data["text"] == "Good news."
    # ~30 tokens at 120 ms: the stream runs for ~3.6 s after the first sentence is ready
    assert finished_at - first_sentence.t > 2.0


def _longest_silence_ms(pcm: bytes, rate: int = SAMPLE_RATE) -> float:
    """The longest run of silent 20 ms frames between the first and last audible ones."""
    size = frame_bytes(rate)
    levels = [pcm_rms_dbfs(pcm[i : i + size]) for i in range(0, len(pcm), size)]
    audible = [i for i, level in enumerate(levels) if level > -50]
    longest = run = 0
    for level in levels[audible[0] : audible[-1] + 1]:
        run = run + 1 if level <= -50 else 0
        longest = max(longest, run)
    return longest * FRAME_MS


async def test_a_first_phrase_plays_early_and_joins_the_rest_without_a_gap(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    answer = "It should arrive on Friday morning."
    llm.script([Reply(content=answer, chunk_delay_s=0.05)])
    call = _call(call_factory, support, llm.base_url)
    start = len(call.line.recording)
    call.session.submit_text("When does my parcel arrive?")
    await call.wait_idle(timeout_s=60)
    sentences = [event.data["text"] for event in call.of_type("agent_sentence")]
    assert sentences == ["It should arrive", "on Friday morning."]
    heard = call.heard_since(start)
    # Piper closes each piece with ~150 ms of silence and opens the next with ~50 ms: the join
    # keeps ~20 ms, no longer than the pauses between the words Piper says in one piece
    piper = synthesizer()
    alone = _longest_silence_ms(piper.synthesize_all(answer), piper.sample_rate)
    assert _longest_silence_ms(heard) <= max(60.0, alone)
    assert words(await _agent_said(call, start)) == words(answer)


class _NotingSynthesizer(Synthesizer):
    """The tests' Piper voice, noting how each synthesis was asked for: (text, urgent,
    slack_s)."""

    def __init__(self) -> None:
        shared = synthesizer()
        super().__init__(shared._voice, shared.settings)
        self.asked: list[tuple[str, bool, float]] = []

    async def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncGenerator[bytes, None]:
        self.asked.append((text, urgent, slack_s))
        async for piece in super().synthesize(text, urgent=urgent, slack_s=slack_s):
            yield piece


async def test_a_later_sentence_is_synthesized_by_when_its_audio_is_needed(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    """First words are urgent; a later sentence waits its turn with the audio queued before it
    as its slack, unless that audio has already played: then the caller waits in silence."""
    tts = _NotingSynthesizer()
    try:
        # a short second sentence: its synthesis is what is checked, not its playing
        answer = "Your order left our warehouse yesterday. It arrives Friday."
        llm.script([Reply(content=answer)])
        call = _call(call_factory, support, llm.base_url, tts=tts)
        call.session.submit_text("Where is my order?")
        await call.wait_idle(timeout_s=60)
        first, *later = tts.asked
        assert first[1] is True
        assert later
        assert all(not urgent and slack_s > 0.2 for _text, urgent, slack_s in later), tts.asked

        tts.asked.clear()
        late = "It should arrive on Friday."
        # the late sentence closes with its whitespace, 3 s after "Let me check that." (~1.2 s
        # of audio, played out by ~1.7 s on a slow CPU), not at the stream's end 3 s later
        llm.script([Reply(content=["Let me check that. ", late + " "], chunk_delay_s=3.0)])
        call.session.submit_text("And my other order?")
        # until the late sentence is asked for (not until it has played, and the stream has
        # ended): how it was asked is what is checked
        await call.line.wait_until(lambda: any(text == late for text, *_ in tts.asked), 60)
        assert tts.asked[-1][:2] == (late, True), tts.asked  # after "Let me check that." played
    finally:
        tts.close()


async def test_phase1_text_never_reaches_the_speaker(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    llm.script(
        [
            Reply(
                content="Let me check. One moment please",
                tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1003"})],
                content_after_tools="Still looking.",
            ),
            Reply(content="That order was delivered last Monday."),
        ]
    )
    call = _call(call_factory, support, llm.base_url)
    await call.say(piper_speech("What happened to order A1003?"), 200)
    await call.wait_idle()
    said = await _agent_said(call)
    assert word_error_rate(said, "That order was delivered last Monday.") <= 0.2
    assert "check" not in words(said)
    spoken = [e.data["text"] for e in call.of_type("agent_sentence")]
    assert spoken == ["That order was delivered last Monday."]


async def test_barge_in_silences_the_agent_and_answers_the_new_question(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    sentences = [
        "Your order is a blue kettle.",
        "It left our warehouse on Monday.",
        "The courier will bring it on Tuesday between nine and five.",
        "You can track it on our website at any time.",
        "Is there anything else I can help you with today?",
    ]
    llm.script(
        [
            Reply(content=" ".join(sentences), chunk_delay_s=0.15),  # still streaming when cut
            Reply(content="All right."),  # short: it plays out before the checks
        ]
    )
    call = _call(call_factory, support, llm.base_url)
    speaker_busy_at_interrupt: list[bool] = []
    call.probes.append(
        lambda event: (
            speaker_busy_at_interrupt.append(call.voice.speaker.busy)
            if event.type == "interrupted"
            else None
        )
    )
    await call.say(piper_speech("Tell me about my order."), 200)
    await call.wait_event("agent_sentence", count=2, timeout_s=30)
    answer = call.session.answer
    assert answer is not None
    turn_task = answer.task

    await call.say(piper_speech("Stop, stop, that is enough."), 200)
    interrupted = await call.wait_event("interrupted", timeout_s=10)
    assert speaker_busy_at_interrupt == [False]  # cleared before anything else happened
    await asyncio.wait_for(llm.stream_abandoned.wait(), timeout=5)
    assert turn_task.cancelled()
    await call.wait_idle(timeout_s=30)

    # barge-in came within a few hundred ms of the caller starting to talk
    starts = call.of_type("speech_start")
    assert len(starts) == 2, [
        (e.type, e.data)
        for e in call.events
        if e.type in ("speech_start", "speech_end", "transcript")
    ]
    second_start = starts[1]
    # pause_resume (the default): silent at the sound's onset (40 ms of voice, a frame before
    # the utterance starts at 60 ms), cut off once it is clearly more than a backchannel (700 ms
    # of voiced speech) or its words say so
    (paused,) = call.of_type("paused")
    assert -0.05 <= paused.t - second_start.t <= 0.1
    assert 0.6 <= interrupted.t - second_start.t <= 1.6

    messages = call.orchestrator.conversation.messages
    cut = [m for m in messages if m.get("interrupted")]
    assert len(cut) == 1
    heard = cut[0]["content"]
    assert heard.startswith(sentences[0])
    assert heard in {" ".join(sentences[:n]) for n in range(1, len(sentences))}
    assert interrupted.data["heard"] == heard
    # the new question was transcribed and answered
    transcripts = [e.data["text"] for e in call.of_type("transcript")]
    assert len(transcripts) == 2
    assert "enough" in words(transcripts[1])
    assert messages[-1] == {"role": "assistant", "content": "All right."}
    assert call.of_type("agent_sentence")[-1].data["text"] == "All right."
    # and what went to the LLM for it was a valid history ending with the new question
    last_request = llm.requests[-1]["messages"]
    assert last_request[-1]["role"] == "user"
    assert "interrupted" not in str(last_request)


async def test_a_short_noise_does_not_interrupt(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    # two sentences: the burst comes while the first plays, and the second must follow it
    answer = "Your order is on its way. It will arrive on Tuesday."
    llm.script([Reply(content=answer)])
    call = _call(call_factory, support, llm.base_url)
    await call.say(piper_speech("Where is my order?"), 200)
    await call.wait_event("agent_sentence", count=1)
    burst = loudest(piper_speech("Yes, yes."), 120)  # 120 ms of real voiced speech
    await call.say(burst, 600)
    await call.wait_idle()
    assert len(call.of_type("speech_start")) == 2  # the burst was heard as speech...
    assert call.of_type("interrupted") == []  # ...but too short to cut the agent off:
    assert len(call.of_type("paused")) == len(call.of_type("resumed")) == 1  # it paused it
    assert len(call.of_type("transcript")) == 1  # and was not taken as a turn
    assert call.voice.heard == answer


async def test_a_dead_llm_endpoint_speaks_the_fallback(
    support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    async with ScriptedLLM() as dead:
        url = dead.base_url
    call = _call(call_factory, support, url)
    await call.say(piper_speech("Is anybody there?"), 200)
    await call.wait_idle()
    errors = call.of_type("error")
    assert errors
    assert errors[0].data["source"] == "llm"
    assert call.voice.heard == "Sorry, I'm having trouble right now."
    assert "trouble" in words(await _agent_said(call))
    assert call.session.state == "listening"


async def test_a_raising_tool_is_reported_to_the_llm_and_the_turn_goes_on(
    llm: ScriptedLLM, call_factory: list[VoiceCall], write_playbook: object
) -> None:
    path = write_playbook(  # type: ignore[operator]
        """
        id: broken
        name: Broken tools
        initial_stage: main
        tools_module: tools.py
        stages:
          - id: main
            name: Main
            system_prompt: Help.
            tools: [explode]
        """,
        """
        from playbooks import tool

        @tool
        def explode() -> str:
            \"\"\"Always fails.\"\"\"
            raise RuntimeError("database unreachable")
        """,
    )
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("explode", {})]),
            Reply(content="I cannot reach our records right now."),
        ]
    )
    call = _call(call_factory, load_playbook(path), llm.base_url)
    await call.say(piper_speech("Check my account please."), 200)
    await call.wait_idle()
    tool_message = next(m for m in llm.requests[1]["messages"] if m["role"] == "tool")
    assert "database unreachable" in tool_message["content"]
    (end,) = call.of_type("tool_call_end")
    assert end.data["error"] is True
    assert call.voice.heard == "I cannot reach our records right now."


async def test_tts_and_stt_failures_are_reported_and_the_call_goes_on(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    broken_tts = Synthesizer(synthesizer()._voice, synthesizer().settings)
    broken_tts.close()  # a real failure: its worker pool refuses work
    broken_stt = Transcriber(transcriber()._model, transcriber().settings)
    broken_stt.close()
    llm.script([Reply(content="This answer cannot be spoken.")])
    # the two calls at once (each has its own broken part; only the first reaches the LLM)
    call = _call(call_factory, support, llm.base_url, tts=broken_tts)
    call2 = _call(call_factory, support, llm.base_url, stt=broken_stt)
    await call.say(piper_speech("Hello there."), 200)
    await call2.say(piper_speech("Hello again."), 200)
    await asyncio.gather(call.wait_idle(), call2.wait_idle())
    assert [e.data["source"] for e in call.of_type("error")] == ["tts"]
    assert call.session.state == "listening"
    assert not call.session.busy

    assert [e.data["source"] for e in call2.of_type("error")] == ["stt"]
    assert call2.voice.heard == "Sorry, I'm having trouble right now."
    assert len(llm.requests) == 1  # no LLM call without a transcript


async def test_silence_and_noise_make_no_llm_call(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    call = _call(call_factory, support, llm.base_url)
    await call.say(silence(1500))
    await call.line.run_for(1.6)
    await call.wait_idle()
    assert llm.requests == []
    assert call.of_type("transcript") == []


async def test_the_greeting_is_spoken_when_the_call_starts(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    call = _call(call_factory, support, llm.base_url, settings=SessionSettings())
    await call.wait_idle()
    said = await _agent_said(call)
    assert word_error_rate(said, "Hello, this is Acme support. How can I help you today?") <= 0.25
    assert llm.requests == []
    assert call.orchestrator.conversation.messages == [
        {"role": "assistant", "content": "Hello, this is Acme support. How can I help you today?"}
    ]


async def test_talking_over_the_greeting_keeps_only_what_was_heard(
    llm: ScriptedLLM, support: LoadedPlaybook, call_factory: list[VoiceCall]
) -> None:
    llm.script([Reply(content="Of course.")])  # short: it plays out before the checks
    call = _call(call_factory, support, llm.base_url, settings=SessionSettings())
    await call.wait_event("agent_sentence", count=2)  # the first greeting sentence was heard
    await call.say(piper_speech("Tell me about my order."), 200)
    await call.wait_event("interrupted")
    await call.wait_idle()
    messages = call.orchestrator.conversation.messages
    assert messages[0] == {
        "role": "assistant",
        "content": "Hello, this is Acme support.",
        "interrupted": True,
    }
    assert messages[1]["role"] == "user"
    assert messages[2] == {"role": "assistant", "content": "Of course."}
