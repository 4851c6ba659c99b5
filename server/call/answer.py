"""One answer of the agent (the greeting, a spoken or typed turn, a preemptive answer): a handle
that says where the answer stands, keeps the call's speaker in step with it, and can be awaited.

The model is livekit's ``voice/speech_handle.py``. The session makes one handle per turn task and
acts on the current one only; every change of the speaker's hold or pause goes through it, so the
speaker cannot say one thing and the answer another:

===========  ==========  ===================================================================
state        speaker     reached by
===========  ==========  ===================================================================
held         held        made for a speculative transcript (a preemptive answer): its audio
                         waits until the end of the caller's turn confirms the words
playing      plays       made for anything else; a held answer confirmed; a paused one resumed
paused       paused      the caller made a sound over it (``pause_resume``)
interrupted  cleared     cut short: a barge-in, typed text, the caller going on after a
                         preemptive answer started, the turn ending on other words, the call
                         closing
done         as it was   its task ended by itself (a held one: once confirmed)
===========  ==========  ===================================================================

Moves: ``held -> playing | done | interrupted``, ``playing <-> paused``, ``playing | paused ->
done | interrupted``; ``interrupted`` and ``done`` are final. A held answer whose task ends
first (it had nothing to say) stays held until the turn is confirmed or undone. Any other move is
a bug: it is logged as an error, with the stack, and made anyway.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Coroutine, Generator
from typing import Any, Literal

from media import Speaker
from media.speaker import PlaybackResult

from .preemption import Preemption

__all__ = ["Answer", "AnswerKind", "AnswerState"]

log = logging.getLogger(__name__)

AnswerKind = Literal["greeting", "line", "spoken", "typed", "preemptive"]
"""The greeting, a line said outside a turn (an idle prompt), or an answer to a turn."""


class AnswerState(enum.StrEnum):
    HELD = "held"
    PLAYING = "playing"
    PAUSED = "paused"
    INTERRUPTED = "interrupted"
    DONE = "done"


_MOVES: dict[AnswerState, frozenset[AnswerState]] = {
    AnswerState.HELD: frozenset({AnswerState.PLAYING, AnswerState.DONE, AnswerState.INTERRUPTED}),
    AnswerState.PLAYING: frozenset({AnswerState.PAUSED, AnswerState.DONE, AnswerState.INTERRUPTED}),
    AnswerState.PAUSED: frozenset({AnswerState.PLAYING, AnswerState.DONE, AnswerState.INTERRUPTED}),
    AnswerState.INTERRUPTED: frozenset(),
    AnswerState.DONE: frozenset(),
}

LIVE = frozenset({AnswerState.HELD, AnswerState.PLAYING, AnswerState.PAUSED})
"""The states of an answer not yet over (one that can still be cut short)."""


class Answer:
    """One answer and its turn task. ``await answer`` returns once the task has ended, however
    it ended (its history is then settled); it never raises the task's cancellation."""

    def __init__(
        self,
        kind: AnswerKind,
        speaker: Speaker,
        *,
        audio: bytes = b"",
        preemption: Preemption | None = None,
    ) -> None:
        self.kind = kind
        self.audio = audio
        """The caller audio it answers (empty for the greeting and typed text)."""
        self.preemption = preemption
        self._speaker = speaker
        self._task: asyncio.Task[None] | None = None
        self._finished = False
        if preemption is not None:
            speaker.hold()
            self._state = AnswerState.HELD
        else:
            self._state = AnswerState.PLAYING

    def __repr__(self) -> str:
        name = self._task.get_name() if self._task is not None else "unstarted"
        return f"<Answer {self.kind} {self._state} {name}>"

    # -- where it stands -------------------------------------------------------------------------

    @property
    def state(self) -> AnswerState:
        return self._state

    @property
    def held(self) -> bool:
        """A preemptive answer not yet confirmed: the caller has heard none of it."""
        return self._state is AnswerState.HELD

    @property
    def live(self) -> bool:
        """Not yet over: held, playing or paused."""
        return self._state in LIVE

    @property
    def task(self) -> asyncio.Task[None]:
        if self._task is None:
            raise RuntimeError(f"{self!r} was never started")
        return self._task

    def start(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as this answer's task."""
        self._task = asyncio.create_task(work, name=name)

    def done(self) -> bool:
        """Whether its work is over: the task has ended (by itself or cancelled), or is ending
        (:meth:`finish` was called from its cleanup)."""
        return self._finished or (self._task is not None and self._task.done())

    async def wait(self) -> None:
        """Until the task has ended. Cancelling the waiter cancels only the wait."""
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task])

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    # -- moves -------------------------------------------------------------------------------

    def confirm(self) -> None:
        """The end of the turn confirmed a held answer's words: its audio plays from now, its
        waiting tools run."""
        assert self.preemption is not None
        self.preemption.confirmed.set()
        self._move(AnswerState.DONE if self.done() else AnswerState.PLAYING)
        self._speaker.release()

    def pause(self) -> None:
        """The caller made a sound over it: silence, its audio waiting where it stopped."""
        self._move(AnswerState.PAUSED)
        self._speaker.pause()

    def resume(self) -> None:
        """The sound was not a turn: play on from where it paused."""
        self._move(AnswerState.PLAYING)
        self._speaker.resume()

    def interrupt(self) -> list[PlaybackResult]:
        """Cut it short: the speaker is cleared first (that silence is what the caller notices),
        then the task is cancelled. Returns what the clear dropped (empty if already over)."""
        if not self.live:
            return []
        cleared = self._speaker.clear()
        self._move(AnswerState.INTERRUPTED)
        if self._task is not None:
            self._task.cancel()
        return cleared

    def finish(self) -> None:
        """Its task has ended. A playing or paused answer is done (a pause it leaves is lifted,
        so the next answer is heard); a held one waits for its turn to be confirmed or undone;
        an interrupted one stays so."""
        self._finished = True
        if self._state is AnswerState.PAUSED:
            self._speaker.resume()
        if self._state in (AnswerState.PLAYING, AnswerState.PAUSED):
            self._move(AnswerState.DONE)

    def _move(self, state: AnswerState) -> None:
        if state not in _MOVES[self._state]:
            log.error(
                "illegal answer move %s -> %s for %r", self._state, state, self, stack_info=True
            )
        self._state = state
