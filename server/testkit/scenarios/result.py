"""What running a scenario found: per turn, what was said, heard and done, how long it took, and
each check's outcome; JSON-able for reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CheckResult", "Failure", "Outcome", "ScenarioResult", "TurnResult"]

Outcome = Literal["passed", "failed", "skipped"]


@dataclass
class CheckResult:
    """One expectation's outcome; ``detail`` says what was found (and why it failed)."""

    check: str
    """The expectation as written, e.g. ``stage: booking``."""
    outcome: Outcome
    detail: str = ""


@dataclass
class TurnResult:
    number: int
    """1-based; a simulated caller's lines are numbered likewise."""
    action: str
    """What the caller did: ``say "..."``, ``dtmf 12#``, ``wav FILE``, ``silence 2000 ms``,
    ``wait for the agent``."""
    understood: str | None = None
    """What the server transcribed of the caller (or the typed line in text mode)."""
    answer: str = ""
    """The agent's answer as text (what it set out to say, sentence by sentence)."""
    heard: str | None = None
    """What the caller heard, transcribed (only when a check needs it)."""
    stage: str | None = None
    """The stage once the turn was over."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Tools called: ``{"name": ..., "arguments": ...}``, with ``result`` and ``error`` once
    the call ended."""
    voice_to_voice_ms: float | None = None
    """From the caller's last voiced frame to the agent's first sound the caller heard."""
    cut_in_ms: float | None = None
    """When the agent began while the caller's line was still being said (from its first
    voiced frame); None: it waited for the whole line."""
    turn_ends: list[str] = field(default_factory=list)
    """Why each of the caller's utterances in the turn ended, as the server said: the words,
    words and voice (with the turn model's score), the voice, the hold limit, silence."""
    duration_ms: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    """The server's ``turn_metrics`` of the turn, if it sent some."""
    checks: list[CheckResult] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    """The turn as it happened (voice runs): the server's speech events and the spans in
    which the caller heard the agent, each as ``+s.ss what`` from the turn's start."""

    @property
    def failed(self) -> list[CheckResult]:
        return [check for check in self.checks if check.outcome == "failed"]


@dataclass(frozen=True)
class Failure:
    """A failed check or a run that could not go on: in which turn (None: the scenario as a
    whole) and why."""

    turn: int | None
    check: str
    reason: str

    def __str__(self) -> str:
        where = f"turn {self.turn}" if self.turn is not None else "scenario"
        return f"{where}: {self.check}: {self.reason}"


@dataclass
class ScenarioResult:
    """One run of one scenario. ``passed`` when every check held and nothing went wrong."""

    name: str
    file: str
    mode: str
    transport: str
    agent_llm: str
    run: int = 1
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None
    """Why the run stopped early (the server refused the call, a turn timed out ...)."""
    duration_s: float = 0.0
    audio_file: str | None = None
    """The conversation's audio (stereo WAV: caller left, agent right), when kept."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Every event of the call, as a client got them."""
    notes: list[str] = field(default_factory=list)
    """What the author should know that is not a check's failure (an LLM request the script
    had no step for)."""

    @property
    def failures(self) -> list[Failure]:
        found = [
            Failure(turn.number, check.check, check.detail)
            for turn in self.turns
            for check in turn.failed
        ]
        if self.error is not None:
            found.append(Failure(None, "run", self.error))
        return found

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def skipped(self) -> list[tuple[int, CheckResult]]:
        return [
            (turn.number, check)
            for turn in self.turns
            for check in turn.checks
            if check.outcome == "skipped"
        ]

    def to_dict(self, *, with_events: bool = True) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["failures"] = [asdict(failure) for failure in self.failures]
        if not with_events:
            data.pop("events")
        return data
