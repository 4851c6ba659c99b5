"""Guided tool calling (``tool_calling: guided``): the engine calls the tools a small model
cannot, on details the caller really gave, against the scripted LLM (the real ``openai`` client
path: a JSON-schema extraction, yes-or-no odds, a streamed answer without tools)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from playbooks import ChatClient, OrchestratorEvent, PlaybookOrchestrator, load_playbook
from playbooks.guided import said
from server.testkit.scripted_llm import Reply, ScriptedLLM

TOOLS_PY = '''
from playbooks import tool


@tool
def hours() -> str:
    """The shop's opening hours."""
    return "nine to five, closed on Sundays"


@tool
def special(day: str) -> str:
    """The dish of the day.

    Args:
        day: Day of the week, like friday.
    """
    return "soup"


@tool
def check(day: str) -> dict:
    """Whether a day has a free slot.

    Args:
        day: Day of the week, like friday.
    """
    return {"day": day, "free": True}


@tool
def book(day: str, name: str) -> dict:
    """Book a slot once the caller gives a name.

    Args:
        day: Day of the week, like friday.
        name: The caller's name.
    """
    return {"booked": True, "day": day, "name": name}
'''

PLAYBOOK_YAML = """
id: shop
name: Shop
initial_stage: booking
tools_module: tools.py
global_tools: [hours, special]
default_llm_config: {tool_calling: guided, model: shop-model}
stages:
  - id: booking
    name: Booking
    system_prompt: Find a free day, then book it under the caller's name.
    tools: [check, book]
  - id: done
    name: Done
    system_prompt: Say goodbye.
transitions:
  - id: booked
    from: booking
    condition: {type: tool_call, tool_name: book}
    action: {target_stage: done}
  - id: gives_up
    from: booking
    condition: {type: llm_decision}
    action: {target_stage: done}
    description: The caller wants to stop without booking.
"""


def extraction(**details: Any) -> Reply:
    return Reply(content=json.dumps({"day": None, "name": None, **details}))


def answers_of(events: list[OrchestratorEvent]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (e.data["call"]["name"], json.loads(e.data["call"]["arguments"]))
        for e in events
        if e.type == "tool_call_start"
    ]


@pytest.fixture
async def orchestrator(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> PlaybookOrchestrator:
    playbook = load_playbook(write_playbook(PLAYBOOK_YAML, TOOLS_PY))
    return PlaybookOrchestrator(playbook, ChatClient.connect(llm.base_url, None, "scripted"))


async def test_the_engine_calls_what_the_callers_details_complete_and_never_a_made_up_one(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)

    # 1. "Friday" completes check (and the global special, which is not what the caller asked
    # for: the stage's own tools come first, and after a call only they); the model's
    # made-up name is not the caller's: no booking
    llm.script(
        [
            extraction(day="Friday", name="John Doe"),
            Reply(content="no"),  # (after the check) is the caller giving up?
            Reply(content="Friday is free. What name should I put it under?"),
        ]
    )
    assert await orchestrator.respond("Is Friday free?") == (
        "Friday is free. What name should I put it under?"
    )
    assert answers_of(events) == [("check", {"day": "Friday"})]
    extract, *_questions, answer = llm.requests
    assert extract["response_format"]["type"] == "json_schema"
    assert extract["model"] == answer["model"] == "shop-model", "the stage's model throughout"
    assert "Caller: Is Friday free?" in extract["messages"][-1]["content"]
    assert "tools" not in answer, "a small model answers without tools"
    assert all(m["role"] in ("system", "user", "assistant") for m in answer["messages"])
    assert not any(m.get("tool_calls") for m in answer["messages"])
    prompt = answer["messages"][0]["content"]
    assert 'check({"day": "Friday"}) returned {"day": "Friday", "free": true}' in prompt
    assert "Ask the caller for: name." in prompt

    # 2. a name completes book: the call is made, and its transition follows
    events.clear()
    llm.requests.clear()
    llm.script([extraction(name="Rossi"), Reply(content="You're booked, Rossi.")])
    await orchestrator.respond("Rossi. R O S S I.")
    assert answers_of(events) == [("book", {"day": "Friday", "name": "Rossi"})]
    assert orchestrator.engine.stage.id == "done"


async def test_the_stages_own_question_is_said_when_the_caller_gave_a_detail_and_no_call_ran(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    questions = "{day: 'Which day would you like?', name: 'What name should I put it under?'}"
    asking = PLAYBOOK_YAML.replace(
        "    tools: [check, book]\n", f"    tools: [check, book]\n    questions: {questions}\n"
    )
    playbook = load_playbook(write_playbook(asking, TOOLS_PY))

    def conversation() -> PlaybookOrchestrator:
        return PlaybookOrchestrator(playbook, ChatClient.connect(llm.base_url, None, "scripted"))

    # a name, no day: no call can be made, a detail was learned: the line, not the model
    orchestrator = conversation()
    llm.script([extraction(name="Rossi"), Reply(content="no")])
    assert await orchestrator.respond("My name is Rossi.") == "Which day would you like?"
    assert not any(request.get("stream") for request in llm.requests), "no answer asked for"

    # nothing learned: the model answers; a question that gives a detail: the model too
    llm.script([extraction(), Reply(content="no"), Reply(content="From nine to five.")])
    assert await orchestrator.respond("Ah, when do you open.") == "From nine to five."
    llm.script([extraction(name="Ross"), Reply(content="no"), Reply(content="It is Ross now.")])
    assert await orchestrator.respond("Can you make it Ross?") == "It is Ross now."

    # a call was made: the model tells its result (and asks for the name itself)
    llm.script([extraction(day="Friday"), Reply(content="no"), Reply(content="Friday is free.")])
    assert await conversation().respond("Is Friday free?") == "Friday is free."


async def test_a_move_is_asked_yes_or_no(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)
    llm.script([extraction(), Reply(content="no"), Reply(content="We open at nine.")])
    await orchestrator.respond("When do you open?")
    assert answers_of(events) == []
    (question,) = [r for r in llm.requests if r.get("logprobs")]
    assert question["messages"][-1]["content"].endswith(
        'Question: Is this true: "The caller wants to stop without booking"? Answer yes or no.'
    )
    assert orchestrator.engine.stage.id == "booking"

    # a yes moves the conversation as playbook_transition would
    llm.script([extraction(), Reply(content="yes"), Reply(content="Goodbye!")])
    await orchestrator.respond("Forget it, I'll call another day.")
    assert answers_of(events) == [("playbook_transition", {"target_stage": "done"})]
    assert orchestrator.engine.stage.id == "done"


async def test_an_undone_turn_leaves_nothing_learned(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    """A preemptive answer the caller talked on through is undone by restoring a snapshot:
    the details and calls it learned go with it, so the real turn makes the call."""
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)
    turn = [extraction(day="Friday"), Reply(content="no"), Reply(content="Friday is free.")]
    snapshot = orchestrator.snapshot()
    llm.script(turn)
    await orchestrator.respond("Is Friday free?")
    orchestrator.restore(snapshot)
    events.clear()
    llm.script(turn)
    await orchestrator.respond("Is Friday free?")
    assert answers_of(events) == [("check", {"day": "Friday"})]


async def test_an_endpoint_that_refuses_the_extraction_still_answers(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)
    llm.script([Reply(status=400), Reply(content="no"), Reply(content="Which day would suit?")])
    assert await orchestrator.respond("Is Friday free?") == "Which day would suit?"
    assert answers_of(events) == []
    (error,) = [e for e in events if e.type == "error"]
    assert error.data["source"] == "guided"


@pytest.mark.parametrize(
    ("value", "heard", "borne"),
    [
        ("Rossi", "Rossi. R O S S I.", True),
        ("John Doe", "Rossi. R O S S I.", False),
        (2, "for two people", True),
        (4, "for two people", False),
        ("20:00", "Friday at eight", True),  # a time in the form asked for: a number was said
        ("20:00", "Friday, please", False),
        ("A1002", "Keypad: 1002#", True),
        ("A1001", "Keypad: 1002#", False),  # the description's example, not the caller's
        ("44719", "It's four four seven one nine.", True),
        ("44719", "It's 4 4 7 1 9.", True),
        ("44791", "It's four four seven one nine.", False),
        ("fix a puncture", "How much to fix a puncture?", True),
        # the agent's own words copied as the caller's share a word or two, not half
        ("Yes, I can book your bike in this week for you", "Can I bring my bike in?", False),
    ],
)
def test_a_detail_counts_only_when_the_callers_words_bear_it_out(
    value: Any, heard: str, borne: bool
) -> None:
    assert said(value, heard) is borne
