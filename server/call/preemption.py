"""Work started on the caller's words before their turn has ended: the LLM reading the turn so
far while they go on speaking, and preemptive answers.

A preemptive answer is started on a speculative transcript (``TurnTaking.preempt_due``) while
the end of the turn is still awaited. Its audio waits in the held speaker, tools with side
effects wait for the confirmation, and the conversation is put back if the caller goes on: the
LLM's time to its first sentence then overlaps the end-of-turn silence. The session owns the
answer and its phase; :class:`Preemptor` decides whether one starts, whether the end of the turn
confirms it, and what undoing it puts back and counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from media import SpeechEnded
from playbooks.orchestrator import Snapshot

from .endpointing import EndpointSettings, Speculation
from .timeline import TurnTimeline
from .turn_taking import TurnTaking
from .voice import VoicePlaybookOrchestrator

__all__ = ["Preemption", "Preemptor"]

log = logging.getLogger(__name__)


@dataclass
class Preemption:
    """What a preemptive answer was started on, and what undoes it."""

    speculation: Speculation
    snapshot: Snapshot
    """The conversation before the answer: put back if the turn turns out otherwise."""
    timeline: TurnTimeline
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the end of the turn confirms the words; tools with side effects wait for it."""


class Preemptor:
    """One call's work ahead of the end of its caller's turns. It counts what it starts, uses
    and wastes in ``turn_taking``'s counts (``preempted``, ``used``, ``preempted_wasted``)."""

    def __init__(
        self,
        session_id: str,
        settings: EndpointSettings,
        voice: VoicePlaybookOrchestrator,
        turn_taking: TurnTaking,
        clock: Callable[[], float],
    ) -> None:
        self._id = session_id
        self._settings = settings
        self._voice = voice
        self._turns = turn_taking
        self._clock = clock
        self.questions_early = True
        """Questions get the early lead (``EndpointSettings.question_lead_ms``) until a
        preemptive answer of this call is undone: its caller goes on after pauses."""
        self._reading_ahead: asyncio.Task[bool] | None = None
        """The LLM reading the words of a pause the caller went on after."""

    def read_ahead(self) -> None:
        """The caller went on after a pause whose words are known: the LLM reads the turn so
        far (``PlaybookOrchestrator.read_ahead``) while they speak, one request at a time. The
        session calls it only while the agent is not answering (its own requests come
        first)."""
        speculation = self._turns.speculation
        transcript = speculation.transcript if speculation is not None else None
        reading = self._reading_ahead
        if transcript is None or (reading is not None and not reading.done()):
            return
        self._reading_ahead = asyncio.create_task(
            self._voice.orchestrator.read_ahead(transcript.text), name=f"read-ahead:{self._id}"
        )

    def due(self) -> Speculation | None:
        """The speculation a preemptive answer is due on at this silence, if any."""
        if not self._turns.preempt_due(questions_early=self.questions_early):
            return None
        return self._turns.speculation

    def begin(
        self, speculation: Speculation, *, silent_ms: int
    ) -> tuple[Preemption, Coroutine[Any, Any, None]] | None:
        """A preemptive answer to ``speculation``'s words: what it starts on, and the work that
        answers them (the session runs it as a held answer). None when preemption is off or
        there are no words."""
        transcript = speculation.transcript
        if not self._settings.preempt or transcript is None or not transcript.text:
            return None
        timeline = TurnTimeline(
            last_voiced_at=speculation.paused.last_voiced_at, stt_done_at=self._clock()
        )
        preemption = Preemption(speculation, self._voice.orchestrator.snapshot(), timeline)
        log.debug("preemptive answer to %r at %d ms of silence", transcript.text, silent_ms)
        self._turns.count("preempted")
        return preemption, self._answer(preemption, transcript.text)

    async def _answer(self, preemption: Preemption, text: str) -> None:
        try:
            await self._voice.answer_text(text, preemption.timeline, preemption.confirmed)
        except asyncio.CancelledError:
            if not preemption.confirmed.is_set():
                self._voice.orchestrator.restore(preemption.snapshot)
            raise

    def confirm(self, preemption: Preemption, ended: SpeechEnded) -> bool:
        """Whether the turn that ``ended`` confirms ``preemption``: it ended on the words the
        answer was started on. If so, those words become the turn's (their ``transcript``
        event) and the answer's timeline is confirmed; if not, the caller must :meth:`undo`
        it."""
        speculation = preemption.speculation
        if self._turns.speculation is not speculation or not speculation.covers(ended):
            return False
        self._turns.speculation = None
        self._turns.count("used")
        transcript = speculation.transcript
        assert transcript is not None
        self._voice.emit_transcript(transcript, speculative=True)
        preemption.timeline.confirm_at(ended.detected_at)
        return True

    def undo(self, preemption: Preemption, *, running: bool) -> None:
        """A held answer was cut (the caller went on, or the turn ended on other words): put
        the conversation back (a ``running`` answer's task does that itself as it unwinds),
        count it wasted, and stop giving this caller's questions the early lead."""
        if not running:
            self._voice.orchestrator.restore(preemption.snapshot)
        log.debug("preemptive answer thrown away: the caller went on")
        self._turns.count("preempted_wasted")
        self.questions_early = False

    def close(self) -> None:
        if self._reading_ahead is not None:
            self._reading_ahead.cancel()
