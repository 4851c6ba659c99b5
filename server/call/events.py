"""Voice events for clients: JSON-able facts about a call, each with a monotonic timestamp, and
the one translation of the playbook engine's events into them (:func:`voice_event_of`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from playbooks import OrchestratorEvent

__all__ = [
    "MAX_ARGUMENTS_CHARS",
    "VOICE_EVENT_TYPES",
    "VoiceEvent",
    "VoiceEventHandler",
    "VoiceEventType",
    "tool_arguments",
    "voice_event_of",
]

VoiceEventType = Literal[
    "speech_start",
    "speech_end",
    "transcript",
    "stage_change",
    "language_change",
    "tool_call_start",
    "tool_call_end",
    "delegation_start",
    "delegation_end",
    "transfer_started",
    "transfer_answered",
    "transfer_requested",
    "transfer_failed",
    "agent_sentence",
    "tts_start",
    "tts_end",
    "interrupted",
    "paused",
    "resumed",
    "speculation",
    "turn_metrics",
    "state",
    "dtmf",
    "error",
    "voice_lost",
    "recording_failed",
]

VOICE_EVENT_TYPES: frozenset[str] = frozenset(get_args(VoiceEventType))
"""Every kind of voice event, read from the type: tests and clients check against it."""

MAX_ARGUMENTS_CHARS = 2000
"""The most of a tool call's arguments a ``tool_call_start`` event carries, as JSON text."""


@dataclass(frozen=True)
class VoiceEvent:
    type: VoiceEventType
    data: dict[str, Any] = field(default_factory=dict)
    t: float = field(default_factory=time.monotonic)
    """Monotonic clock seconds when the fact happened."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "t_ms": round(self.t * 1000, 1), **self.data}


VoiceEventHandler = Callable[[VoiceEvent], None]


def voice_event_of(
    event: OrchestratorEvent, at: float, *, voice: str | None = None
) -> VoiceEvent | None:
    """The voice event a client sees for the engine's ``event`` (None: clients do not see it),
    stamped ``at`` (monotonic seconds). ``voice``: the voice in effect after a stage or
    language change. Calls and ``vocable test``'s text mode both translate through here."""
    data = event.data
    payload: dict[str, Any]
    kind: VoiceEventType
    match event.type:
        case "tool_call_start":
            call = data["call"]
            kind = "tool_call_start"
            payload = {
                "name": call["name"],
                "id": call["id"],
                "arguments": tool_arguments(call["arguments"]),
            }
        case "tool_call_complete":
            call = data["call"]
            kind = "tool_call_end"
            payload = {
                "name": call["name"],
                "id": call["id"],
                "error": data["error"],
                "result": tool_arguments(data["result"]),
                "duration_ms": data["duration_ms"],
            }
        case "stage_entered":
            stage = data["stage"]
            kind = "stage_change"
            payload = {"stage": stage["id"], "name": stage["name"], "voice": voice}
        case "language_changed":
            kind, payload = "language_change", {"language": data["language"], "voice": voice}
        case "delegation_start" | "delegation_end":
            kind = event.type
            payload = {"workers": data["workers"], "mode": data["mode"]}
        case "transfer_started" | "transfer_answered" | "transfer_requested" | "transfer_failed":
            kind, payload = event.type, dict(data)
        case "error":
            tool = {"tool": data["tool"]} if "tool" in data else {}
            kind = "error"
            payload = {"source": data.get("source", "llm"), "message": data["message"], **tool}
        case _:
            return None
    return VoiceEvent(kind, payload, at)


def tool_arguments(raw: str) -> dict[str, Any] | str:
    """A tool call's arguments (or result) as its ``tool_call_start`` (``tool_call_end``) event
    carries them: the JSON object the LLM wrote, else (not JSON, or JSON but not an object) its
    raw text. When the object's JSON, or the text, is longer than MAX_ARGUMENTS_CHARS, it is
    cut to that many characters, the last three ``...``: a string."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
        text = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else raw
    except (ValueError, RecursionError):
        value = text = raw
    if len(text) > MAX_ARGUMENTS_CHARS:
        return text[: MAX_ARGUMENTS_CHARS - 3] + "..."
    return value if isinstance(value, dict) else raw


def _no_constant(name: str) -> Any:
    """``NaN`` and ``Infinity`` are not JSON: clients could not parse them back."""
    raise ValueError(f"{name} is not JSON")
