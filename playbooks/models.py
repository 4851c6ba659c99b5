"""The playbook file format as pydantic models: stages, transitions and their conditions.

Keys are snake_case; the camelCase keys of the llmrtc spec (``targetStage``, ``systemPrompt``,
``toolName``, ``durationMs`` ...) are accepted as aliases. Cross-references (stage ids, tool and
function names) are checked by :mod:`playbooks.loader`, which knows the tools module.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

__all__ = [
    "BargeInPolicy",
    "Condition",
    "CustomCondition",
    "Delegation",
    "ExecutionMode",
    "IntentCondition",
    "KeywordCondition",
    "LLMConfig",
    "LLMDecisionCondition",
    "Language",
    "MaxTurnsCondition",
    "McpServer",
    "NamedToolChoice",
    "Persona",
    "Playbook",
    "Recording",
    "Stage",
    "TimeoutCondition",
    "ToolCallCondition",
    "ToolChoice",
    "ToolDefinition",
    "ToolEntry",
    "Transfer",
    "Transition",
    "TransitionAction",
    "Voice",
    "Voicemail",
]


class _Model(BaseModel):
    """Strict about unknown keys, lenient about their case."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


ToolCalling = Literal["native", "guided"]
"""Who calls a stage's tools: the model, or the engine (see :mod:`playbooks.guided`)."""


class LLMConfig(_Model):
    """Sampling settings; unset fields fall back to the playbook's, then the server's."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tool_calling: ToolCalling | None = None
    """Who calls the tools: the model (``native``), or the engine on details the caller gave
    (``guided``, for small models: :mod:`playbooks.guided`); unset: the server's choice."""

    def merged_over(self, base: LLMConfig) -> LLMConfig:
        """This config with every unset field taken from ``base``."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


class NamedToolChoice(_Model):
    """Force one specific tool in the first round of a turn: ``{"type": "tool", "toolName":
    ...}`` (the spec's form) or ``{"name": ...}`` (llmrtc's)."""

    type: Literal["tool"] = "tool"
    tool_name: str = Field(validation_alias=AliasChoices("toolName", "tool_name", "name"))


def _tool_choice_kind(value: Any) -> str:
    return "mode" if isinstance(value, str) else "tool"


# Discriminated, so an error names the member that applies, not both.
BargeInPolicy = Literal["immediate", "confirmed", "pause_resume", "disabled"]
"""How the caller's speech over the agent is handled: ``immediate`` cuts it off as soon as speech
starts; ``confirmed`` once the caller has spoken a minimum of voiced audio; ``pause_resume``
pauses the agent at once and resumes where it stopped if the sound was a backchannel or noise,
else cuts it off; ``disabled`` lets the agent finish (the caller's words are answered after)."""

ExecutionMode = Literal["playbook", "iterative", "single-shot"]

ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("mode")]
    | Annotated[NamedToolChoice, Tag("tool")],
    Discriminator(_tool_choice_kind),
]


TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""What OpenAI-compatible APIs accept as a function name."""


class ToolDefinition(_Model):
    """A tool declared in the playbook itself (llmrtc's ``ToolDefinition``): what the LLM is
    offered and what its arguments are checked against. It is bound by ``name`` to a tool of
    the tools module or of an MCP server, or, with ``url``, to an HTTP endpoint that receives
    the arguments as a JSON POST and answers with the result."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    """A JSON Schema of type ``object``."""
    execution_policy: Literal["parallel", "sequential"] | None = None
    """llmrtc's hint; Vocable runs a round's calls concurrently either way."""
    url: str | None = Field(default=None, pattern=r"^https?://")
    """Vocable: the HTTP tool's endpoint (POST, JSON arguments in, the response body out)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Vocable: headers of the HTTP tool's requests (e.g. ``Authorization``)."""
    timeout_ms: int = Field(default=10_000, gt=0)
    """Vocable: the HTTP tool's time limit per call."""

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type object")
        properties = schema.get("properties", {})
        if not isinstance(properties, dict) or not all(
            isinstance(prop, dict) for prop in properties.values()
        ):
            raise ValueError("properties must map each argument to a JSON Schema object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not set(required) <= set(properties):
            raise ValueError("required must list properties of the schema")
        return {"type": "object", **schema}

    @model_validator(mode="after")
    def _http_settings_need_a_url(self) -> ToolDefinition:
        if self.url is None and self.headers:
            raise ValueError("headers apply to an HTTP tool (one with a url)")
        return self


def _tool_entry_kind(value: Any) -> str:
    return "name" if isinstance(value, str) else "definition"


ToolEntry = Annotated[
    Annotated[str, Tag("name")] | Annotated[ToolDefinition, Tag("definition")],
    Discriminator(_tool_entry_kind),
]
"""A ``tools`` / ``global_tools`` entry: a tool's name, ``mcp:<server>``, or a definition."""


def tool_names(entries: list[ToolEntry]) -> list[str]:
    """The names of ``entries``, in order."""
    return [entry if isinstance(entry, str) else entry.name for entry in entries]


class KeywordCondition(_Model):
    """Any keyword (case-insensitive, whole words) in the assistant's or the user's text."""

    type: Literal["keyword"]
    keywords: list[str] = Field(min_length=1)
    match_in: Literal["assistant", "user", "either"] = Field(default="assistant", alias="in")


class ToolCallCondition(_Model):
    """The named tool was called during this turn."""

    type: Literal["tool_call"]
    tool_name: str


class IntentCondition(_Model):
    """An LLM classification of the user's message names this intent with enough confidence."""

    type: Literal["intent"]
    intent: str = Field(min_length=1)
    confidence: float = Field(default=0.7, ge=0, le=1)


class LLMDecisionCondition(_Model):
    """The LLM called ``playbook_transition`` with this transition's target stage."""

    type: Literal["llm_decision"]
    require_summary: bool = False
    """Whether the LLM must pass a ``summary`` (a handoff note carried into the target stage's
    prompt, and kept in place of the history when the action clears it)."""


class MaxTurnsCondition(_Model):
    """At least ``count`` turns completed in the current stage (default: stage ``max_turns``)."""

    type: Literal["max_turns"]
    count: int | None = Field(default=None, gt=0)


class TimeoutCondition(_Model):
    """At least ``duration_ms`` spent in the current stage, checked at the end of a turn.

    Without ``duration_ms`` the stage's ``timeout_ms`` applies.
    """

    type: Literal["timeout"]
    duration_ms: int | None = Field(default=None, gt=0)


class CustomCondition(_Model):
    """A function of the tools module, given a ``TransitionContext``; may be async. Named by
    ``function`` or, as llmrtc calls it, ``evaluate``."""

    type: Literal["custom"]
    function: str = Field(
        min_length=1, validation_alias=AliasChoices("function", "evaluate"), alias="function"
    )

    @model_validator(mode="before")
    @classmethod
    def _named_function(cls, data: Any) -> Any:
        if isinstance(data, dict) and "function" not in data:
            evaluate = data.get("evaluate")
            if evaluate is None:
                raise ValueError(
                    'a custom condition names its function: "evaluate": "<a function of '
                    "the tools module>\" (llmrtc's evaluate code does not survive JSON)"
                )
            if not isinstance(evaluate, str):
                raise ValueError("evaluate must name a function of the tools module, not hold code")
        return data


Condition = Annotated[
    KeywordCondition
    | ToolCallCondition
    | IntentCondition
    | LLMDecisionCondition
    | MaxTurnsCondition
    | TimeoutCondition
    | CustomCondition,
    Field(discriminator="type"),
]


class TransitionAction(_Model):
    target_stage: str
    transition_message: str | None = None
    clear_history: bool = False
    data: dict[str, Any] = Field(default_factory=dict)


class Transition(_Model):
    id: str = Field(min_length=1)
    from_stage: str = Field(alias="from")
    condition: Condition
    action: TransitionAction
    priority: int = 0
    description: str | None = None

    def leaves(self, stage_id: str) -> bool:
        return self.from_stage in ("*", stage_id)


class Persona(_Model):
    """Who the agent is in a stage; put into the system prompt as an identity block."""

    role: str = Field(min_length=1)
    description: str | None = None


class Voice(_Model):
    """How the agent sounds: a Piper ``model`` (``.onnx`` with its ``.onnx.json`` beside it,
    relative to the playbook file; default: the server's voice) or, on a remote speech engine,
    a voice ``name``, and synthesis settings. ``id`` names the voice in events (default: the
    model file's stem, else the name, else the server voice's)."""

    id: str | None = Field(default=None, min_length=1)
    model: str | None = Field(default=None, min_length=1)
    speaking_rate: float | None = Field(default=None, ge=0.25, le=4)
    """1 is the voice's own pace; 0.8 is 20 % slower, 1.25 faster."""
    speaker: int | None = Field(default=None, ge=0)
    """The speaker of a multi-speaker model."""
    name: str | None = Field(default=None, min_length=1)
    """The voice's name on a remote speech engine (``--tts-url``: OpenAI's ``voice``, e.g.
    ``nova``); local Piper ignores it."""

    def merged_over(self, base: Voice | None) -> Voice:
        """This voice with every unset field taken from ``base``."""
        if base is None:
            return self
        return base.model_copy(update=self.model_dump(exclude_none=True))


class Language(_Model):
    """A language ``set_language`` may switch to; keyed by a code such as ``fr``."""

    name: str | None = Field(default=None, min_length=1)
    """How the prompt names it (default: the code)."""
    instruction: str | None = None
    """The prompt's language line (default: ``Answer in <name>.``)."""
    voice: Voice | None = None
    """Applied over the stage's voice while this language is spoken."""
    fallback: str | None = Field(default=None, min_length=1)
    """The fallback line while this language is spoken (default: the playbook's)."""


class Delegation(_Model):
    """Worker stages a stage may hand tasks to through the built-in ``delegate`` tool."""

    workers: list[str] = Field(min_length=1)
    mode: Literal["parallel", "sequence"] = "parallel"
    say: str | None = None
    """Said in voice calls while the workers run (e.g. "Let me check with the team.")."""
    max_tool_calls: int | None = Field(default=None, gt=0)
    """Each worker's tool-call limit; None: the orchestrator's per-turn limit."""
    timeout_ms: int = Field(default=30_000, gt=0)
    """Each worker's time limit (its LLM calls and tools together)."""


_SIP_URI = re.compile(r"^sips?:([^@\s]+@)?[A-Za-z0-9.\-\[\]:]+(;[^\s]*)?$")
_PHONE = re.compile(r"^(tel:)?\+?[0-9][0-9 ().\-]{2,30}$")


class Transfer(_Model):
    """Where the built-in ``transfer_call`` tool puts the caller through to a person, and how.
    A stage's ``transfer`` replaces the playbook's (the default of every stage)."""

    to: str = Field(min_length=1)
    """A SIP URI (``sip:agent@pbx.example.com``) or a phone number (``+15551234567``, for the
    gateway or the provider to dial)."""
    say: str | None = "Let me put you through."
    """Said to the caller before the transfer starts."""
    mode: Literal["blind", "warm"] = "blind"
    """``warm``: the person first hears the agent's summary of the conversation (the LLM's
    ``summary``), then the caller is joined; SIP peers that take REFER are always blind."""
    ring_timeout_ms: int = Field(default=30_000, gt=0)
    """How long the person's phone may ring before the transfer counts as not answered."""
    description: str | None = None
    """When to transfer, for the LLM (default: when the caller asks for a person)."""

    @field_validator("to")
    @classmethod
    def _destination(cls, value: str) -> str:
        value = value.strip()
        if not (_SIP_URI.match(value) or _PHONE.match(value)):
            raise PydanticCustomError(
                "destination",
                "must be a SIP URI (sip:agent@pbx.example.com) or a phone number (+15551234567)",
            )
        return value


class Recording(_Model):
    """Whether calls on this playbook are recorded where the server records them
    (``vocable serve --record DIR``), and what they are told. ``recording: false`` is
    ``recording: {enabled: false}``."""

    enabled: bool = True
    """False: calls on this playbook are never recorded."""
    notice: str | None = Field(default=None, min_length=1)
    """Said at the start of each recorded call, before the greeting (over the server's
    ``--record-notice``)."""


def _hook_name(value: Any) -> Any:
    """``on_enter`` / ``on_exit`` must name a function; llmrtc's code cannot come from JSON."""
    if value is not None and not isinstance(value, str):
        raise ValueError("must name a function of the tools module, not hold code")
    return value


class Stage(_Model):
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    description: str | None = None
    system_prompt: str
    tools: list[ToolEntry] = Field(default_factory=list)
    """Tool names or inline definitions; an entry ``mcp:<server>`` takes every tool of that MCP
    server (after its ``tools`` filter)."""
    on_enter: str | None = Field(default=None, min_length=1)
    """A function of the tools module called with a ``StageContext`` when the conversation
    enters this stage (llmrtc's ``onEnter``); may be async."""
    on_exit: str | None = Field(default=None, min_length=1)
    """The same when it leaves the stage (llmrtc's ``onExit``)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form; given to tools and hooks, and in ``stage_entered`` events."""
    llm_config: LLMConfig = Field(default_factory=LLMConfig)
    two_phase_execution: bool = True
    interruptible: bool = True
    """Whether the caller's speech cuts the agent off (barge-in) in this stage; False is
    ``barge_in: disabled``."""
    barge_in: BargeInPolicy | None = None
    """This stage's barge-in policy; None: the server's default."""
    tool_choice: ToolChoice = "auto"
    max_turns: int | None = Field(default=None, gt=0)
    timeout_ms: int | None = Field(default=None, gt=0)
    greeting: str | None = None
    """Said on entering the stage: when the conversation starts here, and after a transition
    (before the answer of the turn that moved here, or after it for end-of-turn transitions)."""
    questions: dict[str, str] = Field(default_factory=dict)
    """Guided tool calling only: the line asking the caller for a detail this stage's tools
    need, by the argument's name. Said word for word, in place of the model's answer, when the
    turn called no tool, the caller asked no question, and the turn either entered this stage
    or learned a detail (:mod:`playbooks.guided`)."""
    persona: Persona | None = None
    """Over the playbook's ``persona``."""
    voice: Voice | None = None
    """Over the playbook's ``voice``, field by field."""
    mode: ExecutionMode = "playbook"
    """How a turn runs here: ``playbook`` (the tool loop, then the answer), ``iterative`` (the
    tool loop stops as soon as a ``tool_call``, ``custom`` or ``timeout`` transition of the stage
    holds, or the LLM takes an ``llm_decision`` one) or ``single-shot`` (one streamed call, no
    tools). A delegation worker runs its own mode, without transitions."""
    delegates: Delegation | None = None
    """Worker stages this stage may delegate to (the ``delegate`` tool is then offered)."""
    transfer: Transfer | None = None
    """Where this stage may put the caller through to a person (the ``transfer_call`` tool is
    then offered); over the playbook's ``transfer``."""

    _hooks_named = field_validator("on_enter", "on_exit", mode="before")(_hook_name)

    @property
    def tool_names(self) -> list[str]:
        return tool_names(self.tools)


class McpServer(_Model):
    """An MCP server whose tools join the playbook's: a stdio ``command`` or a streamable HTTP
    ``url`` (exactly one). ``tools`` names the ones the playbook takes (default ``all``); a
    stage still names each it offers, or ``mcp:<name>`` for all of them."""

    name: str = Field(min_length=1)
    command: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    url: str | None = Field(default=None, pattern=r"^https?://")
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_ms: int = Field(default=30_000, gt=0)
    """Each call's time limit, and the limit for connecting and listing tools."""
    tools: list[str] | Literal["all"] = "all"

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) or url (streamable HTTP)")
        if self.command is None and (self.args or self.env):
            raise ValueError("args and env apply to a command, not a url")
        if self.url is None and self.headers:
            raise ValueError("headers apply to a url, not a command")
        return self


class Voicemail(_Model):
    """What an outbound call does when a voicemail greeting answers it (a long monologue right
    after the answer, see ``server/call/pickup.py``)."""

    action: Literal["hangup", "leave_message"] = "hangup"
    message: str | None = Field(default=None, min_length=1)
    """Said once the greeting is over (``leave_message``); the call then hangs up."""
    detect_after_ms: int = Field(default=4000, ge=1000, le=30_000)
    """Speech without a pause longer than this, right after the answer, is a machine's."""
    beep_timeout_ms: int = Field(default=2500, ge=500, le=30_000)
    """The message is said as the greeting's beep ends; with no beep, after this much
    silence following the greeting."""

    @model_validator(mode="after")
    def _message_to_leave(self) -> Voicemail:
        if self.action == "leave_message" and self.message is None:
            raise ValueError("action leave_message needs a message")
        return self


class Idle(_Model):
    """What the agent does when the caller goes quiet (on every transport): after
    ``prompt_after_s`` of silence (the agent quiet too) it says ``prompt``; after
    ``hangup_after_s`` more, it says ``goodbye`` and hangs up. Caller speech starts the count
    again. It replaces the server's ``--idle-timeout-s`` for the playbook's calls."""

    prompt_after_s: float = Field(default=10.0, ge=1.0, le=3600.0)
    prompt: str = Field(default="Are you still there?", min_length=1)
    hangup_after_s: float = Field(default=10.0, ge=1.0, le=3600.0)
    goodbye: str | None = Field(default="It seems we got cut off. Goodbye.", min_length=1)
    """None: hang up without a word."""


class Playbook(_Model):
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    description: str | None = None
    version: str | None = None
    """The author's version of the playbook; ``vocable playbook check`` shows it."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form; given to tools and hooks."""
    initial_stage: str
    stages: list[Stage] = Field(min_length=1)
    transitions: list[Transition] = Field(default_factory=list)
    global_system_prompt: str | None = None
    global_tools: list[ToolEntry] = Field(default_factory=list)
    """Tools offered in every stage; names, ``mcp:<server>`` or definitions as in a stage's
    ``tools``."""
    default_llm_config: LLMConfig = Field(
        default_factory=LLMConfig,
        validation_alias=AliasChoices("defaultLLMConfig", "defaultLlmConfig", "default_llm_config"),
    )
    tools_module: str | None = None
    mcp_servers: list[McpServer] = Field(default_factory=list)
    persona: Persona | None = None
    """The default persona of stages that set none."""
    voice: Voice | None = None
    """The default voice of every stage."""
    languages: dict[str, Language] = Field(default_factory=dict)
    """Languages ``set_language`` offers, by code; empty: any language the LLM names."""
    transfer: Transfer | None = None
    """The default ``transfer`` of every stage (see :class:`Transfer`)."""
    language: str | None = None
    """The language the conversation starts in (a key of ``languages`` when there are any);
    None: no language line in the prompt until ``set_language`` is called."""
    fallback: str | None = Field(default=None, min_length=1)
    """What the agent says when a turn fails (the LLM unreachable or too slow, an answer cut
    off); a configured language's ``fallback`` wins while it is spoken. Default: "Sorry, I'm
    having trouble right now."."""
    recording: Recording = Field(default_factory=Recording)
    """Call recording on this playbook (see :class:`Recording`)."""
    voicemail: Voicemail = Field(default_factory=Voicemail)
    idle: Idle | None = None
    """Ask a quiet caller whether they are there, then say goodbye (:class:`Idle`); None: the
    server's ``--idle-timeout-s`` hangs up without a word."""
    """Outbound calls answered by a voicemail greeting: hang up (default) or leave a message."""

    @field_validator("recording", mode="before")
    @classmethod
    def _recording_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @property
    def global_tool_names(self) -> list[str]:
        return tool_names(self.global_tools)

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: Any) -> Any:
        """``version: 2`` in YAML is a number: the version is its text."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value

    def stage(self, stage_id: str) -> Stage:
        for stage in self.stages:
            if stage.id == stage_id:
                return stage
        raise KeyError(stage_id)
