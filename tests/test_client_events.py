"""What browser callers are told of errors: fixed words per source, never the exception's text."""

from __future__ import annotations

import pytest

from server.call.events import VoiceEvent
from server.transports.client_events import CLIENT_ERRORS, client_view


@pytest.mark.parametrize("source", sorted(CLIENT_ERRORS))
def test_an_error_shows_the_fixed_message_of_its_source(source: str) -> None:
    raw = "ConnectError: http://10.0.0.5:8000/v1 refused; Traceback in /srv/app/tools.py"
    event = VoiceEvent("error", {"source": source, "message": raw, "status": 500}, t=1.5)
    assert client_view(event) == {
        "type": "error",
        "t_ms": 1500.0,
        "source": source,
        "message": CLIENT_ERRORS[source],
    }


def test_an_error_keeps_a_short_tool_or_worker_name_only() -> None:
    event = VoiceEvent("error", {"source": "tool", "message": "x", "tool": "lookup_order"}, t=0)
    assert client_view(event)["tool"] == "lookup_order"
    long = VoiceEvent("error", {"source": "worker", "message": "x", "worker": "w" * 65}, t=0)
    assert "worker" not in client_view(long)
    odd = VoiceEvent("error", {"source": "tool", "message": "x", "tool": {"a": 1}}, t=0)
    assert "tool" not in client_view(odd)


@pytest.mark.parametrize("source", [None, "database", 3])
def test_an_error_of_another_source_is_a_server_error(source: object) -> None:
    event = VoiceEvent("error", {"source": source, "message": "secret detail"}, t=0)
    view = client_view(event)
    assert (view["source"], view["message"]) == ("server", "the server hit an error")


def test_other_events_are_sent_as_they_are() -> None:
    event = VoiceEvent("transcript", {"text": "Where is my order?", "final": True}, t=2)
    assert client_view(event) == event.to_dict()
