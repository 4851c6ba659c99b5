"""The playbook state machine: current stage, its prompt and tools, and transition evaluation.

The engine knows nothing of LLM transport or history; the orchestrator feeds it the facts of a turn
and applies the history side effects of the transitions it returns.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from .delegation import delegate_tool_schema
from .identity import (
    LANGUAGE_TOOL,
    effective_voice,
    identity_block,
    language_instruction,
    language_tool,
    stage_persona,
)
from .loader import RESERVED_TOOL, LoadedPlaybook
from .models import LLMConfig, Stage, Transfer, Transition, Voice
from .tools import Tool
from .transfer import transfer_prompt, transfer_tool_schema

__all__ = [
    "LOOP_CONDITIONS",
    "TRANSITION_TOOL",
    "EngineSnapshot",
    "IntentClassifier",
    "IntentResult",
    "PlaybookEngine",
    "TransitionContext",
    "TransitionRecord",
    "TurnFacts",
]

log = logging.getLogger(__name__)

TRANSITION_TOOL = RESERVED_TOOL

EvaluationPoint = Literal["before_turn", "in_loop", "after_turn"]
LOOP_CONDITIONS = frozenset({"tool_call", "custom", "timeout"})
"""The conditions that can come to hold inside a turn's tool loop (an iterative stage's exit
check): the caller's words are examined before the turn (``intent``, ``keyword``), the answer's
after it (``keyword``), and turns are counted at its end (``max_turns``)."""


@dataclass(frozen=True)
class IntentResult:
    intent: str
    confidence: float


IntentClassifier = Callable[[str, Sequence[str]], Awaitable[IntentResult]]
"""``(user_text, candidate_intents) -> IntentResult``; ``intent`` is ``"none"`` when none fits."""


@dataclass(frozen=True)
class TransitionContext:
    """What a ``custom`` condition function receives."""

    stage_id: str
    last_user_message: str | None
    last_assistant_message: str | None
    data: Mapping[str, Any]
    turn_count: int


@dataclass
class TurnFacts:
    """What happened in the turn so far; the engine caches its intent classification here."""

    user_text: str
    assistant_text: str = ""
    tools_called: set[str] = field(default_factory=set)
    intent: IntentResult | None = None
    intent_stage: str | None = None
    """The stage whose intents ``intent`` was classified against."""


@dataclass(frozen=True)
class TransitionRecord:
    transition_id: str
    from_stage: str
    to_stage: str
    at: float
    reason: str | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's conversation state at one moment (:meth:`PlaybookEngine.snapshot`). Its
    fields name the engine attributes a restore puts back: :attr:`PlaybookEngine.UNDONE`."""

    stage: Stage
    turns_in_stage: int
    entered_at: float
    context: dict[str, Any]
    history: list[TransitionRecord]
    entry_note: str | None
    handoff: str | None
    language: str | None


class PlaybookEngine:
    """Tracks the stage of one conversation. ``clock`` returns seconds (monotonic).

    Every attribute is either conversation state (:attr:`UNDONE`, which :meth:`snapshot` and
    :meth:`restore` cover) or fixed for the engine's life (:attr:`FIXED`); a new attribute must
    join one of them (a test checks it).
    """

    UNDONE: ClassVar[tuple[str, ...]] = tuple(f.name for f in fields(EngineSnapshot))
    """The conversation state; declared by :class:`EngineSnapshot`'s fields."""
    FIXED: ClassVar[tuple[str, ...]] = ("playbook", "clock", "on_language", "_builtins")
    """What an undo leaves alone: the playbook, the clock, the callback, and what derives
    from them."""

    def __init__(
        self, playbook: LoadedPlaybook, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.playbook = playbook
        self.clock = clock
        self.stage: Stage = playbook.spec.stage(playbook.spec.initial_stage)
        self.turns_in_stage = 0
        self.entered_at = clock()
        self.context: dict[str, Any] = {}
        self.history: list[TransitionRecord] = []
        self.entry_note: str | None = None
        """The ``transition_message`` of the transition that entered this stage."""
        self.handoff: str | None = None
        """The ``summary`` the LLM passed with the transition that entered this stage."""
        self.language: str | None = playbook.spec.language
        """The conversation's language code (see :mod:`playbooks.identity`)."""
        self.on_language: Callable[[str], None] | None = None
        """Called after ``set_language`` changed the language."""
        self._builtins = {LANGUAGE_TOOL: language_tool(playbook.spec, self.set_language)}

    # -- undo --------------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The conversation state, detached: later changes to the engine do not reach it."""
        return EngineSnapshot(**self._detached({name: getattr(self, name) for name in self.UNDONE}))

    def restore(self, snapshot: EngineSnapshot) -> None:
        """Put the conversation state back to ``snapshot``, which stays detached (reusable).
        Calls no callback: announcing what changed is the caller's business."""
        state = self._detached({name: getattr(snapshot, name) for name in self.UNDONE})
        for name, value in state.items():
            setattr(self, name, value)

    def _detached(self, state: dict[str, Any]) -> dict[str, Any]:
        """A deep copy of ``state``, sharing the playbook's stages: they are immutable, and
        compared by identity (a restore announces a stage that changed)."""
        shared: dict[int, Any] = {id(stage): stage for stage in self.playbook.spec.stages}
        return copy.deepcopy(state, shared)

    # -- what the current stage offers -------------------------------------------------------

    def outgoing(self) -> list[Transition]:
        """Transitions leaving the current stage, by descending priority, then file order."""
        leaving = [t for t in self.playbook.spec.transitions if t.leaves(self.stage.id)]
        return sorted(leaving, key=lambda t: -t.priority)  # sorted() is stable

    def decision_transitions(self) -> list[Transition]:
        """The ``llm_decision`` transitions of this stage, one per target stage (first wins)."""
        by_target: dict[str, Transition] = {}
        for transition in self.outgoing():
            if transition.condition.type == "llm_decision":
                by_target.setdefault(transition.action.target_stage, transition)
        return list(by_target.values())

    def loop_exits(self) -> list[Transition]:
        """The transitions that can end an iterative stage's tool loop: those on
        :data:`LOOP_CONDITIONS`, checked after each round, and ``llm_decision`` ones (the LLM
        calls the transition tool); none that would re-enter this stage."""
        return [
            t
            for t in self.outgoing()
            if t.condition.type in (*LOOP_CONDITIONS, "llm_decision")
            and not _into_itself(t, self.stage.id)
        ]

    def system_prompt(self) -> str:
        """Global prompt + identity block (the persona) + stage prompt (+ the note of the
        transition that entered it) + the stages the LLM may move the conversation to + the
        language line."""
        persona = stage_persona(self.playbook.spec, self.stage)
        parts = [
            self.playbook.spec.global_system_prompt or "",
            identity_block(persona),
            self.stage.system_prompt,
        ]
        if self.entry_note:
            # in the system prompt, not mid-history: many local chat templates reject
            # a system message anywhere but first
            parts.append(f"Note on entering this stage: {self.entry_note}")
        if self.handoff:
            parts.append(f"Handoff notes from the previous stage: {self.handoff}")
        decisions = self.decision_transitions()
        if decisions:
            lines = [
                f"You may move the conversation to another stage by calling {TRANSITION_TOOL}:"
            ]
            for transition in decisions:
                target = self.playbook.spec.stage(transition.action.target_stage)
                about = transition.description or target.description or target.name
                lines.append(f"- {target.id}: {about}")
            parts.append("\n".join(lines))
        transfer = self.transfer()
        if transfer is not None:
            parts.append(transfer_prompt(transfer))
        parts.append(language_instruction(self.playbook.spec, self.language))
        return "\n\n".join(part.strip() for part in parts if part and part.strip())

    def tools(self) -> list[Tool]:
        """Global tools, then the stage's (each once)."""
        names = dict.fromkeys([*self.playbook.spec.global_tool_names, *self.stage.tool_names])
        return [self.find_tool(name) or self.playbook.tools[name] for name in names]

    def transfer(self) -> Transfer | None:
        """Where ``transfer_call`` puts the caller through from this stage (the stage's
        ``transfer``, else the playbook's); None: the tool is not offered."""
        return self.stage.transfer or self.playbook.spec.transfer

    def find_tool(self, name: str) -> Tool | None:
        """The playbook's tool or built-in tool called ``name``, offered here or not."""
        return self._builtins.get(name) or self.playbook.tools.get(name)

    def voice(self) -> Voice | None:
        """The voice in effect (stage, playbook and language layered); None: the server's."""
        spec = self.playbook.spec
        return effective_voice(spec, self.stage, self.language, self.playbook.source)

    def set_language(self, code: str) -> None:
        """Speak ``code`` from now on (a configured code, or any name without ``languages``)."""
        self.language = code
        if self.on_language is not None:
            self.on_language(code)

    def tool_schemas(self) -> list[dict[str, Any]]:
        schemas = [tool.openai_schema() for tool in self.tools()]
        transition_tool = self.transition_tool_schema()
        if transition_tool is not None:
            schemas.append(transition_tool)
        delegates = self.stage.delegates
        if delegates is not None:
            spec = self.playbook.spec
            about = {s.id: s.description or s.name for s in spec.stages}
            schemas.append(delegate_tool_schema(delegates, about))
        transfer = self.transfer()
        if transfer is not None:
            schemas.append(transfer_tool_schema(transfer))
        return schemas

    def transition_tool_schema(self) -> dict[str, Any] | None:
        """The ``playbook_transition`` tool, offered only when an ``llm_decision`` leaves here."""
        decisions = self.decision_transitions()
        targets = [t.action.target_stage for t in decisions]
        if not targets:
            return None
        summarized = [t.action.target_stage for t in decisions if _needs_summary(t)]
        schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": TRANSITION_TOOL,
                "description": "Move the conversation to another stage of the playbook.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "target_stage": {
                            "type": "string",
                            "enum": targets,
                            "description": "The stage to move to.",
                        },
                        "reason": {
                            "type": "string",
                            "description": "Why the conversation should move now.",
                        },
                        "data": {
                            "type": "object",
                            "description": "Facts gathered so far that the next stage needs.",
                        },
                    },
                    "required": ["target_stage", "reason"],
                },
            },
        }
        if summarized:
            parameters = schema["function"]["parameters"]
            parameters["properties"]["summary"] = {
                "type": "string",
                "description": "Handoff notes for the next stage: what the caller wants and"
                f" every fact gathered so far. Required when moving to: {', '.join(summarized)}.",
            }
            if len(summarized) == len(targets):
                parameters["required"].append("summary")
        return schema

    def llm_config(self) -> LLMConfig:
        return self.stage.llm_config.merged_over(self.playbook.spec.default_llm_config)

    # -- evaluation ----------------------------------------------------------------------------

    def decision_for(self, target_stage: str) -> Transition | None:
        """The ``llm_decision`` transition from here to ``target_stage``, if one exists."""
        for transition in self.decision_transitions():
            if transition.action.target_stage == target_stage:
                return transition
        return None

    async def evaluate(
        self,
        point: EvaluationPoint,
        facts: TurnFacts,
        classify_intent: IntentClassifier | None = None,
    ) -> Transition | None:
        """The first matching transition leaving the current stage, or None.

        Before a turn only conditions on the user's words (``intent``, ``keyword`` with
        ``in: user|either``) are considered, so the new stage answers the same turn; after it,
        every other condition but ``llm_decision`` (which fires when the LLM calls the transition
        tool), and ``keyword`` with ``in: either`` on the answer. ``in_loop`` (after a round of
        an iterative stage's tool loop) considers only :data:`LOOP_CONDITIONS`. The user's words
        are examined once per turn, so they cannot move the conversation twice. ``intent`` costs
        one classifier call per turn, made only when such a transition is reached. A
        ``from: "*"`` transition never fires into the stage the conversation is already in.
        """
        for transition in self.outgoing():
            if _into_itself(transition, self.stage.id):
                continue
            kind = transition.condition.type
            if point == "before_turn" and not _user_dependent(transition):
                continue
            if point == "in_loop" and kind not in LOOP_CONDITIONS:
                continue
            if point == "after_turn" and kind == "intent":
                continue
            if await self._matches(transition, facts, classify_intent, point):
                return transition
        return None

    async def _matches(
        self,
        transition: Transition,
        facts: TurnFacts,
        classify_intent: IntentClassifier | None,
        point: EvaluationPoint,
    ) -> bool:
        condition = transition.condition
        match condition.type:
            case "keyword":
                user = [facts.user_text] if point == "before_turn" else []
                assistant = [facts.assistant_text] if point == "after_turn" else []
                texts = {"assistant": assistant, "user": user, "either": user + assistant}[
                    condition.match_in
                ]
                return any(_contains_word(text, kw) for text in texts for kw in condition.keywords)
            case "tool_call":
                return condition.tool_name in facts.tools_called
            case "intent":
                if classify_intent is None:
                    return False
                if facts.intent is None or facts.intent_stage != self.stage.id:
                    # once per turn, again only if a transition brought other intents into play
                    facts.intent = await classify_intent(facts.user_text, self._intents())
                    facts.intent_stage = self.stage.id
                return (
                    facts.intent.intent.strip().lower() == condition.intent.strip().lower()
                    and facts.intent.confidence >= condition.confidence
                )
            case "llm_decision":
                return False
            case "max_turns":
                count = condition.count or self.stage.max_turns
                return count is not None and self.turns_in_stage >= count
            case "timeout":
                duration_ms = condition.duration_ms or self.stage.timeout_ms
                return (
                    duration_ms is not None
                    and (self.clock() - self.entered_at) * 1000 >= duration_ms
                )
            case "custom":
                return await self._custom(condition.function, facts)
        return False

    def _intents(self) -> list[str]:
        return list(
            dict.fromkeys(
                t.condition.intent for t in self.outgoing() if t.condition.type == "intent"
            )
        )

    async def _custom(self, name: str, facts: TurnFacts) -> bool:
        function = self.playbook.functions[name]
        context = TransitionContext(
            stage_id=self.stage.id,
            last_user_message=facts.user_text,
            last_assistant_message=facts.assistant_text or None,
            data=dict(self.context),
            turn_count=self.turns_in_stage,
        )
        try:
            result = function(context)
            if inspect.isawaitable(result):
                result = await result
        except Exception:
            log.exception("custom condition %r raised; treated as not matching", name)
            return False
        return bool(result)

    # -- moving --------------------------------------------------------------------------------

    def complete_turn(self) -> None:
        self.turns_in_stage += 1

    def apply(
        self,
        transition: Transition,
        *,
        reason: str | None = None,
        data: Mapping[str, Any] = {},
        summary: str | None = None,
    ) -> TransitionRecord:
        """Enter the transition's target stage: resets the turn count and the stage clock, and
        merges the action's data and ``data`` (from the LLM) into the context. ``summary`` (the
        LLM's handoff notes) goes into the new stage's system prompt."""
        record = TransitionRecord(
            transition_id=transition.id,
            from_stage=self.stage.id,
            to_stage=transition.action.target_stage,
            at=self.clock(),
            reason=reason,
        )
        self.context.update(transition.action.data)
        self.context.update(data)
        self.stage = self.playbook.spec.stage(transition.action.target_stage)
        self.entry_note = transition.action.transition_message
        self.handoff = summary
        self.turns_in_stage = 0
        self.entered_at = record.at
        self.history.append(record)
        return record


def _needs_summary(transition: Transition) -> bool:
    condition = transition.condition
    return condition.type == "llm_decision" and condition.require_summary


def _into_itself(transition: Transition, stage_id: str) -> bool:
    """A ``from: "*"`` transition into ``stage_id``, the stage it would leave: it never fires."""
    return transition.from_stage == "*" and transition.action.target_stage == stage_id


def _user_dependent(transition: Transition) -> bool:
    condition = transition.condition
    if condition.type == "intent":
        return True
    return condition.type == "keyword" and condition.match_in in ("user", "either")


def _contains_word(text: str, keyword: str) -> bool:
    if not keyword.strip():
        return False
    pattern = rf"(?<!\w){re.escape(keyword.strip())}(?!\w)"
    return re.search(pattern, text, flags=re.IGNORECASE) is not None
