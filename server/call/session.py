"""One call: caller frames -> VAD -> turns, the speaker, and barge-in. When a turn ends, and the
words heard at each pause, are :class:`~.turn_taking.TurnTaking`'s to say; the session starts,
confirms or undoes the answers.

A session owns its listen loop (fed by the transport), one answer at a time (the greeting, a
spoken or typed turn, a preemptive answer: an :class:`~.answer.Answer` handle around its task),
and the speaker the transport pulls from. Caller speech while the agent thinks or speaks pauses
or interrupts it (the stage's barge-in policy): the speaker is cleared first (that silence is
what the caller notices), then the turn task is cancelled and awaited. The caller's utterance
then becomes the next turn.

What the call is doing is one :class:`Phase`, changed in one place (``Session._enter``);
``state`` is what clients see of it in ``state`` events:

=========  ==========================================================  ==========================
phase      the agent                                                   ``state``
=========  ==========================================================  ==========================
LISTENING  has no answer under way                                     listening
PREPARING  answers words heard before the end of the caller's turn,    thinking (listening once
           its audio held until the end of the turn confirms them      its task has ended)
THINKING   answers; nothing of the answer is queued                    thinking
SPEAKING   answers; its audio is queued or playing                     speaking
PAUSED     stopped mid-answer by a caller sound, waiting for the       speaking if audio is
           words to decide (``pause_resume``)                          queued, else thinking
CLOSING    ``close()`` runs: its answers are cut and wind down         as it was
CLOSED     the call is over                                            closed
=========  ==========================================================  ==========================

Moves::

    LISTENING -> THINKING             an answer starts (greeting, spoken or typed turn, keypad)
    LISTENING -> PREPARING            the words are known and the turn ends soon (preempt)
    PREPARING -> THINKING | SPEAKING  the turn ends on those words (-> LISTENING: it said nothing)
    PREPARING -> LISTENING            undone: the caller goes on, other words, typed text
    THINKING <-> SPEAKING             audio queued / all of it played
    THINKING | SPEAKING -> PAUSED     the caller starts speaking (``pause_resume``)
    PAUSED -> THINKING | SPEAKING     resumed: the words were a backchannel or noise
    THINKING | SPEAKING | PAUSED      a barge-in (the policy's, 700 ms voiced over a pause, words
        -> LISTENING                  over a pause), typed text, or the answer ended
    any -> CLOSING -> CLOSED          ``close()`` (while CLOSING, the moves of answers winding
                                      down are not made: nothing can start or resume any more)

Any other move is a bug: it is logged as an error, with the stack, and made anyway (the phase
follows what the code did; a call is not dropped over its bookkeeping). Not part of the phase:
``busy`` (the turn task runs; a task cut short stays busy while it settles its history), which
utterance already cut the agent off, and the speculative transcription under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from media import (
    FRAME_BYTES,
    FRAME_MS,
    EchoGate,
    EchoSettings,
    Hearing,
    HearingSettings,
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    Transcript,
    VadSegmenter,
    VadSettings,
)
from media.turn_model import TurnModel
from playbooks import BargeInPolicy

from .answer import Answer, AnswerKind, AnswerState
from .endpointing import EndpointSettings, Speculation, is_listener_noise
from .keypad import Keypad, keypad_line
from .preemption import Preemption, Preemptor
from .turn_taking import TurnTaking
from .voice import VoicePlaybookOrchestrator

__all__ = ["Phase", "Session", "SessionSettings", "SessionState"]

log = logging.getLogger(__name__)

SessionState = Literal["listening", "thinking", "speaking", "closed"]


class Phase(enum.StrEnum):
    """What the call is doing (the module docstring has the machine)."""

    LISTENING = "listening"
    PREPARING = "preparing"
    THINKING = "thinking"
    SPEAKING = "speaking"
    PAUSED = "paused"
    CLOSING = "closing"
    CLOSED = "closed"


_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.LISTENING: frozenset({Phase.THINKING, Phase.PREPARING, Phase.CLOSING}),
    Phase.PREPARING: frozenset({Phase.THINKING, Phase.SPEAKING, Phase.LISTENING, Phase.CLOSING}),
    Phase.THINKING: frozenset({Phase.SPEAKING, Phase.PAUSED, Phase.LISTENING, Phase.CLOSING}),
    Phase.SPEAKING: frozenset({Phase.THINKING, Phase.PAUSED, Phase.LISTENING, Phase.CLOSING}),
    Phase.PAUSED: frozenset({Phase.THINKING, Phase.SPEAKING, Phase.LISTENING, Phase.CLOSING}),
    Phase.CLOSING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}

ANSWERING = frozenset({Phase.PREPARING, Phase.THINKING, Phase.SPEAKING, Phase.PAUSED})
"""Phases with an answer under way."""
_PREPARING_ANSWERS = frozenset({Phase.PREPARING, Phase.THINKING})
"""Phases in which an answer is being prepared (not only played out)."""
AUDIBLE = frozenset({Phase.THINKING, Phase.SPEAKING})
"""Phases with an answer under way that the caller hears (or is about to): not held, not
paused."""


@dataclass(frozen=True)
class SessionSettings:
    vad: VadSettings = field(default_factory=VadSettings)
    barge_in_min_ms: int = 200
    """Voiced caller speech needed, while the agent is busy, to interrupt it."""
    greet: bool = True
    dtmf_pause_s: float = 1.5
    """Keypad digits pressed within this pause of each other form one input."""
    endpoint: EndpointSettings = field(default_factory=EndpointSettings)
    echo: EchoSettings = field(default_factory=EchoSettings)
    """Caller audio explained by the agent's own output (phone echo) is heard as silence;
    off where ``hearing`` cancels the echo."""
    hearing: HearingSettings = field(default_factory=HearingSettings)
    """Noise suppression and echo cancellation ahead of the VAD (the call's line picks them:
    phone lines both, browsers neither, since they do their own)."""
    barge_in: BargeInPolicy = "pause_resume"
    """The policy of stages that set none (see ``playbooks.BargeInPolicy``)."""
    pause_confirm_ms: int = 700
    """Under ``pause_resume``: voiced speech that cuts the paused agent off without waiting for
    the words (longer than any backchannel)."""
    pause_onset_ms: int = 40
    """Under ``pause_resume``: voiced sound that pauses the agent before it is long enough to
    start an utterance (``vad.start_ms``). A pause costs nothing to undo, and every 20 ms
    shaved here is 20 ms less of the agent talking over the caller; a sound that stops short
    of an utterance resumes the agent at once. 0 pauses only when an utterance starts."""


class Session:
    """Drives one call. Feed caller frames with :meth:`run` (or :meth:`feed`); the transport pulls
    agent audio from ``voice.speaker``."""

    def __init__(
        self,
        session_id: str,
        voice: VoicePlaybookOrchestrator,
        settings: SessionSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        turn_model: TurnModel | None = None,
        taps: Sequence[Callable[[bytes], None]] = (),
    ) -> None:
        self.id = session_id
        self.turn_model = turn_model
        """Scores each pause's voice (finished or not) beside its words; None: words only."""
        self.voice = voice
        self.settings = settings or SessionSettings()
        self.clock = clock
        vad = self.settings.vad
        endpoint = self.settings.endpoint
        if endpoint.speculate:  # the session ends turns itself (saying why), up to the hold
            vad = replace(vad, end_silence_ms=max(vad.end_silence_ms, endpoint.hold_ms + FRAME_MS))
        self.vad = VadSegmenter(vad, clock)
        hearing = self.settings.hearing
        self.hearing = Hearing(hearing, voice.speaker.sample_rate) if hearing.enabled else None
        """The caller's audio cleaned before the VAD hears it (None: as it comes)."""
        if self.hearing is not None and hearing.echo_cancellation:
            voice.speaker.taps.append(self.hearing.played)
        gate = self.settings.echo
        self.echo = EchoGate(replace(gate, enabled=False) if hearing.echo_cancellation else gate)
        self.turn_taking = TurnTaking(
            session_id,
            endpoint,
            self.vad,
            voice.transcriber,
            configured_pause_ms=self.settings.vad.pause_ms,
            end_silence_ms=self.settings.vad.end_silence_ms,
            clock=clock,
            turn_model=turn_model,
            emit=voice.emit,
            on_known=self._on_known,
            before_discard=self._undo_preemption,
        )
        """The caller's pauses transcribed and scored, and when their turn ends."""
        self.preemptor = Preemptor(session_id, endpoint, voice, self.turn_taking, clock)
        """Work started on the caller's words before their turn ends (read-ahead, preemptive
        answers)."""
        self._phase = Phase.LISTENING
        self._answer: Answer | None = None
        """The latest answer: the one under way, or the last one."""
        self._unsettled: set[Answer] = set()
        """Answers whose task has not ended (the latest, and any cut short still settling)."""
        self._pending: SpeechEnded | None = None
        self._carry: bytes = b""
        self._interrupted_this_utterance = False
        """Whether the caller's current utterance already cut the agent off (its words are then
        the next turn, whatever the agent is doing)."""
        self._onset_paused = False
        """Paused by a sound not (yet) an utterance (``pause_onset_ms``)."""
        self._state: SessionState = "listening"
        self.turns = 0
        self.barge_ins = 0
        self.muted = False
        """While muted, the caller's frames are heard as silence."""
        self.taps: list[Callable[[bytes], None]] = list(taps)
        """Observers of each caller frame as it arrives (silence while muted), e.g. a call
        recorder. They run on the event loop: quick."""
        self._silence = bytes(FRAME_BYTES)
        self.keypad = Keypad(
            self.settings.dtmf_pause_s, lambda digits: self.submit_text(keypad_line(digits))
        )
        """Gathers the caller's digits (:meth:`dtmf`); closed with the session."""
        self._settling: asyncio.Task[None] | None = None
        """While PAUSED: deciding whether the sound that paused the agent was a backchannel."""
        self.resumes = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def speculations(self) -> dict[str, int]:
        """Speculative transcriptions whose result became the turn's, and those thrown away;
        turns started on one before the end of the turn, and those undone (``OUTCOMES``)."""
        return self.turn_taking.counts

    @property
    def state(self) -> SessionState:
        """What clients were last told in a ``state`` event."""
        return self._state

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def answer(self) -> Answer | None:
        """The latest answer's handle: the one under way, or the last one."""
        return self._answer

    @property
    def busy(self) -> bool:
        """Whether a turn (or the greeting) is running."""
        return self._answer is not None and not self._answer.done()

    @property
    def in_turn(self) -> bool:
        """Whether the call is doing a turn's heavy work: the caller is speaking (decodes), or
        the agent prepares an answer (the LLM, the first words' synthesis); not while it only
        plays an answer out, nor in the silences between turns. Admission learns a call's
        cost while calls are in turns."""
        return self.vad.speaking or self._phase in _PREPARING_ANSWERS

    @property
    def _closed(self) -> bool:
        """Whether ``close()`` has begun."""
        return self._phase in (Phase.CLOSING, Phase.CLOSED)

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes; a move the machine lacks is logged as a bug."""
        current = self._phase
        if phase is current or (current is Phase.CLOSING and phase is not Phase.CLOSED):
            return
        if phase not in _MOVES[current]:
            log.error(
                "session %s: illegal phase move %s -> %s (answer %r)",
                self.id,
                current,
                phase,
                self._answer,
                stack_info=True,
            )
        self._phase = phase
        self._publish()

    def _publish(self) -> None:
        """Tell clients the ``state`` the phase shows as, if it changed."""
        state = self._shown_state()
        if state != self._state:
            self._state = state
            self.voice.emit("state", state=state)

    def _shown_state(self) -> SessionState:
        match self._phase:
            case Phase.PREPARING:
                return "thinking" if self.busy else "listening"
            case Phase.PAUSED:
                return "speaking" if self.voice.speaker.busy else "thinking"
            case Phase.THINKING:
                return "thinking"
            case Phase.SPEAKING:
                return "speaking"
            case Phase.CLOSING:
                return self._state
            case Phase.CLOSED:
                return "closed"
            case _:
                return "listening"

    def _audible_phase(self) -> Phase:
        """THINKING or SPEAKING, as the speaker says."""
        return Phase.SPEAKING if self.voice.speaker.busy else Phase.THINKING

    def _refresh(self) -> None:
        if self._phase in AUDIBLE:
            self._enter(self._audible_phase())
        self._publish()

    # -- input ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin the call: speak the notice (``voice.notice``, if any), then the greeting (if
        the stage has one and greeting is on)."""
        if self.settings.greet or self.voice.notice:
            self._start_answer(self.voice.greet(stage_greeting=self.settings.greet), "greeting")

    def say(self, text: str) -> Answer | None:
        """Speak ``text`` as the agent outside a turn (an idle prompt), as the greeting is
        spoken: a barge-in cuts it, the conversation keeps what was heard. None (nothing said)
        while a turn runs or once the session is closed."""
        if self._closed or self.busy:
            return None
        return self._start_answer(self.voice.say(text), "line")

    async def run(self, frames: AsyncIterable[bytes]) -> None:
        """Start, then feed every caller frame (20 ms, 16 kHz PCM16) until the iterable ends,
        then close. Frames ending by themselves during a turn (the peer vanished rather than
        hung up, which closes the session first) are reported as an ``error`` (``transport``)."""
        self.start()
        try:
            async for frame in frames:
                self.feed(frame)
            if self.busy and not self._closed:
                self.voice.emit(
                    "error", source="transport", message="the caller's audio ended mid-turn"
                )
        finally:
            await self.close()

    def feed(self, frame: bytes, at: float | None = None) -> None:
        """Process one caller frame that arrived at ``at`` (default: now)."""
        if self._closed:
            return
        if len(frame) != FRAME_BYTES:
            raise ValueError(f"caller frames must be {FRAME_BYTES} bytes (20 ms at 16 kHz)")
        at = self.clock() if at is None else at
        for tap in self.taps:
            tap(self._silence if self.muted else frame)
        arrived = None
        if self.hearing is not None:
            if self.hearing.settings.echo_cancellation and not self.muted:
                arrived = frame
            frame = self.hearing.heard(frame)
        if self.muted or self.echo.is_echo(frame, self.voice.speaker.levels):
            frame = self._silence
        turns = self.turn_taking
        self.vad.pause_ms = turns.pause_ms()
        for event in self.vad.push(frame, at, arrived=arrived):
            if isinstance(event, SpeechStarted):
                self._on_speech_started(event)
            elif isinstance(event, SpeechPaused):
                self._speculate(event)
            elif isinstance(event, SpeechResumed):
                turns.skipped_pause = None
                self._read_ahead()
                turns.discard()
            else:
                self._on_speech_ended(event)
        if turns.skipped_pause is not None and self.vad.speaking:
            self._speculate(turns.skipped_pause, again=True)
        turns.score_pause()
        self._check_onset()
        self._check_end_of_turn(at)
        self._check_barge_in()
        self._refresh()

    def dtmf(self, digit: str) -> None:
        """A keypad digit (0-9, *, #, A-D). Digits are gathered (:class:`~.keypad.Keypad`) until
        ``#`` or a pause of ``dtmf_pause_s``, then answered like a spoken turn saying
        ``Keypad: 123#``; anything else is ignored."""
        if self._closed or not Keypad.accepts(digit):
            return
        self.voice.emit("dtmf", digit=digit)
        self.keypad.press(digit)

    def submit_text(self, text: str) -> None:
        """A typed user turn, answered in voice like a spoken one (interrupts a busy agent, and
        undoes an answer held for the caller's spoken words). Ignored once the call is closed."""
        if self._closed:
            return
        self.interrupt()
        self._start_answer(self.voice.answer_text(text), "typed")

    def _check_onset(self) -> None:
        """Pause at the onset of a sound that may be the caller talking over the agent
        (``pause_onset_ms``); resume if it died away before it became an utterance."""
        if self._onset_paused and not self.vad.speaking and not self.vad.onset_ms:
            self._onset_paused = False
            if self._phase is Phase.PAUSED:
                self._resume()
                self.voice.emit("resumed", text="")
            return
        onset = self.settings.pause_onset_ms
        if (
            onset
            and self.vad.onset_ms >= onset
            and self._phase in AUDIBLE
            and self.barge_in_policy == "pause_resume"
        ):
            self._onset_paused = True
            self._pause()

    def _on_speech_started(self, event: SpeechStarted) -> None:
        self._onset_paused = False
        self._interrupted_this_utterance = False
        self.voice.emit("speech_start", at_ms=round(event.at * 1000, 1))
        if self._phase not in ANSWERING:
            return
        policy = self.barge_in_policy
        if policy == "immediate":
            self._interrupted_this_utterance = True
            self.interrupt()
        elif policy == "pause_resume" and self._phase in AUDIBLE:
            self._pause()

    @property
    def barge_in_policy(self) -> BargeInPolicy:
        return self.voice.barge_in(self.settings.barge_in)

    # -- end of turn ---------------------------------------------------------------------------

    def _speculate(self, paused: SpeechPaused, *, again: bool = False) -> None:
        """Transcribe the utterance so far (:meth:`TurnTaking.speculate`), unless it cannot
        become a turn: a short sound over the agent, which only a barge-in would make one."""
        if not self.settings.endpoint.speculate:
            return
        if self._phase in AUDIBLE and not self._interrupted_this_utterance:
            self.turn_taking.skipped_pause = None
            return
        self.turn_taking.speculate(paused, again=again)

    def _read_ahead(self) -> None:
        """The caller went on after a pause: the LLM reads the turn so far
        (:meth:`Preemptor.read_ahead`), only while the agent is not answering."""
        if self._phase is Phase.LISTENING:
            self.preemptor.read_ahead()

    def _on_known(self, speculation: Speculation) -> None:
        """The words (or the voice's score) came back: a preemptive answer or an end of turn
        they make due happens now, not at the next caller frame."""
        if self.turn_taking.speculation is speculation and not self._closed:
            self._check_end_of_turn(self.clock())
            self._publish()

    def _check_end_of_turn(self, at: float) -> None:
        """End the utterance once its silence is as long as its words call for
        (:meth:`TurnTaking.end`), else start a preemptive answer if one is due."""
        if not self.settings.endpoint.speculate or not self.vad.speaking:
            return
        turns = self.turn_taking
        end = turns.end()
        if self.vad.silent_ms >= end.silence_ms:
            turns.turn_end = end
            ended = self.vad.end_now(at)
            if ended is not None:
                self._on_speech_ended(ended)
        elif (speculation := self.preemptor.due()) is not None:
            self._preempt(speculation)

    # -- preemptive answers ----------------------------------------------------------------------

    def _preempt(self, speculation: Speculation) -> None:
        """Start a preemptive answer to ``speculation``'s words (:meth:`Preemptor.begin`), held
        until the end of the turn confirms them; only while no answer is under way or settling
        (an answer cut short is still settling the conversation)."""
        if self._phase is not Phase.LISTENING or self._unsettled:
            return
        started = self.preemptor.begin(speculation, silent_ms=self.vad.silent_ms)
        if started is not None:
            preemption, work = started
            self._start_answer(work, "preemptive", preemption=preemption)

    def _confirm_preemption(self, ended: SpeechEnded) -> bool:
        """The turn ended: a preemptive answer to the same words plays now (True); one to
        words the caller has since added to is undone (False)."""
        answer = self._answer
        if answer is None or not answer.held:
            return False
        assert answer.preemption is not None
        if not self.preemptor.confirm(answer.preemption, ended):
            self._stop(answer)
            return False
        answer.confirm()
        self._enter(self._audible_phase() if self.busy else Phase.LISTENING)
        return True

    def _undo_preemption(self) -> None:
        """The caller went on: an answer held for the words so far is undone."""
        answer = self._answer
        if answer is not None and answer.held:
            self._stop(answer)

    def _on_speech_ended(self, event: SpeechEnded) -> None:
        self.turn_taking.skipped_pause = None
        held = self._answer.preemption if self._answer is not None else None
        if self._confirm_preemption(event):
            assert held is not None
            self._emit_speech_end(event, held.speculation)
            return
        speculation = self.turn_taking.take(event)
        self._emit_speech_end(event, speculation)
        self._handle_utterance(event, speculation)

    def _emit_speech_end(self, event: SpeechEnded, speculation: Speculation | None) -> None:
        """``speech_end``, with why the turn ended (``reason``: see ``EndReason``) and the
        voice's score, when the turn model gave one."""
        end, self.turn_taking.turn_end = self.turn_taking.turn_end, None
        reason = "forced" if event.forced else end.reason if end is not None else "silence"
        score = speculation.score if speculation is not None else None
        self.voice.emit(
            "speech_end",
            duration_ms=round(event.duration_ms),
            forced=event.forced,
            last_voiced_ms=round(event.last_voiced_at * 1000, 1),
            reason=reason,
            turn_score=None if score is None else round(score, 3),
        )

    def _handle_utterance(self, event: SpeechEnded, speculation: Speculation | None) -> None:
        if self._carry:  # the words of a turn cut during STT: transcribe them all together
            event = _prepend_audio(self._carry, event)
            self._carry = b""
            self.turn_taking.waste(speculation)
            speculation = None
        if self._phase is Phase.LISTENING or self._interrupted_this_utterance:
            # (an answer cut short meanwhile is still settling: the new one waits for it)
            self._answer_utterance(event, speculation)
            return
        if self._phase is Phase.PAUSED:  # pause_resume: the words decide
            self._settle_pause(event, speculation)
            return
        if self.barge_in_policy == "disabled":
            self._pending = event  # heard after the agent finishes
        # else: too short to interrupt the agent: a cough or a backchannel, not a turn
        self.turn_taking.waste(speculation)

    def _check_barge_in(self) -> None:
        if (
            not self.vad.speaking
            or self._interrupted_this_utterance
            # (PREPARING: the answer under way answers these very words)
            or self._phase not in (Phase.THINKING, Phase.SPEAKING, Phase.PAUSED)
        ):
            return
        policy = self.barge_in_policy
        if policy == "confirmed":
            needed = self.settings.barge_in_min_ms
        elif policy == "pause_resume":
            needed = self.settings.pause_confirm_ms
        else:
            return
        if self.vad.voiced_ms >= needed:
            self._interrupted_this_utterance = True
            self.interrupt()

    # -- pause and resume ------------------------------------------------------------------------

    def _pause(self) -> None:
        assert self._answer is not None
        self._answer.pause()
        self._enter(Phase.PAUSED)
        self.voice.emit("paused", heard=self.voice.heard)

    def _resume(self) -> None:
        assert self._answer is not None
        self._answer.resume()
        self._enter(self._audible_phase())
        self.resumes += 1

    def _settle_pause(self, utterance: SpeechEnded, speculation: Speculation | None) -> None:
        """The sound that paused the agent has ended: resume if its words are a backchannel or
        nothing, else cut the agent off and answer them."""
        if speculation is not None:
            self.turn_taking.count("used")
            transcript = speculation.task
        else:
            transcript = asyncio.create_task(self.voice.transcriber.transcribe(utterance.audio))
        if self._settling is not None:
            self._settling.cancel()
        assert self._answer is not None
        self._settling = asyncio.create_task(
            self._settle(utterance, transcript, self._answer), name=f"settle:{self.id}"
        )

    async def _settle(
        self, utterance: SpeechEnded, transcript: asyncio.Task[Transcript], paused: Answer
    ) -> None:
        try:
            heard: Transcript | None = await transcript
        except Exception:
            log.exception("transcribing a sound over the agent failed")
            heard = None
        if self._closed or self.vad.speaking or self._answer is not paused:
            return  # the caller is talking again (that utterance decides), or typed meanwhile
        spoken_ms = (utterance.last_voiced_at - utterance.started_at) * 1000
        noise = heard is None or is_listener_noise(heard, spoken_ms)
        if paused.state is AnswerState.PAUSED:
            if noise:
                self._resume()
                self.voice.emit("resumed", text=heard.text if heard else "")
                return
            self._interrupted_this_utterance = True
            self.interrupt()
        elif paused.state is not AnswerState.DONE or noise:
            return  # cut off meanwhile; or it ended by itself, and the sound was nothing
        # (DONE: the answer ended by itself while paused, with nothing left to say: the words
        # are the next turn all the same)
        self._start_answer(
            self.voice.answer_utterance(utterance, transcript), "spoken", audio=utterance.audio
        )

    # -- answers -------------------------------------------------------------------------------

    def interrupt(self) -> asyncio.Task[None] | None:
        """Stop the agent now: clear the speaker, cancel the answer's task. Returns that task
        (await it to know the history is settled), or None if no answer was under way. An answer
        still held for the caller's words is undone (a wasted preemption, not a barge-in)."""
        answer = self._answer
        if answer is None or not answer.live:
            return None
        self._stop(answer)
        return answer.task

    def _stop(self, answer: Answer) -> None:
        """Cut ``answer`` short: the one routine behind a barge-in, typed text over the agent,
        and undoing a preemptive answer (the caller went on, or the turn ended on other words).
        Its audio is dropped at once and its task cancelled; history keeps what was heard, and
        an unconfirmed preemptive answer puts the conversation back. It counts as what the
        caller lived: a held answer (never heard) as a wasted preemption, any other as a
        barge-in (``interrupted``)."""
        held = answer.held
        running = not answer.done()
        if answer.audio and not self.voice.turn_started:
            self._carry = answer.audio  # cut during STT: its words join the next utterance
        cleared = answer.interrupt()
        if held:
            assert answer.preemption is not None
            self.preemptor.undo(answer.preemption, running=running)
        else:
            self.barge_ins += 1
            self.voice.emit(
                "interrupted",
                heard=self.voice.heard,
                cut_ms=round(sum(r.played_ms for r in cleared)),
            )
        self._enter(Phase.LISTENING)

    def _answer_utterance(
        self, utterance: SpeechEnded, speculation: Speculation | None = None
    ) -> None:
        transcript = None
        if speculation is not None:
            self.turn_taking.count("used")
            transcript = speculation.task
        self._start_answer(
            self.voice.answer_utterance(utterance, transcript, speculative=transcript is not None),
            "spoken",
            audio=utterance.audio,
        )

    def _start_answer(
        self,
        work: Coroutine[Any, Any, None],
        kind: AnswerKind,
        *,
        audio: bytes = b"",
        preemption: Preemption | None = None,
    ) -> Answer:
        earlier = tuple(self._unsettled)
        self.turns += kind not in ("greeting", "line")
        answer = Answer(kind, self.voice.speaker, audio=audio, preemption=preemption)
        name = kind if kind in ("greeting", "line") else "turn"
        answer.start(self._run(answer, work, earlier), name=f"{name}:{self.id}:{self.turns}")
        self._unsettled.add(answer)
        answer.task.add_done_callback(lambda _: self._settled(answer, work))
        self._answer = answer
        self._enter(Phase.PREPARING if preemption is not None else Phase.THINKING)
        return answer

    async def _run(
        self, answer: Answer, work: Coroutine[Any, Any, None], earlier: tuple[Answer, ...]
    ) -> None:
        try:
            for before in earlier:  # one answer at a time: those cut short settle their history
                await before
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("turn failed in session %s", self.id)
            self.voice.emit("error", source="turn", message=f"{type(exc).__name__}: {exc}")
        finally:
            answer.finish()
            if answer is self._answer:
                self._answer_ended(answer)

    def _settled(self, answer: Answer, work: Coroutine[Any, Any, None]) -> None:
        """``answer``'s task is over."""
        self._unsettled.discard(answer)
        work.close()  # (never awaited if cut short before it ran, or while the earlier settled)

    def _answer_ended(self, answer: Answer) -> None:
        if answer.held:  # nothing to say: its turn is still confirmed or undone at its end
            self._publish()
            return
        self._enter(Phase.LISTENING)
        self._start_pending()

    def _start_pending(self) -> None:
        if self._pending is not None and not self._closed:
            pending, self._pending = self._pending, None
            self._answer_utterance(pending)

    async def close(self) -> None:
        """End the call: cancel any turn and wait for it, and free the speaker's native
        resources at once (the call's objects are reference cycles, freed only when the garbage
        collector gets to them). Idempotent."""
        if self._closed:
            return
        self._enter(Phase.CLOSING)
        self._pending = None
        self.turn_taking.close()
        if self._settling is not None:
            self._settling.cancel()
        self.preemptor.close()
        self.keypad.close()
        if self._answer is not None:
            self._answer.interrupt()  # (nothing to do if it is over)
        for answer in tuple(self._unsettled):
            with contextlib.suppress(asyncio.CancelledError):
                await answer.task
        await self.voice.orchestrator.aclose()
        self.voice.speaker.close()
        self._enter(Phase.CLOSED)


def _prepend_audio(audio: bytes, event: SpeechEnded) -> SpeechEnded:
    return SpeechEnded(
        audio=audio + event.audio,
        started_at=event.started_at,
        last_voiced_at=event.last_voiced_at,
        detected_at=event.detected_at,
        forced=event.forced,
    )
