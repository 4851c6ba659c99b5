"""A call's event feed (``server/transports/event_feed.py``): what ``GET /calls/{id}/events``
streams, for every transport (``TransportCall.events``)."""

from __future__ import annotations

from functools import partial
from typing import Any

from playbooks import load_playbooks
from server.config.server import ServerConfig
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.runtime.registry import CallRegistry
from server.transports.base import TransportCall
from server.transports.client_events import CLIENT_ERRORS
from server.transports.event_feed import EventFeed, FeedQueue
from tests.conftest import EXAMPLES
from tests.support.calls import synthesizer, transcriber


def _drain(queue: FeedQueue) -> list[dict[str, Any] | None]:
    items: list[dict[str, Any] | None] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_listener_gets_the_backlog_then_each_new_item_then_the_end() -> None:
    feed = EventFeed()
    feed.publish({"n": 1})
    early = feed.listen()
    feed.publish({"n": 2})
    late = feed.listen()
    feed.publish({"n": 3})
    feed.end()
    feed.end()  # idempotent: one end each
    feed.publish({"n": 4})  # ignored once ended
    assert _drain(early) == [{"n": 1}, {"n": 2}, {"n": 3}, None]
    assert _drain(late) == [{"n": 1}, {"n": 2}, {"n": 3}, None]
    assert _drain(feed.listen()) == [{"n": 1}, {"n": 2}, {"n": 3}, None]  # after the end


def test_the_backlog_keeps_the_latest_items_and_a_listener_can_leave() -> None:
    feed = EventFeed(backlog=2)
    for n in range(5):
        feed.publish({"n": n})
    queue = feed.listen()
    assert _drain(queue) == [{"n": 3}, {"n": 4}]
    mark = feed.published
    feed.unlisten(queue)
    feed.publish({"n": 5})
    assert feed.since(mark) == [{"n": 5}]  # what came after a mark, counted past the backlog
    assert feed.since(0) == [{"n": 4}, {"n": 5}]  # as much of it as is kept
    feed.end()
    assert _drain(queue) == []


async def test_every_call_feeds_its_events_as_clients_see_them_then_its_hangup() -> None:
    """A bare ``TransportCall``: the session's events reach the feed whatever the transport (an
    error with its fixed words only), the hang-up adds its reason, and the feed ends once the
    call has ended."""
    engines = Engines(
        transcriber(), synthesizer(), load_playbooks(EXAMPLES), LLMProvider.serving(None)
    )
    registry = CallRegistry(ServerConfig(rate_limit_per_min=0), engines, lambda _event: None)
    call = registry.open(partial(TransportCall, registry), rate=16000, playbook="support")
    assert registry.get(call.id) is call
    following = call.events.listen()
    call.session.voice.emit("error", source="llm", message="http://10.0.0.5 refused")
    call.session.dtmf("5")
    await call.hangup("test over")
    assert registry.get(call.id) is None
    items = _drain(following)
    assert items[-1] is None
    seen = [item for item in items if item is not None]
    (error,) = [item for item in seen if item["type"] == "error"]
    assert error["message"] == CLIENT_ERRORS["llm"]
    assert "10.0.0.5" not in str(seen)
    assert [item["digit"] for item in seen if item["type"] == "dtmf"] == ["5"]
    hangup = seen[-1]
    assert (hangup["type"], hangup["reason"]) == ("hangup", "test over")
    assert isinstance(hangup["t_ms"], float)
    assert call.events.ended
    assert _drain(call.events.listen()) == items  # whole for a late listener too
