"""A call's events for the clients following it (``GET /calls/{id}/events``): each listener gets
the events so far, then every new one as it is published, then the end.

Every call has one (:attr:`TransportCall.events <server.transports.base.TransportCall.events>`):
its voice events as the caller sees them (:func:`~.client_events.client_view`), plus what its
transport adds (an outbound call's ``call`` states). The feed ends once the call has ended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, TypeAlias

__all__ = ["BACKLOG", "EventFeed", "FeedQueue"]

BACKLOG = 500
"""Events kept for a client that subscribes late (the first ones of a call matter most)."""

FeedQueue: TypeAlias = asyncio.Queue[dict[str, Any] | None]
"""What a listener reads: JSON objects, then None once the feed has ended."""


class EventFeed:
    """The last ``backlog`` events of one call, and the queues of those listening to it."""

    def __init__(self, backlog: int = BACKLOG) -> None:
        self._backlog: deque[dict[str, Any]] = deque(maxlen=backlog)
        self._listeners: set[FeedQueue] = set()
        self.ended = False
        """Set by :meth:`end`: nothing more is published."""
        self.published = 0
        """Events published so far."""

    def since(self, count: int) -> list[dict[str, Any]]:
        """The kept events (the last ``backlog``) published after the first ``count``, oldest
        first (``count`` from an earlier :attr:`published`)."""
        return list(self._backlog)[max(0, len(self._backlog) - (self.published - count)) :]

    def publish(self, item: dict[str, Any]) -> None:
        """Keep ``item`` (a JSON object) and pass it to every listener; ignored once ended."""
        if self.ended:
            return
        self._backlog.append(item)
        self.published += 1
        for queue in self._listeners:
            queue.put_nowait(item)

    def listen(self) -> FeedQueue:
        """A new listener's queue: the kept events first, then each one published, then None
        (at once when the feed has already ended). Call :meth:`unlisten` when done with it."""
        queue: FeedQueue = asyncio.Queue()
        for item in self._backlog:
            queue.put_nowait(item)
        if self.ended:
            queue.put_nowait(None)
        else:
            self._listeners.add(queue)
        return queue

    def unlisten(self, queue: FeedQueue) -> None:
        """Stop passing events to ``queue`` (a listener that left early)."""
        self._listeners.discard(queue)

    def end(self) -> None:
        """No more events: every listener, and any later one, reads None after what it has.
        Idempotent."""
        if self.ended:
            return
        self.ended = True
        for queue in self._listeners:
            queue.put_nowait(None)
        self._listeners.clear()
