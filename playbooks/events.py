"""Events the orchestrator emits while it runs a turn, named as in the playbook spec."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EventBus", "EventHandler", "EventType", "OrchestratorEvent", "Retraction"]

log = logging.getLogger(__name__)

EventType = Literal[
    "phase1_start",
    "tool_call_start",
    "tool_call_complete",
    "phase1_complete",
    "phase2_start",
    "phase2_complete",
    "transition_triggered",
    "stage_entered",
    "stage_exited",
    "greeting",
    "language_changed",
    "answer_retracted",
    "guided_step",
    "history_trimmed",
    "delegation_start",
    "delegation_end",
    "transfer_started",
    "transfer_answered",
    "transfer_requested",
    "transfer_failed",
    "error",
]


@dataclass(frozen=True)
class OrchestratorEvent:
    """One fact about a turn. ``data`` is JSON-serialisable."""

    type: EventType
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.data}


@dataclass(frozen=True)
class Retraction:
    """Yielded in a turn's answer stream when the text yielded so far must be discarded.

    This happens when a round that began with text turns out to call tools: with two-phase
    execution that text belongs to the silent Phase 1. Consumers drop what they buffered of it.
    """

    text: str


EventHandler = Callable[[OrchestratorEvent], None]


class EventBus:
    """Synchronous fan-out to subscribers; a failing handler is logged, never propagated."""

    def __init__(self) -> None:
        self._handlers: list[EventHandler] = []

    def subscribe(self, handler: EventHandler) -> Callable[[], None]:
        """Add ``handler``; returns a function that removes it (idempotent)."""
        self._handlers.append(handler)

        def unsubscribe() -> None:
            if handler in self._handlers:
                self._handlers.remove(handler)

        return unsubscribe

    def emit(self, type: EventType, **data: Any) -> None:
        event = OrchestratorEvent(type, data)
        for handler in list(self._handlers):
            try:
                handler(event)
            except Exception:
                log.exception("event handler failed on %s", type)
