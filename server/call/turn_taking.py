"""A call's speculative transcription at the caller's pauses, the voice's scores of those
pauses, and when the caller's turn ends (:mod:`.endpointing` has the rules; this module runs
them for one call).

:class:`TurnTaking` holds the pause being transcribed (a :class:`~.endpointing.Speculation`),
starts the decode at each pause and the turn model's scores at ``model_silence_ms`` and
``model_recheck_ms``, says when the silence ends the turn and why, and tallies what became of
each decode (``counts``). What to do with its verdicts (answering, preempting, undoing a
preemptive answer) is the session's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from media import SpeechEnded, SpeechPaused, VadSegmenter
from media.turn_model import TurnModel

from .endpointing import EndpointSettings, Speculation, TurnEnd
from .events import EmitVoiceEvent

__all__ = ["OUTCOMES", "TurnTaking"]

OUTCOMES = ("used", "wasted", "preempted", "preempted_wasted", "skipped")
"""What becomes of a speculative decode: its words became the turn's, or were thrown away;
an answer started on them before the turn ended, or was undone; a decode skipped for the
backlog."""


class TurnTaking:
    """One call's speculation and end of turn. ``on_known(speculation)`` runs when a decode or
    a score comes back (its verdict may be due before the next caller frame); ``emit`` tells
    clients and metrics each outcome (a ``speculation`` event); ``before_discard()`` runs
    before a speculation is thrown away (the session undoes an answer held for its words)."""

    def __init__(
        self,
        call_id: str,
        settings: EndpointSettings,
        vad: VadSegmenter,
        transcriber: Any,
        *,
        configured_pause_ms: int,
        end_silence_ms: int,
        clock: Callable[[], float],
        turn_model: TurnModel | None,
        emit: EmitVoiceEvent,
        on_known: Callable[[Speculation], None],
        before_discard: Callable[[], None],
    ) -> None:
        self.id = call_id
        self.settings = settings
        self.vad = vad
        self.transcriber = transcriber
        """The call's speech-to-text (``transcribe``, ``backlog``, ``has_idle_worker``)."""
        self.configured_pause_ms = configured_pause_ms
        self.end_silence_ms = end_silence_ms
        """The silence that ends an utterance with no words under way."""
        self.clock = clock
        self.turn_model = turn_model
        self._emit = emit
        self._on_known = on_known
        self._before_discard = before_discard
        self.speculation: Speculation | None = None
        """The latest pause's decode (and scores), while it may still become the turn's."""
        self.skipped_pause: SpeechPaused | None = None
        """The pause whose decode was skipped for the backlog, while the caller stays silent:
        its decode starts as soon as the backlog clears."""
        self.turn_end: TurnEnd | None = None
        """Why the utterance being ended ends (told in its ``speech_end``)."""
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def pause_ms(self) -> int:
        """The pause that starts a speculative decode: ``quick_pause_ms`` while a Whisper
        worker is idle of other calls' decodes, else the VAD's; where the transcriber does not
        tell (a remote one), quick while no decode waits for a worker."""
        quick = self.settings.quick_pause_ms
        configured = self.configured_pause_ms
        if not quick or not configured or quick >= configured:
            return configured
        idle = self.transcriber.has_idle_worker(besides=self.id)
        if idle is None:
            idle = self.transcriber.backlog == 0
        return quick if idle else configured

    def speculate(self, paused: SpeechPaused, *, again: bool = False) -> None:
        """Transcribe the utterance up to ``paused`` (the speculation before is discarded),
        unless decodes already queue (``EndpointSettings.skip_backlog``: counted as
        ``skipped``, and tried ``again`` at each frame of the same pause until the backlog
        clears or the pause ends)."""
        skip = self.settings.skip_backlog
        backlog = self.transcriber.backlog
        if skip and backlog is not None and backlog >= skip:
            if not again:
                self.count("skipped")
                self.skipped_pause = paused
            return
        self.skipped_pause = None
        self.discard()
        decode = self.transcriber.transcribe(
            paused.audio, slack_s=self._slack_s(paused), owner=self.id
        )
        task = asyncio.create_task(decode, name=f"speculation:{self.id}")
        speculation = self.speculation = Speculation(paused, task)
        task.add_done_callback(lambda _: self._on_known(speculation))

    def _slack_s(self, paused: SpeechPaused) -> float:
        """How long a speculative decode's words can wait: until its answer could start at the
        soonest (the complete-turn silence, less the longest preemption lead). Decodes of turns
        that have ended go first."""
        endpoint = self.settings
        lead = max(endpoint.preempt_lead_ms, endpoint.question_lead_ms) if endpoint.preempt else 0
        due = paused.last_voiced_at + max(0, endpoint.complete_silence_ms - lead) / 1000
        return max(0.0, due - self.clock())

    def score_pause(self) -> None:
        """At ``model_silence_ms`` of a pause being transcribed, have the turn model score the
        voice so far, and once more at ``model_recheck_ms`` if it doubted the turn was over
        (the words and the latest score decide together)."""
        speculation = self.speculation
        if self.turn_model is None or speculation is None:
            return
        silent_ms = self.vad.silent_ms
        if speculation.scoring is None and silent_ms >= self.settings.model_silence_ms:
            speculation.scoring = self._start_scoring(speculation)
        elif speculation.recheck_due(silent_ms, self.settings):
            speculation.rechecking = self._start_scoring(speculation)

    def _start_scoring(self, speculation: Speculation) -> asyncio.Task[float]:
        assert self.turn_model is not None
        scoring = asyncio.create_task(
            self.turn_model.completion(self.vad.utterance_audio()), name=f"turn-score:{self.id}"
        )
        scoring.add_done_callback(lambda _: self._on_known(speculation))
        return scoring

    def end(self) -> TurnEnd:
        """The silence that ends the caller's turn now, and why: as the words and the voice
        under way say, or the end silence when nothing is being transcribed."""
        base = self.end_silence_ms
        if self.speculation is None:
            return TurnEnd(base, "silence")
        return self.speculation.turn_end(base, self.settings)

    def preempt_due(self, *, questions_early: bool) -> bool:
        """Whether a preemptive answer to the speculation's words may start now
        (:meth:`Speculation.preempt_due`)."""
        speculation = self.speculation
        return speculation is not None and speculation.preempt_due(
            self.vad.silent_ms, self.end_silence_ms, self.settings, questions_early=questions_early
        )

    def take(self, ended: SpeechEnded) -> Speculation | None:
        """The speculation that heard all of ``ended``'s words, if any (others are wasted)."""
        speculation, self.speculation = self.speculation, None
        if speculation is None:
            return None
        if not speculation.covers(ended):
            self.waste(speculation)
            return None
        return speculation

    def discard(self) -> None:
        """The caller went on (or paused again): the speculation so far is wasted, and an
        answer held for its words undone first."""
        self._before_discard()
        self.waste(self.speculation)
        self.speculation = None

    def waste(self, speculation: Speculation | None) -> None:
        if speculation is not None:
            speculation.discard()
            self.count("wasted")

    def count(self, outcome: str) -> None:
        """Tally a speculation's outcome (``counts``) and tell clients and metrics."""
        self.counts[outcome] += 1
        self._emit("speculation", outcome=outcome)

    def close(self) -> None:
        """The call is over: abandon the decode and scores under way (not counted)."""
        if self.speculation is not None:
            self.speculation.discard()
            self.speculation = None
        self.skipped_pause = None
