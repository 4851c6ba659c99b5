"""The scenario file format as pydantic models: a conversation with a playbook, turn by turn.

A scenario names its playbook, how the caller sounds, and its turns. Each turn is one caller
action (a line spoken by a voice, a WAV file, keypad digits, a silence, or nothing: wait for the
agent) and the expectations checked once the agent has answered. With a ``simulated_caller``, an
LLM plays the caller instead, and the expectations apply to the whole conversation.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ACTIONS",
    "CHECKS",
    "BargeIn",
    "CallerVoice",
    "Echo",
    "Expectation",
    "Impairments",
    "Noise",
    "Scenario",
    "ScriptStep",
    "SimulatedCaller",
    "TextCheck",
    "ToolCheck",
    "Turn",
]

DTMF = re.compile(r"^[0-9*#A-D]{1,32}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CallerVoice(_Model):
    """How the caller's lines are spoken."""

    engine: Literal["piper", "espeak"] = "piper"
    """``piper``: the bundled Piper voice; ``espeak``: espeak-ng (where installed), a voice
    unlike the agent's."""
    speed: float = Field(default=1.0, ge=0.5, le=2.0)
    """Speaking rate: 1 the voice's own, 1.25 a quarter faster."""
    espeak_voice: str = "en-us"
    """The espeak-ng voice (``espeak-ng --voices``)."""


class Noise(_Model):
    """Background noise under the caller's lines (``server.testkit.impairments``)."""

    kind: Literal["babble", "street", "car"]
    """``babble``: four other voices; ``street``; ``car``."""
    snr_db: float = Field(ge=-5.0, le=40.0)
    """How far the caller's speech is above the noise, in dB (10: a busy street)."""


class Echo(_Model):
    """The caller's phone sends the agent's voice back (a speakerphone), for the whole call.
    Over WebRTC the server then cancels echo as it does on phone lines (a browser whose own
    canceller let it through)."""

    delay_ms: int = Field(default=120, ge=0, le=1000)
    return_loss_db: float = Field(default=6.0, ge=0.0, le=60.0)
    """How much weaker than what the phone played the echo is (6: a speakerphone)."""


class Network(_Model):
    """What the network does to the caller's RTP packets, for the whole call (SIP lines)."""

    packet_loss: float = Field(default=0.0, ge=0.0, le=0.5)
    """The share of packets lost, each independently (0.05: a poor mobile line)."""
    jitter_ms: int = Field(default=0, ge=0, le=200)
    """Each packet that arrives is delayed by 0 to this many milliseconds (past 20, some
    arrive out of order)."""


class Impairments(_Model):
    """What the line does to the caller's audio: a scenario's for all its turns, a turn's
    (``noise``, ``g711``) instead of the scenario's for that turn."""

    noise: Noise | None = None
    g711: bool = False
    """The caller's voice through a G.711 phone line (8 kHz, A-law), also on WebRTC."""
    echo: Echo | None = None
    network: Network | None = None
    """Packet loss and jitter on the caller's packets, for the whole call (a scenario's)."""


class TextCheck(_Model):
    """A check of a text (the agent's answer, or what the caller heard); every field given must
    hold. Text is compared case-insensitively, with runs of spaces as one."""

    contains: str | list[str] | None = None
    not_contains: str | list[str] | None = None
    matches: str | None = None
    """A regular expression found somewhere in the text (case-insensitive)."""
    max_words: int | None = Field(default=None, ge=1)

    @field_validator("matches")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="after")
    def _something(self) -> TextCheck:
        if (self.contains, self.not_contains, self.matches, self.max_words) == (None,) * 4:
            raise ValueError("give contains, not_contains, matches or max_words")
        return self


class ToolCheck(_Model):
    """A tool the agent called, with at least these arguments (strings compared without case),
    and what it gave back. A tool that fails fails its turn unless a check expects the error."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: dict[str, Any] | str | None = None
    """The tool's result has at least these fields (an object, compared as the arguments are),
    or contains this text."""
    error: bool | str | None = None
    """The tool failed (true), or failed with an error containing this; false or absent: it
    must not fail."""

    @model_validator(mode="after")
    def _result_or_error(self) -> ToolCheck:
        if self.result is not None and self.error not in (None, False):
            raise ValueError("a tool that failed has no result to check: give result or error")
        return self


CHECKS = (
    "stage",
    "tool",
    "no_tool",
    "answer",
    "heard",
    "judge",
    "no_markup",
    "silent_within_ms",
    "voice_to_voice_ms",
    "no_cut_in",
    "transfer",
    "hangup",
)
"""The keys of an expectation; each expectation gives exactly one."""


class Expectation(_Model):
    """One thing the agent must have done in the turn (give exactly one key).

    ``tool``, ``transfer`` and ``hangup`` are facts with a time: a turn's expectations of them
    must come true in the order written (other events may come between). The others are checked
    on the turn as a whole."""

    stage: str | None = None
    """The stage the conversation is in once the turn is over."""
    tool: ToolCheck | str | None = None
    """A tool called (its name, or name and a subset of its arguments)."""
    no_tool: str | None = None
    """A tool not called in the turn."""
    answer: TextCheck | str | None = None
    """The agent's answer as text (a string: it contains that)."""
    heard: TextCheck | str | None = None
    """What the caller heard, transcribed by Whisper (a string: it contains that). Words are
    matched as a listener would: a recogniser's slip ("close" for "closed") still matches."""
    judge: str | None = None
    """A statement about the agent's answer that an LLM judges true or false."""
    no_markup: bool | None = None
    """Nothing spoken is markup (Markdown, tags, JSON, code)."""
    silent_within_ms: int | None = Field(default=None, ge=0)
    """A barge-in turn: the agent fell silent at most this long after the caller began."""
    voice_to_voice_ms: int | None = Field(default=None, ge=0)
    """From the end of the caller's speech to the agent's first sound, at most."""
    no_cut_in: bool | None = None
    """The agent made no sound while the caller's line was being said: it waited through the
    line's pauses (``...``) for the whole of it."""
    transfer: bool | str | None = None
    """A transfer requested (true, or its target contains this)."""
    hangup: bool | None = None
    """The call ended (by the agent or the server) during the turn."""

    @model_validator(mode="after")
    def _exactly_one(self) -> Expectation:
        given = [key for key in CHECKS if getattr(self, key) is not None]
        if not given:
            raise ValueError(f"give one of {', '.join(CHECKS)}")
        if len(given) > 1:
            raise ValueError(f"one check per item (this one has {', '.join(given)})")
        return self

    @property
    def kind(self) -> str:
        return next(key for key in CHECKS if getattr(self, key) is not None)


class ScriptStep(_Model):
    """One scripted LLM response: text, tool calls, then more text (the scripted LLM's terms).
    A turn's steps answer its LLM requests in order: the first the caller's words, the next
    the first step's tool results, and so on."""

    say: str = ""
    tools: list[dict[str, dict[str, Any]]] = Field(default_factory=list)
    """Tool calls, each ``{name: {argument: value}}``."""
    then: str = ""
    """Text after the tool calls."""

    @field_validator("tools")
    @classmethod
    def _one_call_each(cls, calls: list[dict[str, dict[str, Any]]]) -> Any:
        for call in calls:
            if len(call) != 1:
                raise ValueError("each tool call is one {name: {arguments}} mapping")
        return calls

    @model_validator(mode="after")
    def _something(self) -> ScriptStep:
        if not (self.say or self.tools or self.then):
            raise ValueError("a step needs say, tools or then")
        return self


class BargeIn(_Model):
    """Speak over the agent: start once this much of the agent's answer to the turn before has
    been heard (its pauses under half a second counted), or when that answer is over."""

    after_ms: int = Field(default=500, ge=0, le=30_000)


ACTIONS = ("say", "wav", "dtmf", "silence_ms")
"""A turn's caller actions; a turn has at most one (none: it waits for the agent)."""


class Turn(_Model):
    """One caller action and what the agent must do after it."""

    say: str | None = Field(default=None, min_length=1)
    """Spoken by the caller's voice; ``...`` inside is a pause of ``pause_ms``."""
    wav: str | None = Field(default=None, min_length=1)
    """A WAV file (mono PCM16, any rate), relative to the scenario file."""
    dtmf: str | None = None
    """Keypad digits (0-9, *, #, A-D), pressed one after another."""
    silence_ms: int | None = Field(default=None, ge=20, le=120_000)
    """The caller says nothing for this long."""
    voice: CallerVoice | None = None
    """This turn's voice (default: the scenario's ``caller``)."""
    pause_ms: int = Field(default=300, ge=20, le=10_000)
    """The length of each ``...`` pause: a hesitation (300 ms) is shorter than the server's
    end-of-turn silence; a longer one lets a scenario check that the agent waits."""
    barge_in: BargeIn | None = None
    impairments: Impairments | None = None
    """This turn's line (noise, G.711) instead of the scenario's."""
    intent: str | None = None
    """Scripted runs: what the intent classifier answers for this turn (default: none)."""
    agent: list[ScriptStep] | None = None
    """Scripted runs: the LLM's responses in this turn."""
    expect: list[Expectation] = Field(default_factory=list)
    timeout_s: float = Field(default=30.0, gt=0, le=600)
    """Longest wait for the agent to finish the turn."""

    @field_validator("dtmf")
    @classmethod
    def _digits(cls, digits: str | None) -> str | None:
        if digits is not None and not DTMF.match(digits):
            raise ValueError("digits are 1 to 32 of 0-9, *, #, A-D")
        return digits

    @model_validator(mode="after")
    def _one_action(self) -> Turn:
        given = [key for key in ACTIONS if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"a turn has one of {', '.join(ACTIONS)}; this one has {given}")
        if self.barge_in is not None and self.action not in ("say", "wav"):
            raise ValueError("barge_in needs a say or wav line to speak over the agent")
        if self.impairments is not None and self.impairments.echo is not None:
            raise ValueError("echo is the whole call's: give it in the scenario's impairments")
        if self.impairments is not None and self.impairments.network is not None:
            raise ValueError("network is the whole call's: give it in the scenario's impairments")
        cut_in = any(e.no_cut_in is not None for e in self.expect)
        if cut_in and (self.barge_in is not None or self.action not in ("say", "wav")):
            raise ValueError("no_cut_in needs a say or wav line that is not a barge_in")
        return self

    @property
    def action(self) -> str | None:
        """The key of this turn's caller action; None: the turn waits for the agent."""
        return next((key for key in ACTIONS if getattr(self, key) is not None), None)


class SimulatedCaller(_Model):
    """An LLM that plays the caller: a persona with a goal, for up to ``max_turns`` lines."""

    persona: str = Field(min_length=1)
    goal: str = Field(min_length=1)
    max_turns: int = Field(default=6, ge=1, le=30)
    opening: str | None = Field(default=None, min_length=1)
    """The caller's first line (default: the LLM's)."""
    expect: list[Expectation] = Field(default_factory=list)
    """Checked on the whole conversation once the caller is done."""


class Scenario(_Model):
    """A conversation with a playbook (the file's top level)."""

    name: str = Field(min_length=1)
    description: str = ""
    playbook: str = Field(min_length=1)
    """The playbook file, relative to the scenario file."""
    mode: Literal["voice", "text"] = "voice"
    """``voice``: through a real call; ``text``: the playbook alone, typed (fast)."""
    caller: CallerVoice = CallerVoice()
    impairments: Impairments | None = None
    """What the line does to the caller's audio: noise, G.711, echo (see :class:`Impairments`)."""
    agent_llm: Literal["script", "configured"] | None = None
    """``script``: the turns' ``agent`` steps answer; ``configured``: the LLM Vocable is
    configured with. Default: ``script`` when a turn has steps."""
    turns: list[Turn] = Field(default_factory=list)
    simulated_caller: SimulatedCaller | None = None

    @model_validator(mode="after")
    def _a_conversation(self) -> Scenario:
        if not self.turns and self.simulated_caller is None:
            raise ValueError("a scenario needs turns or a simulated_caller")
        if self.simulated_caller is not None and self.scripted:
            raise ValueError("a simulated caller talks to a real agent: agent_llm configured")
        if self.agent_llm == "script" and not any(t.agent for t in self.turns):
            raise ValueError("agent_llm script needs the turns' agent steps")
        return self

    @property
    def scripted(self) -> bool:
        """Whether the turns' ``agent`` steps answer (rather than a real LLM)."""
        if self.agent_llm is not None:
            return self.agent_llm == "script"
        return any(turn.agent for turn in self.turns)
