"""Voice events for clients: JSON-able facts about a call, each with a monotonic timestamp."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["VoiceEvent", "VoiceEventHandler", "VoiceEventType"]

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


@dataclass(frozen=True)
class VoiceEvent:
    type: VoiceEventType
    data: dict[str, Any] = field(default_factory=dict)
    t: float = field(default_factory=time.monotonic)
    """Monotonic clock seconds when the fact happened."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "t_ms": round(self.t * 1000, 1), **self.data}


VoiceEventHandler = Callable[[VoiceEvent], None]
