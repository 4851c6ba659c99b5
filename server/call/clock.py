"""Call limits every transport enforces the same way: maximum duration, idle timeout, and an
agent that has lost its voice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .events import VoiceEvent

__all__ = ["CallClock"]


class CallClock:
    """When a call started and when the caller last did something.

    Feed it the call's events (:meth:`observe`) and any other sign of life (:meth:`touch`);
    :meth:`watch` hangs the call up when it runs past ``max_call_s``, stays idle (no caller
    speech, the agent quiet) for ``idle_timeout_s``, or the agent can no longer speak (a
    ``voice_lost`` event: not even the fallback line could be synthesized), since a call the
    agent cannot answer is better ended, so a phone gateway can fail over.
    """

    def __init__(self, max_call_s: float, idle_timeout_s: float, period_s: float = 1.0) -> None:
        self.max_call_s = max_call_s
        self.idle_timeout_s = idle_timeout_s
        self.period_s = period_s
        self.started_at = time.monotonic()
        self.last_activity = self.started_at
        self.voice_lost = False

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def observe(self, event: VoiceEvent) -> None:
        if event.type == "speech_start":
            self.touch()
        elif event.type == "voice_lost":
            self.voice_lost = True

    def verdict(self, agent_busy: bool, now: float | None = None) -> str | None:
        """Why the call must end now, or None."""
        now = time.monotonic() if now is None else now
        if self.voice_lost:
            return "the agent cannot speak"
        if now - self.started_at >= self.max_call_s:
            return "maximum call duration reached"
        if now - self.last_activity >= self.idle_timeout_s and not agent_busy:
            return "idle timeout"
        return None

    async def watch(
        self,
        agent_busy: Callable[[], bool],
        hangup: Callable[[str], Awaitable[None]],
        extra: Callable[[float], str | None] = lambda now: None,
    ) -> None:
        """Check every ``period_s``; on a verdict (or ``extra(now)``'s), hang up and return."""
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            reason = self.verdict(agent_busy(), now) or extra(now)
            if reason is not None:
                await hangup(reason)
                return
