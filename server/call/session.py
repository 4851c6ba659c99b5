"""One call: caller frames -> VAD -> turns, the speaker, and barge-in.

A session owns its listen loop (fed by the transport), at most one turn task, and the speaker the
transport pulls from. Caller speech lasting ``barge_in_min_ms`` while the agent thinks or speaks
interrupts it: the speaker is cleared first (that silence is what the caller notices), then the turn
task is cancelled and awaited. The caller's utterance then becomes the next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from media import (
    FRAME_BYTES,
    EchoGate,
    EchoSettings,
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    Transcript,
    VadSegmenter,
    VadSettings,
)
from playbooks import BargeInPolicy
from playbooks.orchestrator import Snapshot

from .endpointing import EndpointSettings, Speculation, is_listener_noise
from .timeline import TurnTimeline
from .voice import VoicePlaybookOrchestrator

__all__ = ["Session", "SessionSettings", "SessionState"]

log = logging.getLogger(__name__)

SessionState = Literal["listening", "thinking", "speaking", "closed"]
DTMF_DIGITS = "0123456789*#ABCD"


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
    """Caller audio explained by the agent's own output (phone echo) is heard as silence."""
    barge_in: BargeInPolicy = "pause_resume"
    """The policy of stages that set none (see ``playbooks.BargeInPolicy``)."""
    pause_confirm_ms: int = 700
    """Under ``pause_resume``: voiced speech that cuts the paused agent off without waiting for
    the words (longer than any backchannel)."""


@dataclass
class _Preemption:
    """A turn started on a speculative transcript, its audio held until the turn ends."""

    speculation: Speculation
    snapshot: Snapshot
    confirmed: asyncio.Event
    timeline: TurnTimeline
    task: asyncio.Task[None] | None = None


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
    ) -> None:
        self.id = session_id
        self.voice = voice
        self.settings = settings or SessionSettings()
        self.clock = clock
        vad = self.settings.vad
        endpoint = self.settings.endpoint
        if endpoint.speculate:  # the session ends turns itself, up to the longest silence
            vad = replace(
                vad, end_silence_ms=max(vad.end_silence_ms, endpoint.incomplete_silence_ms)
            )
        self.vad = VadSegmenter(vad, clock)
        self.echo = EchoGate(self.settings.echo)
        self._speculation: Speculation | None = None
        self._preemption: _Preemption | None = None
        self.speculations = {"used": 0, "wasted": 0, "preempted": 0, "preempted_wasted": 0}
        """Speculative transcriptions whose result became the turn's, and those thrown away;
        turns started on one before the end of the turn, and those undone."""
        self._turn: asyncio.Task[None] | None = None
        self._turn_audio = b""
        """The caller audio the running turn answers (empty for the greeting or typed text)."""
        self._pending: SpeechEnded | None = None
        self._carry: bytes = b""
        self._interrupted_this_utterance = False
        self._closed = False
        self._state: SessionState = "listening"
        self.turns = 0
        self.barge_ins = 0
        self.muted = False
        """While muted, the caller's frames are heard as silence."""
        self._silence = bytes(FRAME_BYTES)
        self._digits = ""
        self._digit_timer: asyncio.TimerHandle | None = None
        self._settling: asyncio.Task[None] | None = None
        """Deciding whether the sound that paused the agent was a backchannel."""
        self.resumes = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def busy(self) -> bool:
        """Whether a turn (or the greeting) is running."""
        return self._turn is not None and not self._turn.done()

    def _set_state(self, state: SessionState) -> None:
        if state != self._state:
            self._state = state
            self.voice.emit("state", state=state)

    # -- input ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin the call: speak the greeting (if the stage has one and greeting is on)."""
        if self.settings.greet:
            self._start_turn(self.voice.greet(), name="greeting")

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
        if self.muted or self.echo.is_echo(frame, self.voice.speaker.levels):
            frame = self._silence
        for event in self.vad.push(frame, at):
            if isinstance(event, SpeechStarted):
                self._on_speech_started(event)
            elif isinstance(event, SpeechPaused):
                self._speculate(event)
            elif isinstance(event, SpeechResumed):
                self._discard_speculation()
            else:
                self._on_speech_ended(event)
        self._check_end_of_turn(at)
        self._check_barge_in()
        self._refresh_state()

    def dtmf(self, digit: str) -> None:
        """A keypad digit (0-9, *, #, A-D). Digits are gathered until ``#`` or a pause of
        ``dtmf_pause_s``, then answered like a spoken turn saying ``Keypad: 123#`` (which the LLM
        sees and a keyword condition can match)."""
        if self._closed or len(digit) != 1 or digit not in DTMF_DIGITS:
            return
        self.voice.emit("dtmf", digit=digit)
        self._digits += digit
        if self._digit_timer is not None:
            self._digit_timer.cancel()
            self._digit_timer = None
        if digit == "#":
            self._flush_digits()
        else:
            loop = asyncio.get_running_loop()
            self._digit_timer = loop.call_later(self.settings.dtmf_pause_s, self._flush_digits)

    def _flush_digits(self) -> None:
        self._digit_timer = None
        digits, self._digits = self._digits, ""
        if digits and not self._closed:
            self.submit_text(f"Keypad: {digits}")

    def submit_text(self, text: str) -> None:
        """A typed user turn, answered in voice like a spoken one (interrupts a busy agent)."""
        if self.busy:
            self.interrupt()
        self._start_turn(self.voice.answer_text(text), name="turn")

    def _on_speech_started(self, event: SpeechStarted) -> None:
        self._interrupted_this_utterance = False
        self.voice.emit("speech_start", at_ms=round(event.at * 1000, 1))
        if not self.busy:
            return
        policy = self.barge_in_policy
        if policy == "immediate":
            self._interrupted_this_utterance = True
            self.interrupt()
        elif policy == "pause_resume" and not self.voice.speaker.paused:
            self.voice.speaker.pause()
            self.voice.emit("paused", heard=self.voice.heard)

    @property
    def barge_in_policy(self) -> BargeInPolicy:
        return self.voice.barge_in(self.settings.barge_in)

    # -- end of turn ---------------------------------------------------------------------------

    def _speculate(self, paused: SpeechPaused) -> None:
        """Transcribe the utterance so far, unless it cannot become a turn (a short sound over
        the agent, which only a barge-in would make one)."""
        if not self.settings.endpoint.speculate:
            return
        if self.busy and not (self._interrupted_this_utterance or self.voice.speaker.paused):
            return
        self._discard_speculation()
        task = asyncio.create_task(
            self.voice.transcriber.transcribe(paused.audio), name=f"speculation:{self.id}"
        )
        self._speculation = Speculation(paused, task)

    def _discard_speculation(self) -> None:
        self._cancel_preemption()
        self._waste(self._speculation)
        self._speculation = None

    def _waste(self, speculation: Speculation | None) -> None:
        if speculation is not None:
            speculation.discard()
            self._count("wasted")

    def _count(self, outcome: str) -> None:
        """Tally a speculation's outcome (``speculations``) and tell clients and metrics."""
        self.speculations[outcome] += 1
        self.voice.emit("speculation", outcome=outcome)

    def _check_end_of_turn(self, at: float) -> None:
        """End the utterance once its silence is as long as its words call for (the configured
        end silence when nothing is being transcribed)."""
        if not self.settings.endpoint.speculate or not self.vad.speaking:
            return
        base = self.settings.vad.end_silence_ms
        speculation = self._speculation
        needed = (
            base
            if speculation is None
            else speculation.required_silence_ms(base, self.settings.endpoint)
        )
        if self.vad.silent_ms >= needed:
            ended = self.vad.end_now(at)
            if ended is not None:
                self._on_speech_ended(ended)
        elif speculation is not None and speculation.preempt_due(
            self.vad.silent_ms, base, self.settings.endpoint
        ):
            self._preempt(speculation)

    # -- preemptive turns ------------------------------------------------------------------------

    def _preempt(self, speculation: Speculation) -> None:
        """Start answering a speculative transcript (``Speculation.preempt_due``) while the end
        of the turn is still awaited: the answer's audio waits in the held speaker, tools with
        side effects wait for the confirmation, and the conversation can be put back if the
        caller goes on. The LLM's time to its first sentence then overlaps the end-of-turn
        silence."""
        transcript = speculation.transcript
        if (
            not self.settings.endpoint.preempt
            or self._preemption is not None
            or self.busy
            or transcript is None
            or not transcript.text
        ):
            return
        timeline = TurnTimeline(
            last_voiced_at=speculation.paused.last_voiced_at, stt_done_at=self.clock()
        )
        preemption = _Preemption(
            speculation, self.voice.orchestrator.snapshot(), asyncio.Event(), timeline
        )
        self._preemption = preemption
        self.voice.speaker.hold()
        self._count("preempted")
        self._start_turn(self._run_preemptive(preemption, transcript.text), name="turn")
        preemption.task = self._turn

    async def _run_preemptive(self, preemption: _Preemption, text: str) -> None:
        try:
            await self.voice.answer_text(text, preemption.timeline, preemption.confirmed)
        except asyncio.CancelledError:
            if not preemption.confirmed.is_set():
                self.voice.orchestrator.restore(preemption.snapshot)
            raise

    def _confirm_preemption(self, ended: SpeechEnded) -> bool:
        """The turn ended: a preemptive answer to the same words plays now (True); one to
        words the caller has since added to is undone (False)."""
        preemption, self._preemption = self._preemption, None
        if preemption is None:
            return False
        speculation = preemption.speculation
        if self._speculation is not speculation or not speculation.covers(ended):
            self._preemption = preemption
            self._cancel_preemption()
            return False
        self._speculation = None
        self._count("used")
        transcript = speculation.transcript
        assert transcript is not None
        self.voice.emit(
            "transcript",
            text=transcript.text,
            dropped=transcript.dropped,
            audio_ms=round(transcript.audio_ms),
            stt_ms=round(transcript.compute_ms),
            speculative=True,
        )
        preemption.timeline.confirm_at(ended.detected_at)
        preemption.confirmed.set()
        self.voice.speaker.resume()
        return True

    def _cancel_preemption(self) -> None:
        preemption, self._preemption = self._preemption, None
        if preemption is None:
            return
        self.voice.speaker.clear()
        task = preemption.task
        if task is not None and not task.done():
            task.cancel()  # its coroutine puts the conversation back
        elif not preemption.confirmed.is_set():
            self.voice.orchestrator.restore(preemption.snapshot)
        self._count("preempted_wasted")

    def _take_speculation(self, ended: SpeechEnded) -> Speculation | None:
        """The speculation that heard all of ``ended``'s words, if any (others are wasted)."""
        speculation, self._speculation = self._speculation, None
        if speculation is None:
            return None
        if not speculation.covers(ended):
            self._waste(speculation)
            return None
        return speculation

    def _on_speech_ended(self, event: SpeechEnded) -> None:
        if self._confirm_preemption(event):
            self._emit_speech_end(event)
            return
        speculation = self._take_speculation(event)
        self._emit_speech_end(event)
        self._handle_utterance(event, speculation)

    def _emit_speech_end(self, event: SpeechEnded) -> None:
        self.voice.emit(
            "speech_end",
            duration_ms=round(event.duration_ms),
            forced=event.forced,
            last_voiced_ms=round(event.last_voiced_at * 1000, 1),
        )

    def _handle_utterance(self, event: SpeechEnded, speculation: Speculation | None) -> None:
        if self._carry:  # the words of a turn cut during STT: transcribe them all together
            event = _prepend_audio(self._carry, event)
            self._carry = b""
            self._waste(speculation)
            speculation = None
        if not self.busy or self._interrupted_this_utterance:
            # (when interrupted, interrupt() is already cancelling the old turn)
            self._answer(event, speculation)
            return
        if self.voice.speaker.paused:  # pause_resume: the words decide
            self._settle_pause(event, speculation)
            return
        if self.barge_in_policy == "disabled":
            self._pending = event  # heard after the agent finishes
        # else: too short to interrupt the agent: a cough or a backchannel, not a turn
        self._waste(speculation)

    def _check_barge_in(self) -> None:
        if (
            not self.vad.speaking
            or self._interrupted_this_utterance
            or not self.busy
            or self._preemption is not None  # the busy turn answers these very words
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

    def _settle_pause(self, utterance: SpeechEnded, speculation: Speculation | None) -> None:
        """The sound that paused the agent has ended: resume if its words are a backchannel or
        nothing, else cut the agent off and answer them."""
        if speculation is not None:
            self._count("used")
            transcript = speculation.task
        else:
            transcript = asyncio.create_task(self.voice.transcriber.transcribe(utterance.audio))
        if self._settling is not None:
            self._settling.cancel()
        self._settling = asyncio.create_task(
            self._settle(utterance, transcript), name=f"settle:{self.id}"
        )

    async def _settle(self, utterance: SpeechEnded, transcript: asyncio.Task[Transcript]) -> None:
        try:
            heard: Transcript | None = await transcript
        except Exception:
            log.exception("transcribing a sound over the agent failed")
            heard = None
        speaker = self.voice.speaker
        if self._closed or not speaker.paused or self.vad.speaking:
            return  # already cut off, or the caller is talking again: that utterance decides
        spoken_ms = (utterance.last_voiced_at - utterance.started_at) * 1000
        if heard is None or is_listener_noise(heard, spoken_ms):
            speaker.resume()
            self.resumes += 1
            self.voice.emit("resumed", text=heard.text if heard else "")
            return
        self._interrupted_this_utterance = True
        self.interrupt()
        self._start_turn(
            self.voice.answer_utterance(utterance, transcript), name="turn", audio=utterance.audio
        )

    # -- turns ---------------------------------------------------------------------------------

    def interrupt(self) -> asyncio.Task[None] | None:
        """Stop the agent now: clear the speaker, cancel the turn. Returns the cancelled task
        (await it to know the history is settled), or None if nothing was running."""
        if not self.busy:
            return None
        assert self._turn is not None
        self._preemption = None
        cleared = self.voice.speaker.clear()
        task = self._turn
        if self._turn_audio and not self.voice.turn_started:
            self._carry = self._turn_audio  # cut during STT: its words join the next utterance
        task.cancel()
        self.barge_ins += 1
        self.voice.emit(
            "interrupted",
            heard=self.voice.heard,
            cut_ms=round(sum(r.played_ms for r in cleared)),
        )
        self._set_state("listening")
        return task

    def _answer(self, utterance: SpeechEnded, speculation: Speculation | None = None) -> None:
        transcript = None
        if speculation is not None:
            self._count("used")
            transcript = speculation.task
        self._start_turn(
            self.voice.answer_utterance(utterance, transcript, speculative=transcript is not None),
            name="turn",
            audio=utterance.audio,
        )

    def _start_turn(self, work: Coroutine[Any, Any, None], name: str, audio: bytes = b"") -> None:
        previous = self._turn
        self._turn_audio = audio
        self.turns += name == "turn"
        self._turn = asyncio.create_task(
            self._run_turn(work, previous), name=f"{name}:{self.id}:{self.turns}"
        )

    async def _run_turn(
        self, work: Coroutine[Any, Any, None], previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None and not previous.done():
            with contextlib.suppress(asyncio.CancelledError):
                await previous  # one turn at a time: let the cancelled one settle its history
        self._set_state("thinking")
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("turn failed in session %s", self.id)
            self.voice.emit("error", source="turn", message=f"{type(exc).__name__}: {exc}")
        finally:
            if asyncio.current_task() is self._turn:
                self._set_state("listening")
                self._start_pending()

    def _start_pending(self) -> None:
        if self._pending is not None and not self._closed:
            pending, self._pending = self._pending, None
            self._answer(pending)

    def _refresh_state(self) -> None:
        if self.busy and self._preemption is None:
            self._set_state("speaking" if self.voice.speaker.busy else "thinking")

    async def close(self) -> None:
        """End the call: cancel any turn and wait for it, and free the speaker's native
        resources at once (the call's objects are reference cycles, freed only when the garbage
        collector gets to them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        if self._speculation is not None:
            self._speculation.discard()
            self._speculation = None
        if self._settling is not None:
            self._settling.cancel()
        if self._digit_timer is not None:
            self._digit_timer.cancel()
        if self._turn is not None and not self._turn.done():
            self.voice.speaker.clear()
            self._turn.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._turn
        self.voice.speaker.close()
        self._set_state("closed")


def _prepend_audio(audio: bytes, event: SpeechEnded) -> SpeechEnded:
    return SpeechEnded(
        audio=audio + event.audio,
        started_at=event.started_at,
        last_voiced_at=event.last_voiced_at,
        detected_at=event.detected_at,
        forced=event.forced,
    )
