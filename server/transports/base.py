"""What every call shares, whatever carries it: its id and registry slot, its clock, its tasks,
and one way to end.

Every call's events go to its :attr:`~TransportCall.events` feed, as callers see them, whatever the
transport (``GET /calls/{id}/events`` follows it). A transport subclasses :class:`TransportCall`
and fills in the hooks: :meth:`~TransportCall.on_event` (what the peer is told of the call's
events), :meth:`~TransportCall.ending` (the first word of a hang-up: a BYE, a ``hangup`` event),
:meth:`~TransportCall.close_transport` (closing the socket or peer connection) and
:meth:`~TransportCall.release_resources` (ports and the like). The base guarantees the order and
that each step runs once, whatever fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar

from playbooks.transfer import TransferOutcome, TransferRequest
from server.call.clock import CallClock
from server.call.events import VoiceEvent
from server.call.session import Session
from server.runtime.registry import CallRegistry

from .client_events import client_view
from .event_feed import EventFeed

__all__ = ["TransportCall"]


class TransportCall:
    """One admitted call, built by :meth:`CallRegistry.open` around the session it made first
    (whose events reach :meth:`emit` and whose transfers reach :meth:`transfer`).

    :meth:`hangup` ends the call exactly once, whoever asks (the peer, the watchdog, the HTTP
    API, a server shutdown), in this order:

    1. :meth:`ending` tells the peer (errors are logged, never raised);
    2. the session is closed, then the call's tasks (:meth:`spawn`) are cancelled;
    3. the :attr:`events` feed gets ``{"type": "hangup", "t_ms", "reason"}`` and the registry
       slot is released, even when step 1 or 2 raised or was cancelled: a call can never hold
       a slot it no longer uses;
    4. :meth:`close_transport` closes the connection, in the background when
       :attr:`close_in_background` says so; then :meth:`release_resources` gives back what the
       connection used (even when closing raised), the :attr:`events` feed ends, and
       :attr:`ended` is set.
    """

    transport: ClassVar[str] = "call"
    """The transport's name in log lines (``WebRTC``, ``SIP``...)."""

    def __init__(self, registry: CallRegistry, call_id: str, session: Session) -> None:
        self.registry = registry
        self.id = call_id
        self.session = session
        config = registry.config
        idle = session.voice.orchestrator.engine.playbook.spec.idle
        self.clock = CallClock(config.max_call_s, config.idle_timeout_s, idle=idle)
        self.ended = asyncio.Event()
        """Set once the call has ended and everything it held is freed."""
        self.hung_up = False
        """Set as :meth:`hangup` starts: the call no longer serves the caller."""
        self.log = logging.getLogger(type(self).__module__)
        """The transport module's logger: a call's lines are filtered like its transport's."""
        self.events = EventFeed()
        """The call's events as clients see them (:func:`client_view`), then a ``hangup`` item
        with the reason; it ends once the call has ended."""
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- while the call runs -------------------------------------------------------------------

    def emit(self, event: VoiceEvent) -> None:
        """The session's event sink: the clock sees every event, then the :attr:`events` feed
        (as the client view), then the transport."""
        self.clock.observe(event)
        self.events.publish(client_view(event))
        self.on_event(event)

    def on_event(self, event: VoiceEvent) -> None:
        """Tell the peer about ``event`` if the transport can (default: nothing)."""

    def agent_cleared(self) -> None:
        """The agent's audio queued at the speaker was dropped (a barge-in): a transport whose
        peer buffers audio tells it to drop its own (default: nothing)."""

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``work`` as one of the call's tasks (named ``name:ID``), cancelled at hang-up."""
        task = asyncio.create_task(work, name=f"{name}:{self.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def watch(self, extra: Callable[[float], str | None] | None = None) -> None:
        """Start the call clock's watchdog: idle timeout (or the playbook's idle prompt and
        goodbye), maximum length, a lost voice, and ``extra(now)``'s reason when it gives one."""
        watched = self.clock.watch(
            lambda: self.session.busy, self.hangup, extra or _no_reason, self._say
        )
        self.spawn(watched, "watchdog")

    async def _say(self, text: str) -> None:
        """Say ``text`` outside a turn (the idle prompt), once the agent is quiet; returns
        once it has been played or cut short."""
        answer = self.session.say(text)
        if answer is not None:
            await asyncio.wait({answer.task})  # cut short by a barge-in, it ends all the same

    # -- transfers -------------------------------------------------------------------------------

    def transfer_problem(self, request: TransferRequest) -> str | None:
        """Why this call cannot be put through to ``request.destination`` (default: the
        transport has no way to), or None when it can be tried."""
        return f"{self.transport} calls cannot be transferred"

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        """Put the caller through to ``request.destination`` (the agent's ``say`` line has been
        played); the outcome, never an exception but for cancellation. On success the
        transport ends the agent's leg, or relays audio between the caller and the person."""
        return TransferOutcome.failed("not_supported", self.transfer_problem(request))

    # -- ending ----------------------------------------------------------------------------------

    async def hangup(self, reason: str) -> None:
        """End the call (see the class docstring for the order). Idempotent; never raises but
        for cancellation."""
        if self.hung_up:
            return
        self.hung_up = True
        self.log.info("%s call %s ended: %s", self.transport, self.id, reason)
        try:
            with _logged(self.log, self.id, "telling the peer"):
                self.ending(reason)
            with _logged(self.log, self.id, "closing the session"):
                await self.session.close()
            current = asyncio.current_task()
            for task in list(self._tasks):
                if task is not current:
                    task.cancel()
        finally:
            self.events.publish({"type": "hangup", "t_ms": _now_ms(), "reason": reason})
            self.registry.release(self, reason)
        if self.close_in_background:
            self.registry.see_off(self._close(reason), f"goodbye:{self.id}")
        else:
            await self._close(reason)

    def ending(self, reason: str) -> None:
        """The first thing a hang-up does: tell the peer why (default: nothing)."""

    @property
    def close_in_background(self) -> bool:
        """Whether :meth:`close_transport` may wait on the peer (the registry then waits for it
        at shutdown) rather than hold up :meth:`hangup`."""
        return False

    async def close_transport(self, reason: str) -> None:
        """Close the connection to the peer (default: nothing)."""

    def release_resources(self) -> None:
        """Give back what the closed connection used, such as its ports (default: nothing)."""

    async def _close(self, reason: str) -> None:
        try:
            with _logged(self.log, self.id, "closing the connection"):
                await self.close_transport(reason)
        finally:
            try:
                with _logged(self.log, self.id, "releasing its resources"):
                    self.release_resources()
            finally:
                self.events.end()
                self.ended.set()


def _no_reason(_now: float) -> str | None:
    return None


def _now_ms() -> float:
    """The monotonic clock in ms, as events' ``t_ms``."""
    return round(time.monotonic() * 1000, 1)


@contextlib.contextmanager
def _logged(log: logging.Logger, call_id: str, step: str) -> Iterator[None]:
    """Log an exception of ``step`` and go on: a hang-up completes whatever one step does."""
    try:
        yield
    except Exception:
        log.exception("call %s: %s failed during the hang-up", call_id, step)
