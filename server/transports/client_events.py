"""What a browser caller is told of its call: the voice events as JSON, except that an ``error``
event carries a fixed message per ``source`` instead of the exception or provider text.

The full text can hold internal details (hosts, file paths, an LLM provider's messages); it goes
to the server log (:class:`CallRegistry` logs every call's errors) and never to the caller.
"""

from __future__ import annotations

from typing import Any

from server.call.events import VoiceEvent

__all__ = ["CLIENT_ERRORS", "client_view"]

CLIENT_ERRORS: dict[str, str] = {
    "llm": "the language model could not answer",
    "intent": "the language model could not classify what was said",
    "tool_call": "the language model asked for a tool call that cannot be made",
    "tool": "a tool failed",
    "worker": "a delegated task failed",
    "stt": "speech recognition failed",
    "tts": "speech synthesis failed",
    "transport": "the connection failed during a turn",
    "turn": "the turn could not be completed",
}
"""The message a caller sees for an error from each source."""
OTHER_ERROR = "the server hit an error"
_NAMES = ("tool", "worker")
"""Fields of an error naming what failed (a playbook's tool or worker), kept if short text."""
MAX_NAME = 64


def client_view(event: VoiceEvent) -> dict[str, Any]:
    """``event`` as sent to the caller; an ``error`` keeps only its time, ``source`` (one of
    CLIENT_ERRORS, else ``server``), the fixed message and the tool or worker name."""
    if event.type != "error":
        return event.to_dict()
    given = event.data.get("source")
    source = given if isinstance(given, str) and given in CLIENT_ERRORS else "server"
    out: dict[str, Any] = {
        "type": "error",
        "t_ms": event.to_dict()["t_ms"],
        "source": source,
        "message": CLIENT_ERRORS.get(source, OTHER_ERROR),
    }
    for name in _NAMES:
        value = event.data.get(name)
        if isinstance(value, str) and len(value) <= MAX_NAME:
            out[name] = value
    return out
