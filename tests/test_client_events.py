"""What browser callers are told of a call: errors in fixed words per source, never the
exception's text; a tool call with its arguments."""

from __future__ import annotations

import json
from typing import Any

import pytest

from media import Speaker
from playbooks import PlaybookOrchestrator, load_playbook
from server.call.events import (
    EVENT_DATA,
    MAX_ARGUMENTS_CHARS,
    VOICE_EVENT_TYPES,
    VoiceEvent,
    tool_arguments,
)
from server.call.voice import VoicePlaybookOrchestrator
from server.transports.client_events import CLIENT_ERRORS, client_view
from tests.conftest import EXAMPLES, REPO
from tests.support.calls import synthesizer, transcriber


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


def _tool_call_start(arguments: str) -> dict[str, Any]:
    """The client view of the ``tool_call_start`` a real voice orchestrator makes of the
    orchestrator's event for a call with ``arguments``."""
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "support.yaml"), None)
    events: list[VoiceEvent] = []
    VoicePlaybookOrchestrator(
        orchestrator, transcriber(), synthesizer(), Speaker(16000), events.append
    )
    call = {"id": "c1", "name": "lookup_order", "arguments": arguments}
    orchestrator.emit("tool_call_start", call=call)
    (event,) = events
    view = client_view(event)
    assert (view["type"], view["id"], view["name"]) == ("tool_call_start", "c1", "lookup_order")
    return view


def test_a_tool_call_start_carries_its_arguments_as_an_object() -> None:
    view = _tool_call_start('{"order_id": "A1001", "items": [1, 2]}')
    assert view["arguments"] == {"order_id": "A1001", "items": [1, 2]}
    assert json.loads(json.dumps(view)) == view  # as a client reads it back


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", '"A1001"', '{"a": NaN}', ""])
def test_arguments_that_are_no_json_object_are_carried_as_written(raw: str) -> None:
    view = _tool_call_start(raw)
    assert view["arguments"] == raw
    json.loads(json.dumps(view))  # NaN would not come back: it is no JSON


def test_long_arguments_are_cut_to_their_first_characters() -> None:
    long = {"note": "é" * 3000}
    view = _tool_call_start(json.dumps(long))
    cut = view["arguments"]
    assert isinstance(cut, str)
    assert len(cut) == MAX_ARGUMENTS_CHARS
    assert cut == json.dumps(long, ensure_ascii=False)[: MAX_ARGUMENTS_CHARS - 3] + "..."
    exact = {"note": "x" * (MAX_ARGUMENTS_CHARS - len('{"note": ""}'))}
    assert tool_arguments(json.dumps(exact)) == exact  # at the limit: kept whole
    assert tool_arguments("y" * 2500) == "y" * 1997 + "..."


def test_every_kind_of_voice_event_has_a_payload_type_and_is_documented_for_clients() -> None:
    assert set(EVENT_DATA) == VOICE_EVENT_TYPES
    voice_md = (REPO / "docs" / "voice.md").read_text()
    section = voice_md.split("## Events and per-turn metrics", 1)[1].split("\n## ", 1)[0]
    assert {kind for kind in VOICE_EVENT_TYPES if f"`{kind}`" not in section} == set()
