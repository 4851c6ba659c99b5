"""The playbook engine: transition priority, every condition type, the transition tool, prompts."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from playbooks import (
    EngineSnapshot,
    IntentResult,
    LoadedPlaybook,
    Playbook,
    PlaybookEngine,
    Tool,
    TransitionContext,
    TurnFacts,
    load_playbook,
)
from playbooks.engine import TRANSITION_TOOL

WritePlaybook = Callable[..., Path]


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Classifier:
    """An intent classifier returning a fixed answer and recording its calls."""

    def __init__(self, intent: str = "none", confidence: float = 0.9) -> None:
        self.intent = intent
        self.confidence = confidence
        self.calls: list[tuple[str, list[str]]] = []

    async def __call__(self, user_text: str, intents: Sequence[str]) -> IntentResult:
        self.calls.append((user_text, list(intents)))
        return IntentResult(self.intent, self.confidence)


def lookup(order_id: str) -> str:
    """Look up an order."""
    return order_id


def cancel(order_id: str) -> str:
    """Cancel an order."""
    return order_id


def hours() -> str:
    """Opening hours."""
    return "always"


TOOLS = {t.name: t for t in (Tool.from_function(f) for f in (lookup, cancel, hours))}

STAGES: list[dict[str, Any]] = [
    {"id": "a", "name": "Stage A", "system_prompt": "You are in A.", "tools": ["lookup"]},
    {
        "id": "b",
        "name": "Stage B",
        "description": "Where B things happen.",
        "system_prompt": "You are in B.",
        "tools": ["cancel", "hours"],
    },
    {"id": "c", "name": "Stage C", "system_prompt": "You are in C."},
    {"id": "d", "name": "Stage D", "system_prompt": "You are in D."},
]


def transition(
    id: str,
    condition: dict[str, Any],
    to: str = "b",
    *,
    source: str = "a",
    priority: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    action = {"target_stage": to, **extra.pop("action", {})}
    return {
        "id": id,
        "from": source,
        "priority": priority,
        "condition": condition,
        "action": action,
        **extra,
    }


def engine_for(
    transitions: list[dict[str, Any]],
    *,
    stages: list[dict[str, Any]] | None = None,
    functions: Mapping[str, Callable[..., Any]] | None = None,
    clock: Callable[[], float] | None = None,
    **playbook: Any,
) -> PlaybookEngine:
    spec = Playbook.model_validate(
        {
            "id": "test",
            "name": "Test",
            "initial_stage": "a",
            "stages": STAGES if stages is None else stages,
            "transitions": transitions,
            **playbook,
        }
    )
    loaded = LoadedPlaybook.from_spec(spec, TOOLS, functions)
    return PlaybookEngine(loaded) if clock is None else PlaybookEngine(loaded, clock)


def keyword(*words: str, match_in: str | None = None) -> dict[str, Any]:
    condition: dict[str, Any] = {"type": "keyword", "keywords": list(words)}
    if match_in is not None:
        condition["in"] = match_in
    return condition


def intent(name: str, confidence: float | None = None) -> dict[str, Any]:
    condition: dict[str, Any] = {"type": "intent", "intent": name}
    if confidence is not None:
        condition["confidence"] = confidence
    return condition


LLM_DECISION = {"type": "llm_decision"}


async def after(
    engine: PlaybookEngine,
    user: str = "",
    assistant: str = "",
    tools: set[str] | None = None,
    classifier: Classifier | None = None,
) -> str | None:
    facts = TurnFacts(user, assistant, tools or set())
    found = await engine.evaluate("after_turn", facts, classifier)
    return None if found is None else found.id


async def before(
    engine: PlaybookEngine, user: str, classifier: Classifier | None = None
) -> str | None:
    found = await engine.evaluate("before_turn", TurnFacts(user), classifier)
    return None if found is None else found.id


# -- state -----------------------------------------------------------------------------------------


def test_initial_state() -> None:
    clock = FakeClock(50.0)
    engine = engine_for([], clock=clock)
    assert engine.stage.id == "a"
    assert engine.turns_in_stage == 0
    assert engine.entered_at == 50.0
    assert engine.context == {}
    assert engine.history == []


# -- priority and order ----------------------------------------------------------------------------


def test_outgoing_by_descending_priority_then_file_order() -> None:
    engine = engine_for(
        [
            transition("p0_first", keyword("x")),
            transition("p5_first", keyword("x"), priority=5),
            transition("p0_second", keyword("x")),
            transition("elsewhere", keyword("x"), source="b", priority=100),
            transition("p5_second", keyword("x"), priority=5),
            transition("negative", keyword("x"), priority=-1),
            transition("star", keyword("x"), source="*", priority=1),
        ]
    )
    assert [t.id for t in engine.outgoing()] == [
        "p5_first",
        "p5_second",
        "star",
        "p0_first",
        "p0_second",
        "negative",
    ]


async def test_higher_priority_wins_over_file_order() -> None:
    engine = engine_for(
        [
            transition("low", keyword("order"), "b"),
            transition("high", keyword("order"), "c", priority=3),
        ]
    )
    assert await after(engine, assistant="your order") == "high"


async def test_equal_priority_first_in_file_wins() -> None:
    engine = engine_for(
        [
            transition("first", keyword("order"), "b"),
            transition("second", keyword("order"), "c"),
        ]
    )
    assert await after(engine, assistant="your order") == "first"


async def test_a_non_matching_higher_priority_transition_is_skipped() -> None:
    engine = engine_for(
        [
            transition("matches", keyword("order"), "b"),
            transition("does_not", keyword("refund"), "c", priority=9),
        ]
    )
    assert await after(engine, assistant="your order") == "matches"


async def test_no_match_gives_none() -> None:
    engine = engine_for([transition("t", keyword("order"))])
    assert await after(engine, user="hello", assistant="hi") is None


async def test_from_star_matches_in_any_stage() -> None:
    engine = engine_for(
        [
            transition("to_b", keyword("next")),
            transition("anywhere", keyword("bye"), "d", source="*"),
            transition("from_c_only", keyword("bye"), "a", source="c", priority=9),
        ]
    )
    assert await after(engine, assistant="bye") == "anywhere"
    engine.apply(engine.playbook.spec.transitions[0])
    assert engine.stage.id == "b"
    assert await after(engine, assistant="bye") == "anywhere"
    assert await after(engine, assistant="next") is None, "to_b leaves a, not b"


async def test_transitions_of_other_stages_are_ignored() -> None:
    engine = engine_for([transition("from_b", keyword("x"), "c", source="b")])
    assert engine.outgoing() == []
    assert await after(engine, user="x", assistant="x") is None


# -- keyword ---------------------------------------------------------------------------------------


async def test_keyword_defaults_to_the_assistant_text() -> None:
    engine = engine_for([transition("t", keyword("order"))])
    assert await after(engine, user="my order please", assistant="sure") is None
    assert await after(engine, user="hi", assistant="Your order ships today.") == "t"


async def test_keyword_in_user() -> None:
    engine = engine_for([transition("t", keyword("order", match_in="user"))])
    assert await before(engine, "hi") is None
    assert await before(engine, "about my order") == "t"
    # the user's words are examined once, before Phase 1; never the assistant's
    assert await after(engine, user="about my order", assistant="your order") is None


async def test_keyword_in_either() -> None:
    engine = engine_for([transition("t", keyword("order", match_in="either"))])
    assert await before(engine, "about my order") == "t"
    assert await after(engine, user="hi", assistant="your order") == "t"
    assert await after(engine, user="about my order", assistant="sure") is None
    assert await after(engine, user="hi", assistant="hello") is None


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("Where is my order?", True),
        ("ORDER", True),
        ("my Order, please", True),
        ("order-1234", True),
        ("(order)", True),
        ("my orders", False),
        ("reorder it", False),
        ("the border", False),
        ("my_order", False),
        ("order2", False),
    ],
)
async def test_keyword_matches_whole_words_case_insensitively(text: str, matches: bool) -> None:
    engine = engine_for([transition("t", keyword("order"))])
    assert (await after(engine, assistant=text) == "t") is matches


async def test_any_keyword_matches_and_phrases_work() -> None:
    engine = engine_for([transition("t", keyword("bye", "that's all", "c++"))])
    assert await after(engine, assistant="OK, That's all for today.") == "t"
    assert await after(engine, assistant="Bye!") == "t"
    assert await after(engine, assistant="I code in C++ mostly") == "t"
    assert await after(engine, assistant="that is all") is None
    assert await after(engine, assistant="byebye") is None


# -- tool_call -------------------------------------------------------------------------------------


async def test_tool_call_matches_tools_called_this_turn() -> None:
    engine = engine_for(
        [transition("t", {"type": "tool_call", "tool_name": "lookup"})],
    )
    assert await after(engine, tools={"lookup"}) == "t"
    assert await after(engine, tools={"lookup", "cancel"}) == "t"
    assert await after(engine, tools={"cancel"}) is None
    assert await after(engine, assistant="lookup") is None


# -- intent ----------------------------------------------------------------------------------------


async def test_intent_matches_with_enough_confidence() -> None:
    engine = engine_for([transition("t", intent("book", confidence=0.6))])
    assert await before(engine, "a table please", Classifier("book", 0.6)) == "t"
    assert await before(engine, "a table please", Classifier("book", 0.59)) is None
    assert await before(engine, "a table please", Classifier("cancel", 1)) is None
    assert await before(engine, "hm", Classifier("none", 1)) is None
    # intents are classified before Phase 1 only: the words do not change after it
    classifier = Classifier("book", 1)
    assert await after(engine, user="a table please", classifier=classifier) is None
    assert classifier.calls == []


async def test_intent_default_confidence_is_0_7() -> None:
    engine = engine_for([transition("t", intent("book"))])
    assert await before(engine, "x", Classifier("book", 0.7)) == "t"
    assert await before(engine, "x", Classifier("book", 0.69)) is None


async def test_intent_names_compare_case_insensitively() -> None:
    engine = engine_for([transition("t", intent("book_table"))])
    assert await before(engine, "x", Classifier(" Book_Table ", 0.9)) == "t"


async def test_intent_classifier_called_once_per_turn_with_all_candidates() -> None:
    engine = engine_for(
        [
            transition("cancel", intent("cancel"), "c"),
            transition("book", intent("book"), "b", priority=2),
            transition("book_again", intent("book", confidence=0.1), "d"),
            transition("other_stage", intent("complain"), "a", source="b"),
        ]
    )
    classifier = Classifier("cancel", 0.9)
    facts = TurnFacts("please cancel it")
    found = await engine.evaluate("before_turn", facts, classifier)
    assert found is not None
    assert found.id == "cancel"
    assert classifier.calls == [("please cancel it", ["book", "cancel"])]
    assert facts.intent == IntentResult("cancel", 0.9)


async def test_intent_classification_is_shared_by_before_and_after_turn() -> None:
    engine = engine_for([transition("t", intent("book"))])
    classifier = Classifier("none", 0.9)
    facts = TurnFacts("hello")
    assert await engine.evaluate("before_turn", facts, classifier) is None
    facts.assistant_text = "Hello! How can I help?"
    assert await engine.evaluate("after_turn", facts, classifier) is None
    assert len(classifier.calls) == 1


async def test_intent_classifier_called_again_next_turn() -> None:
    engine = engine_for([transition("t", intent("book"))])
    classifier = Classifier("none", 0.9)
    assert await before(engine, "first", classifier) is None
    assert await before(engine, "second", classifier) is None
    assert [text for text, _ in classifier.calls] == ["first", "second"]


async def test_intent_classifier_not_called_without_a_reachable_intent_transition() -> None:
    engine = engine_for(
        [
            transition("kw", keyword("hello", match_in="user")),
            transition("b_intent", intent("book"), "c", source="b"),
        ]
    )
    classifier = Classifier("book", 1.0)
    assert await before(engine, "hi there", classifier) is None
    assert await after(engine, user="hi there", assistant="hi", classifier=classifier) is None
    assert classifier.calls == []


async def test_intent_classifier_not_called_when_a_higher_transition_matches() -> None:
    engine = engine_for(
        [
            transition("book", intent("book"), "b"),
            transition("bye", keyword("bye", match_in="user"), "d", priority=10),
        ]
    )
    classifier = Classifier("book", 1.0)
    assert await before(engine, "ok bye", classifier) == "bye"
    assert await after(engine, user="ok bye", assistant="x", classifier=classifier) is None
    assert classifier.calls == []


async def test_intent_classifier_called_when_reached_after_non_matching_ones() -> None:
    engine = engine_for(
        [
            transition("book", intent("book"), "b"),
            transition("bye", keyword("bye", match_in="user"), "d", priority=10),
        ]
    )
    classifier = Classifier("book", 1.0)
    assert await before(engine, "a table for two", classifier) == "book"
    assert len(classifier.calls) == 1


async def test_intent_without_a_classifier_never_matches() -> None:
    engine = engine_for([transition("t", intent("book"))])
    assert await before(engine, "a table please") is None
    assert await after(engine, user="a table please", assistant="sure") is None


# -- llm_decision ----------------------------------------------------------------------------------


async def test_llm_decision_never_matches_in_evaluate() -> None:
    engine = engine_for([transition("t", LLM_DECISION, description="Go to B.")])
    classifier = Classifier("anything", 1.0)
    assert await before(engine, "go to b", classifier) is None
    assert await after(engine, "go to b", "going to b", {TRANSITION_TOOL}, classifier) is None
    assert classifier.calls == []


def test_decision_for_finds_the_llm_decision_transition_to_a_target() -> None:
    engine = engine_for(
        [
            transition("kw_to_b", keyword("x"), "b", priority=9),
            transition("to_b", LLM_DECISION, "b"),
            transition("to_b_again", LLM_DECISION, "b"),
            transition("to_c", LLM_DECISION, "c", source="*"),
            transition("b_to_d", LLM_DECISION, "d", source="b"),
        ]
    )
    found_b = engine.decision_for("b")
    found_c = engine.decision_for("c")
    assert found_b is not None
    assert found_b.id == "to_b"
    assert found_c is not None
    assert found_c.id == "to_c"
    assert engine.decision_for("d") is None, "that decision leaves another stage"
    assert engine.decision_for("nowhere") is None
    assert engine.decision_for("a") is None


def test_decision_for_prefers_the_higher_priority() -> None:
    engine = engine_for(
        [
            transition("plain", LLM_DECISION, "b"),
            transition("urgent", LLM_DECISION, "b", priority=1),
        ]
    )
    found = engine.decision_for("b")
    assert found is not None
    assert found.id == "urgent"


# -- max_turns -------------------------------------------------------------------------------------


async def test_max_turns_counts_completed_turns() -> None:
    engine = engine_for([transition("t", {"type": "max_turns", "count": 2})])
    assert await after(engine) is None
    engine.complete_turn()
    assert engine.turns_in_stage == 1
    assert await after(engine) is None
    engine.complete_turn()
    assert await after(engine) == "t"


async def test_max_turns_defaults_to_the_stage_setting() -> None:
    stages = [{**STAGES[0], "max_turns": 3}, *STAGES[1:]]
    engine = engine_for([transition("t", {"type": "max_turns"})], stages=stages)
    for _ in range(2):
        engine.complete_turn()
        assert await after(engine) is None
    engine.complete_turn()
    assert await after(engine) == "t"


async def test_max_turns_count_overrides_the_stage_setting() -> None:
    stages = [{**STAGES[0], "max_turns": 5}, *STAGES[1:]]
    engine = engine_for([transition("t", {"type": "max_turns", "count": 1})], stages=stages)
    engine.complete_turn()
    assert await after(engine) == "t"


async def test_max_turns_is_not_evaluated_before_the_turn() -> None:
    engine = engine_for([transition("t", {"type": "max_turns", "count": 1})])
    engine.complete_turn()
    assert await before(engine, "hello") is None
    assert await after(engine, user="hello") == "t"


# -- timeout ---------------------------------------------------------------------------------------


async def test_timeout_uses_the_injected_clock() -> None:
    clock = FakeClock()
    engine = engine_for([transition("t", {"type": "timeout", "duration_ms": 1500})], clock=clock)
    assert await after(engine) is None
    clock.advance(1.499)
    assert await after(engine) is None
    clock.advance(0.001)
    assert await after(engine) == "t"


async def test_timeout_defaults_to_the_stage_setting() -> None:
    clock = FakeClock()
    stages = [{**STAGES[0], "timeout_ms": 250}, *STAGES[1:]]
    engine = engine_for([transition("t", {"type": "timeout"})], stages=stages, clock=clock)
    clock.advance(0.2)
    assert await after(engine) is None
    clock.advance(0.05)
    assert await after(engine) == "t"


async def test_timeout_is_not_evaluated_before_the_turn() -> None:
    clock = FakeClock()
    engine = engine_for([transition("t", {"type": "timeout", "duration_ms": 10})], clock=clock)
    clock.advance(60)
    assert await before(engine, "hello") is None
    assert await after(engine, user="hello") == "t"


# -- custom ----------------------------------------------------------------------------------------


async def test_custom_function_receives_the_transition_context() -> None:
    seen: list[TransitionContext] = []

    def check(context: TransitionContext) -> bool:
        seen.append(context)
        return context.data.get("vip") is True

    engine = engine_for(
        [
            transition("enter_b", keyword("go"), "b", action={"data": {"vip": True}}),
            transition("t", {"type": "custom", "function": "check"}, "c", source="b"),
        ],
        functions={"check": check},
    )
    engine.apply(engine.playbook.spec.transitions[0])
    engine.complete_turn()
    engine.complete_turn()
    assert await after(engine, user="I need help", assistant="Sure thing.") == "t"
    assert seen == [
        TransitionContext(
            stage_id="b",
            last_user_message="I need help",
            last_assistant_message="Sure thing.",
            data={"vip": True},
            turn_count=2,
        )
    ]


async def test_custom_context_without_an_assistant_answer() -> None:
    seen: list[TransitionContext] = []

    def check(context: TransitionContext) -> bool:
        seen.append(context)
        return False

    engine = engine_for(
        [transition("t", {"type": "custom", "function": "check"})], functions={"check": check}
    )
    assert await after(engine, user="hi") is None
    assert seen[0].last_assistant_message is None
    assert seen[0].data == {}
    assert seen[0].turn_count == 0


async def test_custom_context_data_is_a_copy() -> None:
    def meddle(context: TransitionContext) -> bool:
        context.data["injected"] = True  # type: ignore[index]
        return False

    engine = engine_for(
        [transition("t", {"type": "custom", "function": "meddle"})], functions={"meddle": meddle}
    )
    await after(engine)
    assert engine.context == {}


async def test_async_custom_function() -> None:
    async def check(context: TransitionContext) -> bool:
        return "urgent" in (context.last_user_message or "")

    engine = engine_for(
        [transition("t", {"type": "custom", "function": "check"})], functions={"check": check}
    )
    assert await after(engine, user="this is urgent") == "t"
    assert await after(engine, user="no rush") is None


async def test_custom_function_truthiness() -> None:
    answers: list[Any] = [1, "", None, ["x"]]

    def check(context: TransitionContext) -> Any:
        return answers.pop(0)

    engine = engine_for(
        [transition("t", {"type": "custom", "function": "check"})], functions={"check": check}
    )
    assert [await after(engine) for _ in range(4)] == ["t", None, None, "t"]


@pytest.mark.parametrize("is_async", [False, True])
async def test_raising_custom_function_is_no_match(
    is_async: bool, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_sync(context: TransitionContext) -> bool:
        raise RuntimeError("custom condition bug")

    async def broken_async(context: TransitionContext) -> bool:
        raise RuntimeError("custom condition bug")

    engine = engine_for(
        [
            transition("broken", {"type": "custom", "function": "broken"}, "c", priority=5),
            transition("fallback", keyword("hello")),
        ],
        functions={"broken": broken_async if is_async else broken_sync},
    )
    with caplog.at_level(logging.ERROR, logger="playbooks.engine"):
        assert await after(engine, assistant="hello") == "fallback"
        assert await after(engine, assistant="bye") is None
    assert "'broken'" in caplog.text


async def test_custom_is_not_evaluated_before_the_turn() -> None:
    calls: list[TransitionContext] = []

    def check(context: TransitionContext) -> bool:
        calls.append(context)
        return True

    engine = engine_for(
        [transition("t", {"type": "custom", "function": "check"})], functions={"check": check}
    )
    assert await before(engine, "hello") is None
    assert calls == []


async def test_custom_functions_from_a_tools_module(write_playbook: WritePlaybook) -> None:
    path = write_playbook(
        """\
        id: p
        name: P
        initial_stage: a
        tools_module: tools.py
        stages:
          - {id: a, name: A, system_prompt: In A.}
          - {id: b, name: B, system_prompt: In B.}
        transitions:
          - id: by_sync
            from: a
            condition: {type: custom, function: wants_b}
            action: {target_stage: b}
          - id: by_async
            from: b
            condition: {type: custom, function: wants_a}
            action: {target_stage: a}
        """,
        """\
        async def wants_a(context):
            return context.stage_id == "b" and "back" in context.last_user_message

        def wants_b(context):
            return context.turn_count >= 1 and context.last_assistant_message == "ok"
        """,
    )
    engine = PlaybookEngine(load_playbook(path))
    assert await after(engine, user="x", assistant="ok") is None, "no completed turn yet"
    engine.complete_turn()
    found = await engine.evaluate("after_turn", TurnFacts("x", "ok"))
    assert found is not None
    assert found.id == "by_sync"
    engine.apply(found)
    assert await after(engine, user="stay", assistant="ok") is None
    assert await after(engine, user="go back", assistant="ok") == "by_async"


# -- before_turn -----------------------------------------------------------------------------------


async def test_before_turn_evaluates_only_conditions_on_the_user_words() -> None:
    clock = FakeClock()
    custom_calls: list[TransitionContext] = []

    def always(context: TransitionContext) -> bool:
        custom_calls.append(context)
        return True

    engine = engine_for(
        [
            transition("custom", {"type": "custom", "function": "always"}, priority=9),
            transition("turns", {"type": "max_turns", "count": 1}, priority=8),
            transition("time", {"type": "timeout", "duration_ms": 1}, priority=7),
            transition("tool", {"type": "tool_call", "tool_name": "lookup"}, priority=6),
            transition("decision", LLM_DECISION, priority=5),
            transition("assistant_kw", keyword("order"), priority=4),
            transition("user_kw", keyword("order", match_in="user"), "c"),
        ],
        functions={"always": always},
        clock=clock,
    )
    engine.complete_turn()
    clock.advance(5)
    facts = TurnFacts("my order", assistant_text="order", tools_called={"lookup"})
    found = await engine.evaluate("before_turn", facts)
    assert found is not None
    assert found.id == "user_kw"
    assert custom_calls == []


@pytest.mark.parametrize(("match_in", "expected"), [("user", "t"), ("either", "t")])
async def test_before_turn_evaluates_user_and_either_keywords(match_in: str, expected: str) -> None:
    engine = engine_for([transition("t", keyword("refund", match_in=match_in))])
    assert await before(engine, "I want a refund") == expected
    assert await before(engine, "hello") is None


async def test_before_turn_evaluates_intents() -> None:
    engine = engine_for([transition("t", intent("book"))])
    classifier = Classifier("book", 0.95)
    assert await before(engine, "table for two", classifier) == "t"
    assert classifier.calls == [("table for two", ["book"])]


async def test_before_turn_without_user_dependent_transitions_matches_nothing() -> None:
    engine = engine_for([transition("t", keyword("order"))])
    assert await before(engine, "order order order") is None


# -- the playbook_transition tool ------------------------------------------------------------------


def test_no_transition_tool_without_an_llm_decision_leaving_the_stage() -> None:
    engine = engine_for(
        [
            transition("kw", keyword("x")),
            transition("from_b", LLM_DECISION, "c", source="b"),
        ]
    )
    assert engine.transition_tool_schema() is None
    assert engine.decision_transitions() == []
    names = [schema["function"]["name"] for schema in engine.tool_schemas()]
    assert names == ["lookup"]


def test_transition_tool_schema() -> None:
    engine = engine_for(
        [
            transition("to_b", LLM_DECISION, "b"),
            transition("kw_to_d", keyword("x"), "d"),
            transition("to_c", LLM_DECISION, "c", priority=2),
            transition("to_b_again", LLM_DECISION, "b"),
            transition("star_to_d", LLM_DECISION, "d", source="*"),
            transition("from_b", LLM_DECISION, "a", source="b"),
        ]
    )
    assert engine.transition_tool_schema() == {
        "type": "function",
        "function": {
            "name": "playbook_transition",
            "description": "Move the conversation to another stage of the playbook.",
            "parameters": {
                "type": "object",
                "properties": {
                    "target_stage": {
                        "type": "string",
                        "enum": ["c", "b", "d"],
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
    assert TRANSITION_TOOL == "playbook_transition"


def test_transition_tool_follows_the_current_stage() -> None:
    engine = engine_for(
        [
            transition("a_to_b", LLM_DECISION, "b"),
            transition("b_to_c", LLM_DECISION, "c", source="b"),
            transition("b_to_d", LLM_DECISION, "d", source="b"),
        ]
    )
    engine.apply(engine.playbook.spec.transitions[0])
    schema = engine.transition_tool_schema()
    assert schema is not None
    assert schema["function"]["parameters"]["properties"]["target_stage"]["enum"] == ["c", "d"]
    engine.apply(engine.playbook.spec.transitions[1])
    assert engine.transition_tool_schema() is None


def test_tools_offered_are_global_then_stage_then_transition_tool() -> None:
    engine = engine_for(
        [
            transition("a_to_b", LLM_DECISION, "b"),
            transition("b_to_c", keyword("x"), "c", source="b"),
        ],
        global_tools=["hours", "lookup"],
    )
    assert [t.name for t in engine.tools()] == ["hours", "lookup"], "each tool once"
    schemas = engine.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["hours", "lookup", "playbook_transition"]
    assert schemas[0] == TOOLS["hours"].openai_schema()
    engine.apply(engine.playbook.spec.transitions[0])
    assert [s["function"]["name"] for s in engine.tool_schemas()] == ["hours", "lookup", "cancel"]


# -- prompts and settings --------------------------------------------------------------------------


def test_system_prompt_lists_the_llm_decision_targets() -> None:
    stages = [*STAGES[:3], {**STAGES[3], "description": "The D stage."}]
    engine = engine_for(
        [
            transition("to_b", LLM_DECISION, "b"),
            transition("to_c", LLM_DECISION, "c", description="The caller is done."),
            transition("to_d", LLM_DECISION, "d", source="*"),
            transition("kw", keyword("x"), "c", priority=9),
        ],
        stages=stages,
        global_system_prompt="  You are Vocable.  ",
    )
    assert engine.system_prompt() == (
        "You are Vocable.\n\n"
        "You are in A.\n\n"
        "You may move the conversation to another stage by calling playbook_transition:\n"
        "- b: Where B things happen.\n"
        "- c: The caller is done.\n"
        "- d: The D stage."
    )


def test_system_prompt_falls_back_to_the_stage_name() -> None:
    engine = engine_for([transition("to_c", LLM_DECISION, "c")])
    assert engine.system_prompt().endswith("- c: Stage C")


def test_system_prompt_without_global_prompt_or_decisions() -> None:
    engine = engine_for([transition("kw", keyword("x"))])
    assert engine.system_prompt() == "You are in A."
    with_global = engine_for([], global_system_prompt="Be brief.")
    assert with_global.system_prompt() == "Be brief.\n\nYou are in A."


def test_system_prompt_follows_the_stage() -> None:
    engine = engine_for([transition("to_b", LLM_DECISION, "b")], global_system_prompt="G.")
    engine.apply(engine.playbook.spec.transitions[0])
    assert engine.system_prompt() == "G.\n\nYou are in B."


def test_llm_config_is_the_stage_over_the_playbook_default() -> None:
    stages = [{**STAGES[0], "llm_config": {"temperature": 0.1}}, *STAGES[1:]]
    engine = engine_for(
        [],
        stages=stages,
        default_llm_config={"model": "m", "temperature": 0.7, "max_tokens": 99},
    )
    config = engine.llm_config()
    assert (config.model, config.temperature, config.max_tokens, config.top_p) == (
        "m",
        0.1,
        99,
        None,
    )


# -- apply -----------------------------------------------------------------------------------------


async def test_apply_enters_the_target_stage() -> None:
    clock = FakeClock(100.0)
    engine = engine_for(
        [
            transition(
                "to_b",
                LLM_DECISION,
                "b",
                action={"data": {"order": "A1", "source": "action"}},
            ),
            transition("b_timeout", {"type": "timeout", "duration_ms": 1000}, "c", source="b"),
            transition("b_turns", {"type": "max_turns", "count": 2}, "d", source="b"),
        ],
        clock=clock,
    )
    engine.context["earlier"] = 1
    engine.complete_turn()
    engine.complete_turn()
    clock.advance(30)

    record = engine.apply(
        engine.playbook.spec.transitions[0],
        reason="order found",
        data={"source": "llm", "status": "shipped"},
    )

    assert engine.stage.id == "b"
    assert engine.turns_in_stage == 0
    assert engine.entered_at == 130.0
    assert engine.context == {"earlier": 1, "order": "A1", "source": "llm", "status": "shipped"}
    assert record.transition_id == "to_b"
    assert (record.from_stage, record.to_stage) == ("a", "b")
    assert record.at == 130.0
    assert record.reason == "order found"
    assert engine.history == [record]

    # the new stage's clock and turn count start from zero
    assert await after(engine) is None
    clock.advance(0.999)
    engine.complete_turn()
    assert await after(engine) is None
    clock.advance(0.001)
    assert await after(engine) == "b_timeout"


async def test_apply_records_every_transition() -> None:
    clock = FakeClock(0.0)
    engine = engine_for(
        [
            transition("a_to_b", keyword("x"), "b", action={"data": {"step": 1}}),
            transition("b_to_a", keyword("x"), "a", source="b", action={"data": {"step": 2}}),
        ],
        clock=clock,
    )
    first = engine.apply(engine.playbook.spec.transitions[0])
    clock.advance(5)
    second = engine.apply(engine.playbook.spec.transitions[1])
    assert [(r.transition_id, r.from_stage, r.to_stage, r.at) for r in engine.history] == [
        ("a_to_b", "a", "b", 0.0),
        ("b_to_a", "b", "a", 5.0),
    ]
    assert first.reason is None
    assert second.reason is None
    assert engine.context == {"step": 2}
    assert engine.stage.id == "a"


async def test_a_wildcard_transition_never_fires_into_the_current_stage() -> None:
    engine = engine_for(
        [
            transition("to_a", keyword("bye", match_in="user"), "a", source="*", priority=5),
            transition("to_b", keyword("bye", match_in="user"), "b", source="*"),
            transition("a_to_a", keyword("again", match_in="user"), "a", source="a"),
        ]
    )
    assert await before(engine, "bye") == "to_b"  # to_a would go nowhere
    assert await before(engine, "again") == "a_to_a"  # an explicit self-loop still fires


async def test_intents_are_classified_again_when_a_transition_brings_new_ones() -> None:
    engine = engine_for(
        [
            transition("a_book", intent("book"), "b"),
            transition("b_cancel", intent("cancel"), "c", source="b"),
        ]
    )
    classifier = Classifier("book", 0.9)
    facts = TurnFacts("book it, then cancel")
    found = await engine.evaluate("before_turn", facts, classifier)
    assert found is not None
    engine.apply(found)
    assert await engine.evaluate("before_turn", facts, classifier) is None
    assert classifier.calls == [
        ("book it, then cancel", ["book"]),
        ("book it, then cancel", ["cancel"]),
    ]


# -- snapshot and restore --------------------------------------------------------------------------


def test_every_engine_attribute_is_declared_undone_or_fixed() -> None:
    """A new engine attribute must say whether an undo puts it back (``UNDONE``, which the
    snapshot's fields declare) or leaves it alone (``FIXED``): none escapes an undo silently."""
    engine = engine_for([transition("to_b", keyword("x"), "b")])
    engine.on_language = lambda code: None
    engine.apply(engine.playbook.spec.transitions[0], data={"k": 1}, summary="notes")
    engine.set_language("de")
    undone, fixed = set(PlaybookEngine.UNDONE), set(PlaybookEngine.FIXED)
    assert not undone & fixed
    assert set(vars(engine)) == undone | fixed
    assert undone == {f.name for f in dataclasses.fields(EngineSnapshot)}


def test_restore_puts_back_every_undone_attribute() -> None:
    clock = FakeClock(10.0)
    engine = engine_for(
        [transition("to_b", LLM_DECISION, "b", action={"transition_message": "hello b"})],
        clock=clock,
    )
    engine.context["order"] = "A1"
    engine.complete_turn()
    stage_a = engine.stage
    before = {name: copy.copy(getattr(engine, name)) for name in PlaybookEngine.UNDONE}
    snapshot = engine.snapshot()
    languages: list[str] = []
    engine.on_language = languages.append

    clock.advance(5)
    engine.complete_turn()
    engine.apply(engine.playbook.spec.transitions[0], data={"status": "late"}, summary="notes")
    engine.set_language("de")
    changed = {n for n in PlaybookEngine.UNDONE if getattr(engine, n) != before[n]}
    assert changed == set(PlaybookEngine.UNDONE)  # the test covers every attribute

    engine.restore(snapshot)

    assert {name: getattr(engine, name) for name in PlaybookEngine.UNDONE} == before
    assert engine.stage is stage_a  # the playbook's own stage, not a copy
    assert languages == ["de"]  # restoring announces nothing: that is the caller's business


def test_a_snapshot_shares_nothing_mutable_with_the_engine() -> None:
    """Changes after the snapshot, or after a restore, do not reach the snapshot; it can be
    restored again."""
    engine = engine_for([transition("to_b", keyword("x"), "b")])
    engine.context["order"] = {"id": "A1", "items": ["book"]}
    snapshot = engine.snapshot()

    engine.context["order"]["items"].append("pen")
    engine.apply(engine.playbook.spec.transitions[0])
    assert snapshot.context == {"order": {"id": "A1", "items": ["book"]}}
    assert snapshot.history == []

    engine.restore(snapshot)
    engine.context["order"]["items"].append("lamp")
    engine.history.append(engine.apply(engine.playbook.spec.transitions[0]))
    engine.restore(snapshot)
    assert engine.context == {"order": {"id": "A1", "items": ["book"]}}
    assert engine.history == []
    assert engine.stage.id == "a"
