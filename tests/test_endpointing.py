"""End of turn: speculative transcription at a pause and an end-of-turn silence that depends on
the words, with real webrtcvad, Whisper and Piper; only the LLM is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from media import SpeechPaused, SpeechToText, Transcript
from media.audio import SAMPLE_RATE, silence, trim_leading_silence, trim_trailing_silence
from media.vad import VadSettings
from playbooks import load_playbook
from playbooks.loader import LoadedPlaybook
from server.call.endpointing import (
    EndpointSettings,
    Speculation,
    TurnEnd,
    WordsEnd,
    end_of_turn,
    is_listener_noise,
    sounds_complete,
    words_end,
)
from server.call.session import SessionSettings
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES
from tests.support.calls import VoiceCall, piper_speech, start_call, synthesize_ahead, words
from tests.support.speech import whole_frames
from tests.support.timed_stt import DECODE_TIMES, primed

QUESTION = "Where is my order?"
TRAILING_AND = "I would like to order a large pizza and"
"""Whisper hears the trailing "and" in this one; of "...order a pizza and" it hears "...pizza end."
(the deterministic test voice), which sounds like a finished sentence."""
CONTINUATION = "a bottle of water."
PAUSE_AFTER_AND_MS = 600
"""Silence inserted after the trailing "and"; with Piper's own edges (~80 ms before, ~20 ms
after) the caller is silent ~700 ms: over the VAD's 400 ms, under the 900 ms for words that trail
off."""
FOLLOW_UP = "It was due on Monday."
QUICK_GAP_MS = 100
"""Silence between two voiced stretches: a pause at the quick 60 ms, none at the VAD's 160 ms
(60-140 ms all do with webrtcvad)."""
SHORT_PAUSE_MS = 80
"""With Piper's edges (~140 ms + ~40 ms), ~260 ms of silence: a pause (160 ms) that starts a
speculation, shorter than any end of turn (400 ms), longer than the question lead's 160 ms."""


@pytest.mark.parametrize("text", ["Where is my order?", "Yes.", "Stop!", "  Thank you.  "])
def test_finished_sentences_sound_complete(text: str) -> None:
    assert sounds_complete(text)


@pytest.mark.parametrize("text", ["My order number is A1003.", "It is 1003.", "Order 42?"])
def test_a_sentence_ending_in_a_number_sounds_complete(text: str) -> None:
    """Callers end turns with order numbers; the digits are the last word, not "is" or "a"."""
    assert sounds_complete(text)


@pytest.mark.parametrize(
    "text",
    [
        "I would like to",
        "and um",
        "Tell me about the",
        "Hello,",
        "",
        "   ",
        "Wait...",
        "I would like to order a pizza in.",  # Whisper's punctuation does not make it complete
        "So, um.",
    ],
)
def test_unfinished_sentences_do_not_sound_complete(text: str) -> None:
    assert not sounds_complete(text)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Where is my order?", "closing"),  # a question hands the turn over
        ("A table for four on Friday, please.", "closing"),
        ("That's all, thank you.", "closing"),
        ("I am calling about my parcel.", "complete"),
        ("Could you check whether?", "continues"),  # Whisper's "?" on a cut clause
        ("I'd like to book a table for", "continues"),
        ("So, um.", "continues"),
        ("Wait...", "continues"),
        ("My number is 555-0134.", "listing"),  # a digit group: more may follow
        ("My order number is 4 7 9,", "listing"),
        ("five five five", "listing"),
        ("The name is Rossi R O S", "listing"),
        ("The name is Rossy R-O-S-S-I.", "spelled"),  # Whisper's own spelling of the name
        ("The name is rosy r-o-s-s-i.", "spelled"),  # ... a letter short, on another CPU
        ("My name is Smithson, S, M, I, T, H.", "listing"),  # five letters of eight
        ("I live at Oak, O A K.", "spelled"),
        ("The name is Rossi, R, O, S, S.", "listing"),  # one letter short of the name
        ("My name is Tim, T A M.", "listing"),  # three letters must all match
        ("A table for four.", "complete"),  # one number word is not a list
        ("Right.", "opener"),
        ("Fine, thanks.", "opener"),
        ("Well, I mean.", "opener"),
        ("Hello?", "closing"),
        ("I would like the pasta", "unsure"),
        ("", "none"),
    ],
)
def test_how_the_words_end(text: str, kind: str) -> None:
    assert words_end(text) == kind


END = EndpointSettings()


@pytest.mark.parametrize(
    ("words", "score", "scoring", "silence_ms", "reason"),
    [
        ("complete", None, False, END.complete_silence_ms, "words"),  # no model: today's rule
        ("complete", 0.9, False, END.complete_silence_ms, "words+audio"),  # both agree
        ("complete", 0.1, False, END.disputed_silence_ms, "audio"),  # the voice goes on
        ("complete", None, True, END.hold_ms, "words+audio"),  # the voice's verdict is due
        ("closing", 0.9, False, END.complete_silence_ms, "words+audio"),
        ("closing", 0.1, False, END.closing_silence_ms, "audio"),  # seldom goes on after "?"
        ("continues", 0.99, False, END.hold_ms, "hold"),  # "...a table for": the words decide
        ("spelled", 0.02, False, END.complete_silence_ms, "words"),  # "R, O, S, S, I.": too
        ("listing", 0.9, False, END.listing_silence_ms, "words+audio"),
        ("listing", 0.2, False, END.hold_ms, "hold"),
        ("opener", 0.1, False, END.opener_silence_ms, "words"),
        ("unsure", 0.9, False, END.incomplete_silence_ms, "words+audio"),
        ("unsure", 0.2, False, END.hold_ms, "hold"),
        ("none", 0.9, False, 400, "silence"),
        (None, None, False, END.incomplete_silence_ms, "words"),  # still decoding
    ],
)
def test_words_and_voice_decide_the_end_of_the_turn_together(
    words: WordsEnd | None, score: float | None, scoring: bool, silence_ms: int, reason: str
) -> None:
    end = end_of_turn(words, score, scoring=scoring, base_ms=400, settings=END)
    assert (end.silence_ms, end.reason) == (silence_ms, reason)


def test_endpoint_settings_refuse_a_hold_shorter_than_the_waits_it_bounds() -> None:
    with pytest.raises(ValueError, match="hold_ms"):
        EndpointSettings(hold_ms=800)
    with pytest.raises(ValueError, match="turn_threshold"):
        EndpointSettings(turn_threshold=1.0)


async def _speculation(text: str | None) -> Speculation:
    """A speculation whose decode heard ``text`` (None: still decoding)."""
    paused = SpeechPaused(audio=b"", started_at=0.0, last_voiced_at=1.0, at=1.16)
    if text is None:
        task: asyncio.Task[Transcript] = asyncio.create_task(asyncio.sleep(3600))  # type: ignore[arg-type]
    else:
        task = asyncio.create_task(_heard(text))
        await task
    return Speculation(paused, task)


async def _heard(text: str) -> Transcript:
    return Transcript(text=text, audio_ms=1000.0, compute_ms=1.0)


@pytest.mark.parametrize(
    ("text", "starts_at_ms"),
    [
        ("Where is my order?", 160),  # a question: ends at 400 ms, answered 240 ms before
        ("I am calling about my order.", 260),  # a statement: answered 140 ms before
        ("I would like to order a large pizza and", 2360),  # trails off: held to 2,500 ms
        ("My number is 555-0134.", 1360),  # a digit group: ends at 1,500 ms
        ("Fine, thanks.", 560),  # an opener: ends at 700 ms
        ("Hello?", None),  # one word opens a turn more often than it ends one
        ("Wait.", None),
        ("", None),
        (None, None),  # the words are not known yet
    ],
)
async def test_a_preemptive_answer_waits_for_the_silence_and_the_words(
    text: str | None, starts_at_ms: int | None
) -> None:
    settings = EndpointSettings()
    speculation = await _speculation(text)
    try:
        due = [ms for ms in range(0, 3000, 20) if speculation.preempt_due(ms, 400, settings)]
    finally:
        speculation.discard()
    assert (due[0] if due else None) == starts_at_ms


async def test_a_call_whose_caller_went_on_answers_questions_with_the_ordinary_lead() -> None:
    speculation = await _speculation("Where is my order?")
    try:
        due = [
            ms
            for ms in range(0, 1000, 20)
            if speculation.preempt_due(ms, 400, EndpointSettings(), questions_early=False)
        ]
        assert due[0] == 260
        no_lead = EndpointSettings(preempt_lead_ms=0)  # preemption off: questions too
        assert not speculation.preempt_due(399, 400, no_lead)
    finally:
        speculation.discard()


async def _scored(score: float) -> float:
    return score


async def test_a_doubted_pause_is_scored_again_and_the_later_score_decides() -> None:
    settings = EndpointSettings()
    speculation = await _speculation("I ordered a blue kettle and want to know when it arrives.")
    try:
        speculation.scoring = asyncio.create_task(_scored(0.31))  # a long question at 200 ms
        await speculation.scoring
        assert speculation.turn_end(400, settings).silence_ms == settings.disputed_silence_ms
        assert not speculation.recheck_due(settings.model_recheck_ms - 20, settings)
        assert speculation.recheck_due(settings.model_recheck_ms, settings)
        speculation.rechecking = asyncio.create_task(_scored(0.91))  # the same at 500 ms
        await speculation.rechecking
        assert not speculation.recheck_due(settings.model_recheck_ms + 100, settings)  # once
        assert speculation.turn_end(400, settings) == (
            TurnEnd(settings.complete_silence_ms, "words+audio")
        )
    finally:
        speculation.discard()


@pytest.mark.parametrize(("second_score", "starts_at_ms"), [(None, 360), (0.2, 1360)])
async def test_a_doubted_sentence_is_answered_ahead_of_its_second_score(
    second_score: float | None, starts_at_ms: int
) -> None:
    """The preemptive answer bets on the second score lifting the doubt (it starts the lead
    before ``model_recheck_ms``); once that score doubts too, it waits for the longer end."""
    settings = EndpointSettings()
    speculation = await _speculation("I ordered a blue kettle and want to know when it arrives.")
    try:
        speculation.scoring = asyncio.create_task(_scored(0.31))
        await speculation.scoring
        if second_score is not None:
            speculation.rechecking = asyncio.create_task(_scored(second_score))
            await speculation.rechecking
        due = [ms for ms in range(0, 3000, 20) if speculation.preempt_due(ms, 400, settings)]
        assert due[0] == starts_at_ms
    finally:
        speculation.discard()


@pytest.mark.parametrize(
    ("text", "first_score"),
    [
        ("Where is my order?", 0.97),  # the voice says it is over
        ("Friday at eight for two", 0.2),  # unfinished words: the first doubt stands
        ("My number is 555-0134.", 0.2),
    ],
)
async def test_a_pause_is_scored_again_only_after_a_finished_sentence_in_doubt(
    text: str, first_score: float
) -> None:
    speculation = await _speculation(text)
    try:
        speculation.scoring = asyncio.create_task(_scored(first_score))
        await speculation.scoring
        assert not speculation.recheck_due(2000, EndpointSettings())
        assert not speculation.recheck_due(2000, EndpointSettings(model_recheck_ms=0))
    finally:
        speculation.discard()


def test_a_preemption_lead_outside_the_shortest_end_of_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="preempt_lead_ms"):
        EndpointSettings(preempt_lead_ms=400)
    with pytest.raises(ValueError, match="preempt_min_words"):
        EndpointSettings(preempt_min_words=0)


@pytest.fixture(scope="module")
def support() -> LoadedPlaybook:
    synthesize_ahead(QUESTION, TRAILING_AND, CONTINUATION, FOLLOW_UP)  # before any call's clock
    return load_playbook(EXAMPLES / "support.yaml")


@pytest.fixture
async def calls(llm: ScriptedLLM) -> AsyncIterator[list[VoiceCall]]:
    """Calls started by a test, stopped before the LLM server closes."""
    started: list[VoiceCall] = []
    yield started
    for call in started:
        await call.line.stop()


def _call(
    calls: list[VoiceCall],
    playbook: LoadedPlaybook,
    llm: ScriptedLLM,
    speculate: bool = True,
    stt: SpeechToText | None = None,
) -> VoiceCall:
    """A call answering every LLM request with "Sure." (so a wrongly split turn still ends)."""
    llm.script(lambda body: Reply(content="Sure."))
    settings = SessionSettings(greet=False, endpoint=EndpointSettings(speculate=speculate))
    call = start_call(playbook, llm.base_url, settings=settings, stt=stt)
    calls.append(call)
    return call


def _voiced(pcm: bytes) -> bytes:
    """``pcm`` (16 kHz PCM16) without Piper's quiet edges, in whole 20 ms frames."""
    return whole_frames(trim_trailing_silence(trim_leading_silence(pcm, SAMPLE_RATE), SAMPLE_RATE))


def _streamed(llm: ScriptedLLM) -> list[dict[str, Any]]:
    """The streamed chat requests: one per answered turn."""
    return [request for request in llm.requests if request.get("stream")]


def _user_words(request: dict[str, Any]) -> list[str]:
    message = request["messages"][-1]
    assert message["role"] == "user"
    return words(message["content"])


def _timeline(call: VoiceCall) -> list[tuple[str, dict[str, Any]]]:
    """The endpointing events, for assertion messages."""
    kinds = ("speech_start", "speech_end", "transcript", "interrupted")
    return [(event.type, event.data) for event in call.events if event.type in kinds]


@pytest.mark.slow
@DECODE_TIMES
async def test_a_complete_question_is_answered_from_the_speculative_transcript(
    decode_s: float, llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    speech = piper_speech(QUESTION) + silence(200)
    stt = await primed(decode_s, speech)
    call = _call(calls, support, llm, stt=stt)
    await call.say(speech)
    await call.wait_idle()

    (transcript,) = call.of_type("transcript")
    assert transcript.data["speculative"] is True
    assert {"my", "order"} <= set(words(transcript.data["text"]))
    speculations = call.session.speculations
    assert (speculations["used"], speculations["wasted"]) == (1, 0)  # no second decode
    assert speculations["preempted_wasted"] == 0
    (request,) = _streamed(llm)
    assert "order" in _user_words(request)
    (metrics,) = call.of_type("turn_metrics")
    # the turn ends at 400 ms of silence once the words (decoded from the 160 ms pause) are
    # known to be a complete sentence; while they are not known, at 900 ms
    if decode_s == 0:
        assert speculations["preempted"] == 1  # the answer started at 260 ms of silence
        assert 380 <= metrics.data["end_of_speech_ms"] <= 460, metrics.data
        assert metrics.data["stt_ms"] < 50, metrics.data
    else:
        assert speculations["preempted"] == 0
        assert 880 <= metrics.data["end_of_speech_ms"] <= 960, metrics.data
    assert stt.misses == 0


@pytest.mark.slow
@pytest.mark.parametrize("clears", [False, True], ids=["backlog-stays", "backlog-clears"])
async def test_no_speculative_decode_queues_behind_waiting_decodes(
    clears: bool, llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    """With other calls' decodes waiting for the worker, a pause's decode is skipped, not
    queued behind them; it starts once they have the worker if the caller is still silent,
    else the turn is decoded once, at its end."""
    speech = piper_speech(QUESTION) + silence(200)
    stt = await primed(0.0, speech)
    stt.backlog = EndpointSettings().skip_backlog  # other calls' decodes wait for the worker
    call = _call(calls, support, llm, stt=stt)
    await call.say(speech)
    await call.wait_event("speculation")  # the pause's decode, skipped
    if clears:
        stt.backlog = 0  # the other decodes got the worker; the caller is still silent
    await call.wait_idle()

    speculations = call.session.speculations
    assert speculations["skipped"] == 1
    (transcript,) = call.of_type("transcript")
    assert transcript.data["speculative"] is clears  # decoded in the pause, or at the end
    assert {"my", "order"} <= set(words(transcript.data["text"]))
    assert speculations["used"] == int(clears)
    assert speculations["wasted"] == 0
    assert stt.calls == 1  # never a second decode
    (metrics,) = call.of_type("turn_metrics")
    assert metrics.data["end_of_speech_ms"] < 600, metrics.data  # no wait for a late decode


@pytest.mark.slow
@pytest.mark.parametrize("idle", [True, False], ids=["whisper-idle", "whisper-busy"])
async def test_short_pauses_are_transcribed_only_while_whisper_is_idle(
    idle: bool, llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    """While no other call's decode keeps Whisper busy, a pause of ``quick_pause_ms`` is
    transcribed (and the decode thrown away when the caller goes on); while one does, only the
    VAD's longer pause is: a decode the caller talks through would be a wait for the others."""
    speech = (
        _voiced(piper_speech("I need to change"))
        + silence(QUICK_GAP_MS)
        + _voiced(piper_speech("my delivery address."))
        + silence(200)
    )
    stt = await primed(0.0, speech)
    await stt.prime(speech, VadSettings(pause_ms=EndpointSettings().quick_pause_ms))
    stt.idle = idle
    call = _call(calls, support, llm, stt=stt)
    await call.say(speech)
    await call.wait_idle()

    speculations = call.session.speculations
    assert speculations["wasted"] == int(idle)  # the decode at the gap, if it was transcribed
    assert speculations["used"] == 1
    (transcript,) = call.of_type("transcript")
    assert {"change", "delivery", "address"} <= set(words(transcript.data["text"]))
    assert stt.misses == 0


@pytest.mark.slow
@DECODE_TIMES
async def test_a_pause_after_a_trailing_and_does_not_end_the_turn(
    decode_s: float, llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    speech = (
        piper_speech(TRAILING_AND)
        + silence(PAUSE_AFTER_AND_MS)
        + piper_speech(CONTINUATION)
        + silence(200)
    )
    stt = await primed(decode_s, speech)
    call = _call(calls, support, llm, stt=stt)
    await call.say(speech)
    await call.wait_idle()

    # a decode at the pause not ready by 400 ms of silence must not end the turn regardless
    assert len(call.of_type("speech_end")) == 1, (_timeline(call), call.session.speculations)
    (transcript,) = call.of_type("transcript")
    assert {"pizza", "water"} <= set(words(transcript.data["text"])), transcript.data
    assert transcript.data["speculative"] is True
    assert call.session.speculations["used"] == 1
    assert call.session.speculations["wasted"] >= 1  # the decode at the pause after "and"
    # no answer was started on "...pizza and": after words that trail off a preemptive answer
    # waits for 760 ms of silence, longer than this pause; the LLM was asked once, for both
    speculations = call.session.speculations
    assert speculations["preempted_wasted"] == 0
    assert speculations["preempted"] == (1 if decode_s == 0 else 0)  # "...water." at 260 ms
    (request,) = _streamed(llm)
    assert {"pizza", "water"} <= set(_user_words(request))
    assert stt.misses == 0
    users = [m for m in call.orchestrator.conversation.messages if m["role"] == "user"]
    assert len(users) == 1, users
    assert "interrupted" not in str(call.orchestrator.conversation.messages)


@pytest.mark.slow
async def test_without_speculation_the_same_pause_splits_the_turn(
    llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    """The contrast: a fixed 400 ms end of turn cuts the caller off after "and"."""
    call = _call(calls, support, llm, speculate=False)
    speech = piper_speech(TRAILING_AND) + silence(PAUSE_AFTER_AND_MS) + piper_speech(CONTINUATION)
    await call.say(speech, 200)
    await call.wait_idle()

    assert len(call.of_type("speech_end")) == 2, _timeline(call)
    assert set(call.session.speculations.values()) == {0}
    assert all(event.data["speculative"] is False for event in call.of_type("transcript"))


@pytest.mark.slow
@DECODE_TIMES
async def test_speaking_again_after_a_pause_discards_the_speculation(
    decode_s: float, llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    speech = (
        piper_speech(QUESTION) + silence(SHORT_PAUSE_MS) + piper_speech(FOLLOW_UP) + silence(200)
    )
    stt = await primed(decode_s, speech)
    call = _call(calls, support, llm, stt=stt)
    await call.say(speech)
    await call.wait_idle()

    assert len(call.of_type("speech_end")) == 1, _timeline(call)
    (transcript,) = call.of_type("transcript")
    heard = set(words(transcript.data["text"]))
    assert {"order", "monday"} <= heard, transcript.data
    assert transcript.data["speculative"] is True  # the decode at the final silence
    assert call.session.speculations["used"] == 1
    assert call.session.speculations["wasted"] >= 1  # the decode of the question alone
    # an instant decode answered the question alone at 160 ms of silence (the question lead);
    # that answer was held, never heard, and undone when the caller went on
    thrown_away = 1 if decode_s == 0 else 0
    assert call.session.speculations["preempted_wasted"] == thrown_away
    *abandoned, request = _streamed(llm)
    assert len(abandoned) == thrown_away
    assert {"order", "monday"} <= set(_user_words(request))
    assert stt.misses == 0
    users = [m for m in call.orchestrator.conversation.messages if m["role"] == "user"]
    assert len(users) == 1, users
    assert len(call.of_type("tts_end")) == 1  # only the answer to both sentences was spoken


@pytest.mark.slow
async def test_after_a_caller_went_on_their_questions_wait_for_the_ordinary_lead(
    llm: ScriptedLLM, support: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    speech = (
        piper_speech(QUESTION) + silence(SHORT_PAUSE_MS) + piper_speech(FOLLOW_UP) + silence(200)
    )
    stt = await primed(0.0, speech)
    call = _call(calls, support, llm, stt=stt)
    for _ in range(2):
        await call.say(speech)
        await call.wait_idle()
    assert len(call.of_type("speech_end")) == 2, _timeline(call)
    # the first question pause cost one request; the second waited for 260 ms, past the pause
    assert call.session.speculations["preempted_wasted"] == 1
    assert len(_streamed(llm)) == 3


@pytest.mark.slow
async def test_a_preemptive_turn_runs_no_side_effect_before_the_turn_is_confirmed(
    llm: ScriptedLLM, calls: list[VoiceCall], write_playbook: Any
) -> None:
    """The caller trails off ("...and") and stays silent: the answer starts on the speculative
    transcript while the turn waits out the long silence, the look-up runs at once, the booking
    only after the end of the turn, and no second LLM call is made."""
    path = write_playbook(
        """
        id: booking
        name: Booking
        initial_stage: main
        tools_module: tools.py
        stages:
          - id: main
            name: Main
            system_prompt: Book tables.
            tools: [look_up, book]
        """,
        """
        import time

        from playbooks import tool

        CALLS = []

        @tool(side_effects=False)
        def look_up() -> str:
            \"\"\"Free tables.\"\"\"
            CALLS.append(("look_up", time.monotonic()))
            return "two free tables"

        @tool
        def book() -> str:
            \"\"\"Book a table.\"\"\"
            CALLS.append(("book", time.monotonic()))
            return "booked"
        """,
    )
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("look_up", {}), ScriptedToolCall("book", {})]),
            Reply(content="Your table is booked."),
        ]
    )
    playbook = load_playbook(path)
    settings = SessionSettings(greet=False)
    speech = piper_speech(TRAILING_AND) + silence(1500)
    # the words of the 160 ms pause are known at 460 ms: the answer starts at 760 ms of silence
    stt = await primed(0.3, speech)
    call = start_call(playbook, llm.base_url, settings=settings, stt=stt)
    calls.append(call)
    await call.say(speech)
    await call.wait_idle()

    (speech_end,) = call.of_type("speech_end")
    assert call.session.speculations["preempted"] == 1
    assert call.session.speculations["preempted_wasted"] == 0
    assert len(_streamed(llm)) == 2  # the tool round and the answer: nothing repeated
    tools = playbook.tools["book"].function.__globals__["CALLS"]
    ran = dict(tools)
    assert ran["look_up"] < speech_end.t  # a look-up may run early
    assert ran["book"] >= speech_end.t  # a booking waits for the confirmed turn
    assert call.voice.heard == "Your table is booked."
    (metrics,) = call.of_type("turn_metrics")
    assert metrics.data["end_of_speech_ms"] >= 880  # the long wait after "...and"


@pytest.mark.parametrize(
    ("text", "logprob", "spoken_ms", "noise"),
    [
        ("", None, 300, True),  # nothing transcribed
        ("Mhm.", -0.3, 500, True),  # a backchannel
        ("Yeah, okay.", -0.2, 600, True),
        ("M. H. N.", -0.5, 560, True),  # a hum spelled out
        ("and make a chance.", -1.05, 560, True),  # a short sound Whisper is unsure of
        ("Stop.", -1.2, 400, False),  # asking the agent to stop always counts
        ("Wait, what?", -0.9, 500, False),
        ("Could you repeat that?", -0.3, 900, False),  # a real question
        ("and make a chance.", -1.05, 1500, False),  # long enough to be a turn
    ],
)
def test_what_counts_as_listener_noise(
    text: str, logprob: float | None, spoken_ms: float, noise: bool
) -> None:
    transcript = Transcript(text=text, audio_ms=spoken_ms, compute_ms=1.0, avg_logprob=logprob)
    assert is_listener_noise(transcript, spoken_ms) is noise
