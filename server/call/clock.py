"""Call limits every transport enforces the same way: maximum duration, a caller gone quiet,
and an agent that has lost its voice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from playbooks.models import Idle

from .events import VoiceEvent

__all__ = ["IDLE_GOODBYE", "CallClock", "IdleStep"]

IdleStep = Literal["prompt", "goodbye"]
IDLE_GOODBYE = "idle: no answer to the prompt"
"""The hang-up reason after a playbook's idle prompt went unanswered."""


class CallClock:
    """When a call started and when the caller last did something.

    Feed it the call's events (:meth:`observe`) and any other sign of life (:meth:`touch`);
    :meth:`watch` hangs the call up when it runs past ``max_call_s``, or the agent can no longer
    speak (a ``voice_lost`` event: not even the fallback line could be synthesized, and a call
    the agent cannot answer is better ended, so a phone gateway can fail over), or the caller
    stays quiet (no caller speech, the agent quiet too):

    - without ``idle`` (the playbook's setting), for ``idle_timeout_s``: hung up without a word;
    - with it, after ``idle.prompt_after_s`` the agent says the prompt ("Are you still
      there?"), and after ``idle.hangup_after_s`` more (from the prompt's end) the goodbye, then
      hangs up (:data:`IDLE_GOODBYE`). Caller speech starts the count again.
    """

    def __init__(
        self,
        max_call_s: float,
        idle_timeout_s: float,
        period_s: float = 1.0,
        idle: Idle | None = None,
    ) -> None:
        self.max_call_s = max_call_s
        self.idle_timeout_s = idle_timeout_s
        self.idle = idle
        self.period_s = period_s
        self.started_at = time.monotonic()
        self.last_activity = self.started_at
        self.prompted = False
        """The idle prompt was said and the caller has not spoken since."""
        self.voice_lost = False

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def observe(self, event: VoiceEvent) -> None:
        if event.type == "speech_start":
            self.touch()
            self.prompted = False
        elif event.type == "voice_lost":
            self.voice_lost = True

    def verdict(self, agent_busy: bool, now: float | None = None) -> str | None:
        """Why the call must end now without a word, or None."""
        now = time.monotonic() if now is None else now
        if self.voice_lost:
            return "the agent cannot speak"
        if now - self.started_at >= self.max_call_s:
            return "maximum call duration reached"
        if self.idle is None and now - self.last_activity >= self.idle_timeout_s:
            return None if agent_busy else "idle timeout"
        return None

    def idle_step(self, agent_busy: bool, now: float | None = None) -> IdleStep | None:
        """What the playbook's ``idle`` setting says to do now: the prompt, the goodbye, or
        nothing (no setting, the agent is talking, or the caller was heard recently)."""
        idle = self.idle
        if idle is None or agent_busy:
            return None
        quiet = (time.monotonic() if now is None else now) - self.last_activity
        if not self.prompted:
            return "prompt" if quiet >= idle.prompt_after_s else None
        return "goodbye" if quiet >= idle.hangup_after_s else None

    async def watch(
        self,
        agent_busy: Callable[[], bool],
        hangup: Callable[[str], Awaitable[None]],
        extra: Callable[[float], str | None] = lambda now: None,
        say: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """Check every ``period_s``; on a verdict (or ``extra(now)``'s), hang up and return. The
        idle prompt and goodbye are said with ``say`` (which returns once they are played)."""
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            reason = self.verdict(agent_busy(), now) or extra(now)
            if reason is not None:
                await hangup(reason)
                return
            step = self.idle_step(agent_busy(), now)
            if step is None or self.idle is None:
                continue
            line = self.idle.prompt if step == "prompt" else self.idle.goodbye
            if line is not None and say is not None:
                await say(line)
            if step == "goodbye":
                await hangup(IDLE_GOODBYE)
                return
            self.prompted = True
            self.touch()  # the goodbye counts from the prompt's end
