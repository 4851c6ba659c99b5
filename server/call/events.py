"""Voice events for clients: JSON-able facts about a call, each with a monotonic timestamp, and
the one translation of the playbook engine's events into them (:func:`voice_event_of`)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import (
    Any,
    Literal,
    Protocol,
    get_args,
    get_overloads,
    get_type_hints,
    overload,
)

from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict, Unpack

from playbooks import OrchestratorEvent

__all__ = [
    "EVENT_DATA",
    "MAX_ARGUMENTS_CHARS",
    "VOICE_EVENT_TYPES",
    "EmitVoiceEvent",
    "VoiceEvent",
    "VoiceEventHandler",
    "VoiceEventType",
    "payload_problem",
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


# -- the payload of each kind -----------------------------------------------------------------


class SpeechStartData(TypedDict):
    at_ms: float
    """When the caller's speech began (monotonic ms, the VAD's pre-roll included)."""


class SpeechEndData(TypedDict):
    duration_ms: int
    forced: bool
    """Ended by the longest utterance allowed, not by a pause."""
    last_voiced_ms: float
    reason: str
    """Why the turn ended: the text rule, the turn model's score, the hold limit..."""
    turn_score: float | None
    """The turn model's score of the voice at the end (None: it gave none)."""


class TranscriptData(TypedDict):
    text: str
    dropped: str | None
    """Why the words were judged not to be speech (then ``text`` is empty)."""
    audio_ms: int
    stt_ms: int
    speculative: bool


class StageChangeData(TypedDict):
    stage: str
    name: str
    voice: str | None


class LanguageChangeData(TypedDict):
    language: str
    voice: str | None


class ToolCallStartData(TypedDict):
    name: str
    id: str
    arguments: dict[str, Any] | str


class ToolCallEndData(TypedDict):
    name: str
    id: str
    error: bool
    result: dict[str, Any] | str
    duration_ms: float


class DelegationStartData(TypedDict):
    workers: list[str]
    mode: str


class WorkerSummary(TypedDict):
    worker: str
    ok: bool
    tool_calls: int
    duration_ms: float


class DelegationEndData(TypedDict):
    workers: list[WorkerSummary]
    """Each worker that ran: whether it succeeded, its tool calls and how long it took."""
    mode: str


class TransferStartedData(TypedDict):
    destination: str
    mode: str
    reason: str | None


class TransferDoneData(TypedDict):
    destination: str
    mode: str
    how: str
    """What put the caller through (``refer``, ``bridge``, ``provider``, ``stream event``)."""


class TransferFailedData(TypedDict):
    destination: str
    mode: str
    reason: str
    detail: str | None


class AgentSentenceData(TypedDict):
    text: str
    voice: str | None


class TtsStartData(TypedDict):
    voice: str | None


class HeardData(TypedDict):
    heard: str
    """What the caller has heard of the answer (whole sentences)."""


class InterruptedData(TypedDict):
    heard: str
    cut_ms: int
    """How much of the answer's audio the barge-in cut."""


class ResumedData(TypedDict):
    text: str
    """What the sound that paused the agent was heard as (empty: no words)."""


class SpeculationData(TypedDict):
    outcome: str


class TurnMetricsData(TypedDict):
    end_of_speech_ms: float | None
    stt_ms: float | None
    llm_first_token_ms: float | None
    first_sentence_ms: float | None
    tts_first_audio_ms: float | None
    first_frame_out_ms: float | None
    voice_to_voice_ms: float | None


class _State(TypedDict):
    state: str


class StateData(_State, total=False):
    reason: str
    """Why the call closed (``closed`` only)."""


class DtmfData(TypedDict):
    digit: str


class _Error(TypedDict):
    source: str
    message: str


class ErrorData(_Error, total=False):
    tool: str
    worker: str
    status: int


class MessageData(TypedDict):
    message: str


class RecordingFailedData(TypedDict):
    reason: str
    message: str


class EmitVoiceEvent(Protocol):
    """Emits a voice event of a kind with its payload as keywords. Its overloads are where each
    kind's payload type is written (one per kind of :data:`VoiceEventType`): mypy checks each
    call's keywords against them, and :data:`EVENT_DATA`, read from them, lets tests check
    events at run time too (``payload_problem``)."""

    @overload
    def __call__(
        self, type: Literal["speech_start"], /, **data: Unpack[SpeechStartData]
    ) -> None: ...

    @overload
    def __call__(self, type: Literal["speech_end"], /, **data: Unpack[SpeechEndData]) -> None: ...

    @overload
    def __call__(self, type: Literal["transcript"], /, **data: Unpack[TranscriptData]) -> None: ...

    @overload
    def __call__(
        self, type: Literal["stage_change"], /, **data: Unpack[StageChangeData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["language_change"], /, **data: Unpack[LanguageChangeData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["tool_call_start"], /, **data: Unpack[ToolCallStartData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["tool_call_end"], /, **data: Unpack[ToolCallEndData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["delegation_start"], /, **data: Unpack[DelegationStartData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["delegation_end"], /, **data: Unpack[DelegationEndData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["transfer_started"], /, **data: Unpack[TransferStartedData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["transfer_answered"], /, **data: Unpack[TransferDoneData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["transfer_requested"], /, **data: Unpack[TransferDoneData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["transfer_failed"], /, **data: Unpack[TransferFailedData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["agent_sentence"], /, **data: Unpack[AgentSentenceData]
    ) -> None: ...

    @overload
    def __call__(self, type: Literal["tts_start"], /, **data: Unpack[TtsStartData]) -> None: ...

    @overload
    def __call__(self, type: Literal["tts_end"], /, **data: Unpack[HeardData]) -> None: ...

    @overload
    def __call__(
        self, type: Literal["interrupted"], /, **data: Unpack[InterruptedData]
    ) -> None: ...

    @overload
    def __call__(self, type: Literal["paused"], /, **data: Unpack[HeardData]) -> None: ...

    @overload
    def __call__(self, type: Literal["resumed"], /, **data: Unpack[ResumedData]) -> None: ...

    @overload
    def __call__(
        self, type: Literal["speculation"], /, **data: Unpack[SpeculationData]
    ) -> None: ...

    @overload
    def __call__(
        self, type: Literal["turn_metrics"], /, **data: Unpack[TurnMetricsData]
    ) -> None: ...

    @overload
    def __call__(self, type: Literal["state"], /, **data: Unpack[StateData]) -> None: ...

    @overload
    def __call__(self, type: Literal["dtmf"], /, **data: Unpack[DtmfData]) -> None: ...

    @overload
    def __call__(self, type: Literal["error"], /, **data: Unpack[ErrorData]) -> None: ...

    @overload
    def __call__(self, type: Literal["voice_lost"], /, **data: Unpack[MessageData]) -> None: ...

    @overload
    def __call__(
        self, type: Literal["recording_failed"], /, **data: Unpack[RecordingFailedData]
    ) -> None: ...

    def __call__(self, type: VoiceEventType, /, **data: Any) -> None: ...


def _payload_types() -> dict[str, type]:
    """Each kind's payload type, as :class:`EmitVoiceEvent`'s overloads give it."""
    types: dict[str, type] = {}
    for signature in get_overloads(EmitVoiceEvent.__call__):
        hints = get_type_hints(signature, include_extras=True)
        (kind,), (payload,) = get_args(hints["type"]), get_args(hints["data"])
        types[kind] = payload
    return types


EVENT_DATA: dict[str, type] = _payload_types()
"""The payload type of each kind of voice event (``VoiceEvent.data``)."""


def payload_problem(event: VoiceEvent) -> str | None:
    """What keeps ``event``'s data from being its kind's payload (:data:`EVENT_DATA`): a key
    missing or unknown, a value of the wrong type; None when it is one."""
    kind = EVENT_DATA.get(event.type)
    if kind is None:
        return f"no payload type for {event.type!r}"
    keys = set(event.data)
    missing = sorted(kind.__required_keys__ - keys)  # type: ignore[attr-defined]
    unknown = sorted(keys - kind.__required_keys__ - kind.__optional_keys__)  # type: ignore[attr-defined]
    if missing or unknown:
        return f"{event.type}: missing {missing}, unknown {unknown}"
    try:
        _adapter(kind).validate_python(event.data, strict=True)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{event.type}.{where}: {first['msg']}"
    return None


@functools.cache
def _adapter(kind: type) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


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
    payload: Mapping[str, Any]  # each kind's TypedDict of EVENT_DATA, checked by mypy
    kind: VoiceEventType
    match event.type:
        case "tool_call_start":
            call = data["call"]
            kind = "tool_call_start"
            payload = ToolCallStartData(
                name=call["name"], id=call["id"], arguments=tool_arguments(call["arguments"])
            )
        case "tool_call_complete":
            call = data["call"]
            kind = "tool_call_end"
            payload = ToolCallEndData(
                name=call["name"],
                id=call["id"],
                error=data["error"],
                result=tool_arguments(data["result"]),
                duration_ms=data["duration_ms"],
            )
        case "stage_entered":
            stage = data["stage"]
            kind = "stage_change"
            payload = StageChangeData(stage=stage["id"], name=stage["name"], voice=voice)
        case "language_changed":
            kind = "language_change"
            payload = LanguageChangeData(language=data["language"], voice=voice)
        case "delegation_start":
            kind = "delegation_start"
            payload = DelegationStartData(workers=data["workers"], mode=data["mode"])
        case "delegation_end":
            kind = "delegation_end"
            payload = DelegationEndData(workers=data["workers"], mode=data["mode"])
        case "transfer_started" | "transfer_answered" | "transfer_requested" | "transfer_failed":
            kind, payload = event.type, data  # the engine's own payload (see EVENT_DATA)
        case "error":
            kind = "error"
            payload = ErrorData(source=data.get("source", "llm"), message=data["message"])
            if "tool" in data:
                payload["tool"] = data["tool"]
        case _:
            return None
    return VoiceEvent(kind, dict(payload), at)


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
