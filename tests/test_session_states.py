"""The call's turn-taking machine: the session's phases and the handle of each answer.

The handles are tested on a real speaker; the phases on the real session with real webrtcvad,
Whisper and Piper, driven frame by frame on an injected clock (each tick feeds one caller frame
and pulls one agent frame); only the LLM is scripted. Every test fails on an illegal move, or on
any other error the server logs.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import warnings
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import pytest

from benchmarks.corpus import load_corpus
from media import FRAME_BYTES, FRAME_MS, Speaker, SpeechPaused, SpeechToText, Transcript
from media.audio import SAMPLE_RATE, silence
from playbooks import ChatClient, PlaybookOrchestrator, RetryPolicy, load_playbook
from playbooks.loader import LoadedPlaybook
from server.call.answer import Answer, AnswerState
from server.call.endpointing import EndpointSettings, Speculation
from server.call.events import VoiceEvent
from server.call.preemption import Preemption
from server.call.session import _MOVES, Phase, Session, SessionSettings
from server.call.timeline import TurnTimeline
from server.call.voice import VoicePlaybookOrchestrator
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall, answers_by_words
from tests.conftest import EXAMPLES
from tests.support.calls import piper_speech, synthesize_ahead, synthesizer, transcriber, words
from tests.support.timed_stt import primed

QUESTION = "Where is my order?"
FOLLOW_UP = "It was due on Monday."
LONG_ANSWER = (
    "Your order left our warehouse on Monday. The courier will bring it on Tuesday between nine "
    "and five. You can track it on our website at any time."
)
EARLY = EndpointSettings(complete_silence_ms=1000, incomplete_silence_ms=1200, preempt_lead_ms=700)
"""A long end of turn with an early preemptive answer (at 300 ms of silence after a complete
sentence, the end at 1000 ms): room to look at the held answer, and to speak on before the end."""


@pytest.fixture(autouse=True)
def _no_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No illegal move, nor a turn that failed (two answers at once, say)."""
    caplog.set_level(logging.ERROR, logger="server")
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


# -- the machine --------------------------------------------------------------------------------


def test_every_phase_is_reachable_and_every_phase_can_close() -> None:
    reached, frontier = {Phase.LISTENING}, [Phase.LISTENING]
    while frontier:
        for nxt in _MOVES[frontier.pop()] - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert reached == set(Phase)
    closing = (Phase.CLOSING, Phase.CLOSED)
    assert all(Phase.CLOSING in _MOVES[phase] for phase in Phase if phase not in closing)
    assert _MOVES[Phase.CLOSING] == {Phase.CLOSED}  # nothing starts or resumes while closing
    assert _MOVES[Phase.CLOSED] == frozenset()
    # an answer is never paused while held, nor held again once playing
    assert Phase.PAUSED not in _MOVES[Phase.PREPARING]
    assert Phase.PREPARING not in _MOVES[Phase.THINKING] | _MOVES[Phase.SPEAKING]


# -- the answer handle ----------------------------------------------------------------------------


def _ramp(frames: int) -> bytes:
    return np.arange(1, 1 + frames * FRAME_BYTES // 2, dtype=np.int16).tobytes()


def _silent(pcm: bytes) -> bool:
    return pcm == bytes(len(pcm))


async def _preemption() -> Preemption:
    async def heard() -> Transcript:
        return Transcript(text=QUESTION, audio_ms=1000.0, compute_ms=1.0)

    task = asyncio.create_task(heard())
    await task
    paused = SpeechPaused(audio=b"", started_at=0.0, last_voiced_at=1.0, at=1.16)
    client = ChatClient.connect("http://127.0.0.1:9/v1", None, "scripted")  # never asked
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "support.yaml"), client)
    return Preemption(Speculation(paused, task), orchestrator.snapshot(), TurnTimeline())


async def _blocked(gate: asyncio.Event, speaker: Speaker | None = None) -> None:
    if speaker is not None:
        speaker.push(_ramp(3), SAMPLE_RATE)
    await gate.wait()


async def test_an_answer_plays_pauses_resumes_and_is_done_when_its_task_ends() -> None:
    speaker = Speaker(SAMPLE_RATE)
    gate = asyncio.Event()
    answer = Answer("typed", speaker)
    answer.start(_blocked(gate, speaker), "turn:test:1")
    await asyncio.sleep(0)
    assert answer.state is AnswerState.PLAYING
    assert answer.live
    assert not answer.done()
    assert not _silent(speaker.pull())

    answer.pause()
    assert _state(answer) is AnswerState.PAUSED
    assert speaker.paused
    assert not speaker.held
    assert _silent(speaker.pull())
    answer.resume()
    assert _state(answer) is AnswerState.PLAYING
    assert not speaker.paused
    assert not _silent(speaker.pull())

    gate.set()
    await answer  # until its task has ended
    answer.finish()  # (what the session does as the task ends)
    assert _state(answer) is AnswerState.DONE
    assert answer.done()
    assert not answer.live


async def test_a_held_answer_plays_only_once_confirmed() -> None:
    speaker = Speaker(SAMPLE_RATE)
    preemption = await _preemption()
    gate = asyncio.Event()
    answer = Answer("preemptive", speaker, preemption=preemption)
    assert answer.state is AnswerState.HELD
    assert answer.held
    assert speaker.held
    assert not speaker.paused
    answer.start(_blocked(gate, speaker), "turn:test:1")
    await asyncio.sleep(0)
    assert speaker.busy
    assert _silent(speaker.pull())

    answer.confirm()
    assert _state(answer) is AnswerState.PLAYING
    assert preemption.confirmed.is_set()  # its tools with side effects may run
    assert not speaker.held
    assert not _silent(speaker.pull())
    gate.set()
    await answer


async def test_a_held_answer_with_nothing_to_say_waits_for_its_turn() -> None:
    speaker = Speaker(SAMPLE_RATE)
    answer = Answer("preemptive", speaker, preemption=await _preemption())
    answer.start(asyncio.sleep(0), "turn:test:1")
    await answer
    answer.finish()
    assert answer.done()
    assert answer.state is AnswerState.HELD
    answer.confirm()
    assert _state(answer) is AnswerState.DONE
    assert not speaker.held


@pytest.mark.parametrize("kind", ["typed", "preemptive"])
async def test_interrupting_clears_the_speaker_and_cancels_the_task(kind: str) -> None:
    speaker = Speaker(SAMPLE_RATE)
    preemption = await _preemption() if kind == "preemptive" else None
    answer = Answer("typed", speaker, preemption=preemption)
    answer.start(_blocked(asyncio.Event(), speaker), "turn:test:1")
    await asyncio.sleep(0)
    if preemption is None:
        speaker.pull()
    cleared = answer.interrupt()
    assert [r.played_ms for r in cleared] == [20.0 if preemption is None else 0.0]
    assert answer.state is AnswerState.INTERRUPTED
    assert not answer.live
    assert not speaker.busy
    assert not speaker.held
    assert not speaker.paused
    await answer  # the cancellation is not raised to whoever waits
    assert answer.task.cancelled()
    speaker.push(_ramp(1), SAMPLE_RATE)  # the next answer's audio
    assert answer.interrupt() == []  # already over: nothing of the next one is touched
    assert not _silent(speaker.pull())


async def test_a_paused_answer_that_ends_lifts_its_pause() -> None:
    speaker = Speaker(SAMPLE_RATE)
    answer = Answer("spoken", speaker)
    answer.start(asyncio.sleep(0), "turn:test:1")
    answer.pause()
    await answer
    answer.finish()
    assert answer.state is AnswerState.DONE
    assert not speaker.paused


async def test_waiting_for_an_answer_can_be_cancelled_without_cancelling_it() -> None:
    gate = asyncio.Event()
    answer = Answer("typed", Speaker(SAMPLE_RATE))
    answer.start(_blocked(gate), "turn:test:1")
    waiter = asyncio.create_task(answer.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not answer.done()
    gate.set()
    await answer
    assert not answer.task.cancelled()


@pytest.mark.illegal_move
async def test_an_illegal_answer_move_is_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer = Answer("typed", Speaker(SAMPLE_RATE))
    answer.resume()  # it was never paused
    (record,) = [r for r in caplog.records if "illegal" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.stack_info
    caplog.clear()


# -- the session ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Line:
    """A session driven by hand: each tick moves the call's clock 20 ms, feeds one caller frame
    and pulls one agent frame, then lets the event loop run."""

    def __init__(self, session: Session, clock: Clock, events: list[VoiceEvent]) -> None:
        self.session = session
        self.clock = clock
        self.events = events
        self.speaker = session.voice.speaker
        self.recording = bytearray()
        self.seen: list[tuple[Phase, AnswerState | None, bool, bool, str]] = []
        """After each tick: the phase, the answer's state, whether the speaker is held, paused,
        and the state clients were told."""

    def of_type(self, type: str) -> list[VoiceEvent]:
        return [event for event in self.events if event.type == type]

    @property
    def states(self) -> list[str]:
        return [event.data["state"] for event in self.of_type("state")]

    async def tick(self, frame: bytes | None = None, pace_s: float = 0.002) -> None:
        self.clock.now += FRAME_MS / 1000
        self.session.feed(frame or bytes(FRAME_BYTES))
        self.recording += self.speaker.pull()
        self.observe()
        await asyncio.sleep(pace_s)

    def observe(self) -> None:
        answer = self.session.answer
        self.seen.append(
            (
                self.session.phase,
                answer.state if answer else None,
                self.speaker.held,
                self.speaker.paused,
                self.session.state,
            )
        )

    async def say(self, pcm: bytes) -> None:
        for start in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES):
            await self.tick(pcm[start : start + FRAME_BYTES])

    async def until(
        self,
        condition: Callable[[], bool],
        frames: Iterator[bytes] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Tick (silence, or ``frames``) until ``condition()`` holds."""
        async with asyncio.timeout(timeout_s):
            while not condition():
                await self.tick(next(frames) if frames is not None else None)
        self.observe()

    async def idle(self) -> None:
        await self.until(lambda: self.session.phase is Phase.LISTENING and not self.session.busy)


PLAYBOOK = """\
id: states
name: States
initial_stage: main
tools_module: tools.py
stages:
  - id: main
    name: Main
    system_prompt: Help with orders.
    tools: [look_up]
"""
TOOLS = """
from playbooks import tool


@tool(side_effects=False)
def look_up() -> str:
    \"\"\"Where the order is.\"\"\"
    return "on its way"
"""


@pytest.fixture(scope="module")
def playbook(tmp_path_factory: pytest.TempPathFactory) -> LoadedPlaybook:
    """One stage with a look-up tool (two-phase: text before a tool call is retracted)."""
    synthesize_ahead(QUESTION, FOLLOW_UP)  # before any call's clock
    folder = tmp_path_factory.mktemp("states")
    (folder / "playbook.yaml").write_text(PLAYBOOK)
    (folder / "tools.py").write_text(TOOLS)
    return load_playbook(folder / "playbook.yaml")


@pytest.fixture
async def lines(llm: ScriptedLLM) -> AsyncIterator[Callable[..., Line]]:
    clients: list[ChatClient] = []
    made: list[Line] = []

    def make(
        playbook: LoadedPlaybook,
        settings: SessionSettings | None = None,
        stt: SpeechToText | None = None,
    ) -> Line:
        clock = Clock()
        client = ChatClient.connect(llm.base_url, None, "scripted", retry=RetryPolicy(retries=0))
        clients.append(client)
        events: list[VoiceEvent] = []
        voice = VoicePlaybookOrchestrator(
            PlaybookOrchestrator(playbook, client),
            stt or transcriber(),
            synthesizer(),
            Speaker(SAMPLE_RATE, clock=clock),
            events.append,
            clock=clock,
        )
        session = Session("states", voice, settings or SessionSettings(greet=False), clock=clock)
        line = Line(session, clock, events)
        made.append(line)
        return line

    yield make
    for line in made:
        await line.session.close()
    for client in clients:
        await client.aclose()


def _phases(line: Line) -> list[Phase]:
    """The phases the call went through, each once per stretch."""
    return [phase for phase, *_ in itertools.groupby(p for p, *_ in line.seen)]


@pytest.mark.slow
async def test_a_typed_turn_thinks_speaks_and_listens_again(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script([Reply(content=LONG_ANSWER)])
    line = lines(playbook)
    line.session.submit_text("Where is my order?")
    answer = line.session.answer
    assert answer is not None
    assert answer.kind == "typed"
    assert line.session.phase is Phase.THINKING
    assert line.states == ["thinking"]
    await line.idle()

    assert answer.state is AnswerState.DONE
    assert _phases(line)[0] is Phase.THINKING
    assert _phases(line)[-1] is Phase.LISTENING
    assert Phase.SPEAKING in _phases(line)
    assert set(_phases(line)) == {Phase.THINKING, Phase.SPEAKING, Phase.LISTENING}
    assert line.states[0] == "thinking"
    assert line.states[-1] == "listening"
    assert "speaking" in line.states
    assert line.session.voice.heard == LONG_ANSWER
    assert line.session.turns == 1
    assert line.session.barge_ins == 0


@pytest.mark.slow
async def test_typed_text_over_an_answer_cuts_it_and_is_answered(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script([Reply(content=LONG_ANSWER), Reply(content="Sure.")])
    line = lines(playbook)
    line.session.submit_text("Tell me about my order.")
    first = line.session.answer
    assert first is not None
    # the first sentence was heard (its first phrase is a chunk of its own)
    await line.until(lambda: len(line.of_type("agent_sentence")) >= 3)
    line.session.submit_text("Stop.")
    second = line.session.answer
    assert second is not first
    assert first.state is AnswerState.INTERRUPTED
    assert line.session.phase is Phase.THINKING  # the typed turn's answer
    await first
    assert first.task.cancelled()
    await line.idle()

    assert second is not None
    assert second.state is AnswerState.DONE
    assert line.session.barge_ins == 1
    (interrupted,) = line.of_type("interrupted")
    assert interrupted.data["cut_ms"] > 0
    assert line.session.voice.heard == "Sure."
    messages = line.session.voice.orchestrator.conversation.messages
    (cut,) = [m for m in messages if m.get("interrupted")]
    assert cut["content"] == "Your order left our warehouse on Monday."


@pytest.mark.slow
async def test_typed_text_cut_short_before_its_answer_ran_is_never_answered(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    """Three lines typed in a row: the second is cut by the third before its answer starts (it
    waits for the first to settle), so only the first and the third reach the LLM."""
    llm.script(answers_by_words({"first": LONG_ANSWER}, "Third."))
    line = lines(playbook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line.session.submit_text("The first line.")
        first = line.session.answer
        await line.until(lambda: line.session.phase is Phase.SPEAKING)
        line.session.submit_text("The second line.")
        second = line.session.answer
        line.session.submit_text("The third line.")
        third = line.session.answer
        await line.idle()
        assert first is not None
        assert second is not None
        assert third is not None
        await second
        del first, second
        gc.collect()
    assert [w.message for w in caught if "never awaited" in str(w.message)] == []
    assert [words(text)[1] for text in llm.user_turns] == ["first", "third"]
    assert _state(third) is AnswerState.DONE
    assert line.session.voice.heard == "Third."
    assert line.session.barge_ins == 2
    assert line.session.turns == 3


@pytest.mark.slow
async def test_a_sound_over_the_answer_pauses_it_and_a_cough_resumes_it(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script([Reply(content=LONG_ANSWER)])
    line = lines(playbook)
    line.session.submit_text("Tell me about my order.")
    await line.until(lambda: line.session.phase is Phase.SPEAKING)
    await line.say(load_corpus()["synthetic_cough"].pcm())
    assert line.session.phase is Phase.PAUSED
    answer = line.session.answer
    assert answer is not None
    assert answer.state is AnswerState.PAUSED
    assert line.speaker.paused
    assert not line.speaker.held
    assert line.session.state in ("speaking", "thinking")  # what clients saw is unchanged
    (paused,) = line.of_type("paused")
    await line.until(lambda: bool(line.of_type("resumed")))
    assert _state(answer) is AnswerState.PLAYING
    assert line.session.phase in (Phase.THINKING, Phase.SPEAKING)
    await line.idle()

    assert _state(answer) is AnswerState.DONE
    assert line.session.resumes == 1
    assert line.of_type("interrupted") == []
    assert line.session.barge_ins == 0
    assert line.session.voice.heard == LONG_ANSWER
    assert paused.data["heard"] in LONG_ANSWER


@pytest.mark.slow
async def test_a_retracted_sentence_under_a_pause_keeps_the_agent_paused(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    """Text that turns out to lead into a tool call is dropped from the speaker; the answer the
    caller paused stays paused, its next words waiting too, until the caller's words decide."""
    llm.script(
        [
            Reply(
                content="Let me check.",
                tool_calls=[ScriptedToolCall("look_up", {})],
                first_token_delay_s=0.3,
            ),
            Reply(content="It is on its way."),
        ]
    )
    settings = SessionSettings(
        greet=False, pause_confirm_ms=60_000, endpoint=EndpointSettings(speculate=False)
    )
    line = lines(playbook, settings)
    line.session.submit_text("Where is my order?")
    talking = itertools.cycle(_frames(piper_speech(QUESTION)))
    await line.until(lambda: line.session.phase is Phase.PAUSED, talking)
    assert line.session.answer is not None
    assert line.session.answer.state is AnswerState.PAUSED
    await line.until(  # the caller talks on while the answer is retracted and made again
        lambda: bool(line.of_type("tool_call_end")) and line.speaker.busy, talking
    )
    assert [e.type for e in line.events if e.type in ("tool_call_start", "paused")] == [
        "paused",
        "tool_call_start",
    ]
    assert line.session.phase is Phase.PAUSED
    assert line.speaker.paused
    heard_from = len(line.recording)
    for _ in range(10):
        await line.tick(next(talking))
    assert _silent(bytes(line.recording[heard_from:]))  # still paused: nothing played
    assert line.of_type("agent_sentence") == []


@pytest.mark.slow
async def test_a_preemptive_answer_is_held_then_plays_once_the_turn_ends(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script([Reply(content="It is on its way.")])
    speech = piper_speech(QUESTION) + silence(1500)
    stt = await primed(0.0, speech)
    line = lines(playbook, SessionSettings(greet=False, endpoint=EARLY), stt)
    await line.say(silence(300))
    await line.say(speech)
    await line.idle()

    assert stt.misses == 0
    assert line.session.speculations["preempted"] == 1
    assert line.session.speculations["preempted_wasted"] == 0
    phases = _phases(line)
    assert phases[:2] == [Phase.LISTENING, Phase.PREPARING], phases
    assert phases[2] in (Phase.THINKING, Phase.SPEAKING), phases
    assert Phase.PAUSED not in phases
    preparing = [seen for seen in line.seen if seen[0] is Phase.PREPARING]
    assert all(state is AnswerState.HELD for _, state, *_ in preparing)
    assert all(held and not paused for _, _, held, paused, _ in preparing)  # a hold, not a pause
    assert {shown for *_, shown in preparing} <= {"thinking", "listening"}
    (speech_end,) = line.of_type("speech_end")
    first_sentence = line.of_type("agent_sentence")[0]
    assert first_sentence.t >= speech_end.t  # nothing was heard before the turn ended
    answer = line.session.answer
    assert answer is not None
    assert answer.kind == "preemptive"
    assert answer.state is AnswerState.DONE
    assert answer.preemption is not None
    assert answer.preemption.confirmed.is_set()
    assert line.session.voice.heard == "It is on its way."
    assert line.session.barge_ins == 0


@pytest.mark.slow
async def test_speaking_on_undoes_a_preemptive_answer_without_a_barge_in(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script(lambda body: Reply(content="Sure.", first_token_delay_s=0.2))
    speech = piper_speech(QUESTION) + silence(500) + piper_speech(FOLLOW_UP) + silence(1500)
    stt = await primed(0.0, speech)
    line = lines(playbook, SessionSettings(greet=False, endpoint=EARLY), stt)
    await line.say(silence(300))
    frames = iter(_frames(speech))
    await line.until(lambda: line.session.phase is Phase.PREPARING, frames)
    undone = line.session.answer
    assert undone is not None
    assert undone.held
    await line.say(b"".join(frames))  # the pause was only a pause
    await line.idle()

    assert stt.misses == 0
    assert _state(undone) is AnswerState.INTERRUPTED
    await undone
    assert undone.task.cancelled()
    # (the whole utterance may be answered early too, at its own end)
    assert line.session.speculations["preempted_wasted"] == 1
    # the caller heard nothing of it: not a barge-in
    assert line.session.barge_ins == 0
    assert line.of_type("interrupted") == []
    phases = _phases(line)
    assert phases[:3] == [Phase.LISTENING, Phase.PREPARING, Phase.LISTENING], phases
    # the whole utterance was answered once; the conversation holds only that turn
    answered = line.session.answer
    assert answered is not None
    assert answered is not undone
    assert answered.state is AnswerState.DONE
    messages = line.session.voice.orchestrator.conversation.messages
    users = [m for m in messages if m["role"] == "user"]
    assert len(users) == 1
    assert {"order", "monday"} <= set(words(str(users[0]["content"])))
    assert line.session.voice.heard == "Sure."


@pytest.mark.slow
@pytest.mark.illegal_move
async def test_an_illegal_phase_move_is_logged_as_an_error(
    llm: ScriptedLLM,
    lines: Callable[..., Line],
    playbook: LoadedPlaybook,
    caplog: pytest.LogCaptureFixture,
) -> None:
    line = lines(playbook)
    line.session._enter(Phase.PAUSED)  # nothing to pause
    (record,) = [r for r in caplog.records if "illegal" in r.getMessage()]
    assert "listening -> paused" in record.getMessage()
    assert record.levelno == logging.ERROR
    assert record.stack_info
    assert line.session.phase is Phase.PAUSED  # made anyway: the phase follows the code
    caplog.clear()


@pytest.mark.slow
async def test_a_closed_call_ignores_typed_text(
    llm: ScriptedLLM, lines: Callable[..., Line], playbook: LoadedPlaybook
) -> None:
    llm.script([Reply(content=LONG_ANSWER)])
    line = lines(playbook)
    line.session.submit_text("Tell me about my order.")
    answer = line.session.answer
    await line.until(lambda: line.session.phase is Phase.SPEAKING)
    await line.session.close()
    assert answer is not None
    assert answer.state is AnswerState.INTERRUPTED
    assert line.session.phase is Phase.CLOSED
    assert line.session.state == "closed"
    assert line.states[-2:] == ["speaking", "closed"]  # straight to closed: nothing between
    line.session.submit_text("Hello?")
    assert line.session.answer is answer
    assert line.session.turns == 1
    assert line.session.barge_ins == 0  # closing is not a barge-in


def _frames(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + FRAME_BYTES] for i in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)]


def _state(answer: Answer) -> AnswerState:
    """(A call, so that a type checker does not keep an earlier state narrowed.)"""
    return answer.state
