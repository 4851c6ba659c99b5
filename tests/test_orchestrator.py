"""The two-phase orchestrator against the scripted LLM: silence, streaming, limits, failures,
events, cancellation, transitions and history.

The real ``openai`` client runs against the scripted LLM (``server.testkit``); tools are real
Python functions in a playbook's tools module. Only the retry delays are injected (recorded, not
slept).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from playbooks import (
    ChatClient,
    LoadedPlaybook,
    OrchestratorEvent,
    OrchestratorOptions,
    PlaybookOrchestrator,
    Retraction,
    RetryPolicy,
    Turn,
    load_playbook,
)
from playbooks.orchestrator import DEFAULT_FALLBACK
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES, FakeSleep

SPEC_EVENTS = {
    "phase1_start",
    "tool_call_start",
    "tool_call_complete",
    "phase1_complete",
    "phase2_start",
    "phase2_complete",
    "transition_triggered",
    "stage_entered",
    "stage_exited",
}

TOOLS_PY = '''
import asyncio

from playbooks import tool

_met = asyncio.Event()


@tool
def lookup(key: str) -> dict[str, str]:
    """Look a key up.

    Args:
        key: What to look up.
    """
    return {"key": key, "value": key.upper()}


@tool
async def slow(seconds: float) -> str:
    """Take a while."""
    await asyncio.sleep(seconds)
    return "slow done"


@tool
def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


@tool(timeout_s=0.1)
async def sleepy() -> str:
    """Outlives its own timeout."""
    await asyncio.sleep(5)
    return "never"


@tool
async def ping() -> str:
    """Waits for pong: only succeeds when both run at the same time."""
    await asyncio.wait_for(_met.wait(), 1.0)
    return "pinged"


@tool
async def pong() -> str:
    """Lets ping through."""
    _met.set()
    return "ponged"


@tool(on_interrupt="finish")
async def commit(seconds: float) -> str:
    """Must not stop half-way, even when the caller interrupts."""
    await asyncio.sleep(seconds)
    return "committed"


@tool
def hidden() -> str:
    """Defined, but offered in no stage."""
    return "should never run"
'''

PLAYBOOK_YAML = """
id: test
name: Test playbook
initial_stage: main
tools_module: tools.py
global_system_prompt: GLOBAL PROMPT
stages:
  - id: main
    name: Main
    system_prompt: MAIN PROMPT
    tools: [lookup, slow, boom, sleepy, ping, pong, commit]
  - id: other
    name: Other
    description: The other stage.
    system_prompt: OTHER PROMPT
    tools: [lookup]
  - id: side
    name: Side
    system_prompt: SIDE PROMPT
  - id: plain
    name: Plain
    system_prompt: PLAIN PROMPT
    tools: [lookup]
    two_phase_execution: false
transitions:
  - id: main_to_other
    from: main
    condition: {type: llm_decision}
    action: {target_stage: other}
    description: Go to the other stage.
  - id: sidestep
    from: main
    condition: {type: keyword, keywords: [sidestep], in: user}
    action: {target_stage: side, transition_message: MOVED TO SIDE}
  - id: reset
    from: main
    condition: {type: keyword, keywords: [reset], in: user}
    action: {target_stage: other, clear_history: true, transition_message: FRESH START}
  - id: after_pong
    from: main
    condition: {type: tool_call, tool_name: pong}
    action: {target_stage: side}
  - id: go_plain
    from: main
    condition: {type: keyword, keywords: [plainly], in: user}
    action: {target_stage: plain}
"""


@pytest.fixture
async def client(llm: ScriptedLLM, sleeps: FakeSleep) -> AsyncIterator[ChatClient]:
    chat = ChatClient.connect(llm.base_url, None, "scripted", retry=RetryPolicy(sleep=sleeps))
    yield chat
    await chat.aclose()


@pytest.fixture
def playbook(write_playbook: Callable[..., Path]) -> LoadedPlaybook:
    return load_playbook(write_playbook(PLAYBOOK_YAML, TOOLS_PY))


@pytest.fixture
def make(playbook: LoadedPlaybook, client: ChatClient) -> Callable[..., PlaybookOrchestrator]:
    """``make(**options)``: an orchestrator on the test playbook."""

    def build(**options: Any) -> PlaybookOrchestrator:
        return PlaybookOrchestrator(playbook, client, OrchestratorOptions(**options))

    return build


@pytest.fixture
def orchestrator(make: Callable[..., PlaybookOrchestrator]) -> PlaybookOrchestrator:
    return make()


def record(orchestrator: PlaybookOrchestrator) -> list[OrchestratorEvent]:
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)
    return events


def types(events: list[OrchestratorEvent]) -> list[str]:
    return [event.type for event in events]


async def run_turn(
    orchestrator: PlaybookOrchestrator, text: str
) -> tuple[list[str | Retraction], Turn]:
    """Run a turn to its end; returns everything it yielded, and the turn."""
    async with orchestrator.turn(text) as turn:
        items = [item async for item in turn]
    return items, turn


def call(name: str, call_id: str, **arguments: Any) -> ScriptedToolCall:
    return ScriptedToolCall(name, arguments, id=call_id)


def tool_results(body: dict[str, Any]) -> dict[str, str]:
    """``tool_call_id -> content`` of every tool message of a recorded request."""
    return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}


def error_of(result: str) -> str:
    parsed = json.loads(result)
    assert isinstance(parsed, dict)
    assert "error" in parsed, result
    return str(parsed["error"])


def system_prompt(body: dict[str, Any]) -> str:
    first = body["messages"][0]
    assert first["role"] == "system"
    return str(first["content"])


def tool_names(body: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in body.get("tools", [])]


def assert_valid_messages(messages: list[dict[str, Any]]) -> None:
    """What an OpenAI-compatible server demands: every tool call answered, right after its
    assistant message, and no tool message without its call; no Vocable-local keys."""
    expected: list[str] = []
    for index, message in enumerate(messages):
        assert set(message) <= {"role", "content", "tool_calls", "tool_call_id"}, message
        if message["role"] == "tool":
            assert expected, f"orphan tool message at {index}: {message}"
            assert message["tool_call_id"] == expected.pop(0), messages
            continue
        assert not expected, f"tool calls {expected} without results before {index}"
        if message["role"] == "assistant" and message.get("tool_calls"):
            expected = [c["id"] for c in message["tool_calls"]]
    assert not expected, f"tool calls {expected} without results at the end"


def assert_all_requests_valid(llm: ScriptedLLM) -> None:
    for body in llm.requests:
        assert_valid_messages(body["messages"])


# -- Phase 1 is silent -----------------------------------------------------------------------------


async def test_content_before_tool_calls_is_retracted(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(content="Let me check that.", tool_calls=[call("lookup", "c1", key="a")]),
            Reply(content="The value is A."),
        ]
    )
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "what is a?")

    assert items == [
        "Let",
        " me",
        " check",
        " that.",
        Retraction("Let me check that."),
        "The",
        " value",
        " is",
        " A.",
    ]
    assert turn.answer == "The value is A."
    assert "answer_retracted" in types(events)
    assert orchestrator.conversation.messages == [
        {"role": "user", "content": "what is a?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"key": "a"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"key": "a", "value": "A"}'},
        {"role": "assistant", "content": "The value is A."},
    ]
    assert len(llm.requests) == 2
    assert "check that" not in json.dumps(llm.requests[1]["messages"])


async def test_content_after_tool_calls_is_never_yielded(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a")], content_after_tools="SECRET words"),
            Reply(content="Done."),
        ]
    )
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "go")

    assert items == ["Done."]
    assert turn.answer == "Done."
    assert "answer_retracted" not in types(events)
    assert "SECRET" not in json.dumps(orchestrator.conversation.messages)
    assert "SECRET" not in json.dumps(llm.requests[1]["messages"])


async def test_retraction_events_announce_the_restart_of_phase_1(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    """Text that turns out to belong to Phase 1 was announced as Phase 2 speculatively; the
    retraction event says so, and the real Phase 2 is announced again."""
    llm.script(
        [
            Reply(content="Checking.", tool_calls=[call("lookup", "c1", key="a")]),
            Reply(content="A."),
        ]
    )
    events = record(orchestrator)

    await run_turn(orchestrator, "go")

    assert types(events) == [
        "phase1_start",
        "phase1_complete",
        "phase2_start",
        "answer_retracted",
        "tool_call_start",
        "tool_call_complete",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
    ]
    assert events[3].data == {"text": "Checking."}


# -- Phase 2 streams -------------------------------------------------------------------------------


@pytest.mark.parametrize("after_tools", [False, True])
async def test_first_sentence_is_yielded_while_the_stream_is_still_pending(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, after_tools: bool
) -> None:
    answer = Reply(
        content="First sentence. " + "more " * 12, first_token_delay_s=0.05, chunk_delay_s=0.04
    )
    llm.script(
        [Reply(tool_calls=[call("lookup", "c1", key="a")]), answer] if after_tools else [answer]
    )
    done_before = 1 if after_tools else 0

    first_sentence_at: float | None = None
    completed_then: int | None = None
    async with orchestrator.turn("hi") as turn:
        text = ""
        async for item in turn:
            assert isinstance(item, str)
            text += item
            if first_sentence_at is None and text.endswith("First sentence."):
                first_sentence_at = time.monotonic()
                completed_then = llm.streams_completed
    ended_at = time.monotonic()

    assert first_sentence_at is not None
    assert completed_then == done_before  # the answer's stream had not finished
    # 13 more chunks follow "sentence.", each 40 ms apart on the server
    assert ended_at - first_sentence_at >= 0.4
    assert turn.answer == "First sentence. " + " ".join(["more"] * 12)
    # measured from the answer round's request: "First" comes 50 ms after it
    assert turn.llm_first_token_s is not None
    assert turn.llm_first_token_s >= 0.05
    assert llm.streams_completed == done_before + 1


async def test_last_round_without_tool_calls_is_the_answer(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a")]),
            Reply(tool_calls=[call("lookup", "c2", key="b")]),
            Reply(content="A and B."),
        ]
    )
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "a and b?")

    assert items == ["A", " and", " B."]
    assert len(llm.requests) == 3  # no extra answer call
    assert all("tools" in body for body in llm.requests)
    complete = [e for e in events if e.type == "phase1_complete"]
    assert [e.data for e in complete] == [{"tool_call_count": 2}]
    assert turn.tool_call_count == 2


async def test_direct_answer_takes_one_request(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="Hello there.")])

    assert await orchestrator.respond("hi") == "Hello there."

    assert len(llm.requests) == 1
    body = llm.requests[0]
    assert body["stream"] is True
    assert system_prompt(body).startswith("GLOBAL PROMPT\n\nMAIN PROMPT")
    assert tool_names(body) == [
        "lookup",
        "slow",
        "boom",
        "sleepy",
        "ping",
        "pong",
        "commit",
        "playbook_transition",
    ]
    assert body["tool_choice"] == "auto"
    assert body["messages"][1:] == [{"role": "user", "content": "hi"}]


# -- transitions in Phase 1 ------------------------------------------------------------------------


async def test_llm_transition_answers_with_one_tool_less_call_in_the_new_stage(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(
                tool_calls=[
                    call("lookup", "c1", key="a"),
                    call(
                        "playbook_transition",
                        "c2",
                        target_stage="other",
                        reason="done here",
                        data={"order": "A1"},
                    ),
                    call("lookup", "c3", key="b"),
                ]
            ),
            Reply(content="Welcome to the other stage."),
        ]
    )
    events = record(orchestrator)

    answer = await orchestrator.respond("move on")

    assert answer == "Welcome to the other stage."
    assert orchestrator.engine.stage.id == "other"
    assert orchestrator.engine.context == {"order": "A1"}
    assert len(llm.requests) == 2
    second = llm.requests[1]
    assert "tools" not in second
    assert "tool_choice" not in second
    assert "OTHER PROMPT" in system_prompt(second)
    assert "MAIN PROMPT" not in system_prompt(second)
    results = tool_results(second)
    assert list(results) == ["c1", "c2", "c3"]  # every call of the round answered, in order
    assert json.loads(results["c2"]) == {"ok": True, "stage": "other"}
    assert json.loads(results["c1"]) == {"key": "a", "value": "A"}
    assert json.loads(results["c3"]) == {"key": "b", "value": "B"}
    assert_all_requests_valid(llm)
    # tools of a round run concurrently: starts and completions may interleave
    tool_events = [(e.type, e.data["call"]["id"]) for e in events[1:7]]
    for call_id in ("c1", "c2", "c3"):
        start = tool_events.index(("tool_call_start", call_id))
        assert tool_events.index(("tool_call_complete", call_id)) > start
    assert types(events)[:1] + types(events)[7:] == [
        "phase1_start",
        "transition_triggered",
        "stage_exited",
        "stage_entered",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
    ]
    triggered = next(e for e in events if e.type == "transition_triggered")
    assert triggered.data["transition"] == {
        "id": "main_to_other",
        "from": "main",
        "to": "other",
        "condition": "llm_decision",
        "reason": "done here",
    }


@pytest.mark.parametrize("target", ["nowhere", "side", "main", ""])
async def test_invalid_transition_target_gives_an_error_result_and_no_transition(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, target: str
) -> None:
    llm.script(
        [
            Reply(tool_calls=[call("playbook_transition", "t1", target_stage=target, reason="x")]),
            Reply(content="Staying here."),
        ]
    )
    events = record(orchestrator)

    assert await orchestrator.respond("go") == "Staying here."

    assert orchestrator.engine.stage.id == "main"
    assert "other" in error_of(tool_results(llm.requests[1])["t1"])
    assert "transition_triggered" not in types(events)
    assert "tools" in llm.requests[1]  # still Phase 1: the loop went on with tools
    assert len(llm.requests) == 2


async def test_only_one_transition_per_turn(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(
                tool_calls=[
                    call("playbook_transition", "t1", target_stage="other", reason="first"),
                    call("playbook_transition", "t2", target_stage="other", reason="again"),
                ]
            ),
            Reply(content="Moved."),
        ]
    )
    events = record(orchestrator)

    await orchestrator.respond("go")

    results = tool_results(llm.requests[1])
    assert json.loads(results["t1"])["ok"] is True
    assert "one" in error_of(results["t2"])
    assert types(events).count("transition_triggered") == 1
    assert orchestrator.engine.history[-1].reason == "first"


# -- limits and timeouts ---------------------------------------------------------------------------


async def test_tool_call_limit_counts_calls_not_rounds(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(max_tool_calls_per_turn=3)
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a"), call("lookup", "c2", key="b")]),
            Reply(tool_calls=[call("lookup", "c3", key="c"), call("lookup", "c4", key="d")]),
            Reply(content="Enough."),
        ]
    )
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "look everything up")

    assert items == ["Enough."]
    assert len(llm.requests) == 3
    final = llm.requests[2]
    assert "tools" not in final  # the limit forces a tool-less answer call
    results = tool_results(final)
    assert json.loads(results["c3"]) == {"key": "c", "value": "C"}  # the third call runs
    assert "limit" in error_of(results["c4"])  # the fourth does not
    assert turn.tool_call_count == 3
    failed = {
        e.data["call"]["id"]: e.data["error"] for e in events if e.type == "tool_call_complete"
    }
    assert failed == {"c1": False, "c2": False, "c3": False, "c4": True}
    assert [e.data for e in events if e.type == "phase1_complete"] == [{"tool_call_count": 3}]
    assert_all_requests_valid(llm)


async def test_reaching_the_limit_exactly_forces_the_answer_call(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(max_tool_calls_per_turn=2)
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a"), call("lookup", "c2", key="b")]),
            Reply(content="Both found."),
        ]
    )

    assert await orchestrator.respond("go") == "Both found."

    assert len(llm.requests) == 2
    assert "tools" not in llm.requests[1]
    assert list(tool_results(llm.requests[1])) == ["c1", "c2"]


async def test_phase1_timeout_preempts_a_hanging_llm_call(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(phase1_timeout_ms=300)
    llm.script([Reply(hang=True), Reply(content="Sorry for the wait.")])
    events = record(orchestrator)

    started = time.monotonic()
    assert await orchestrator.respond("hello?") == "Sorry for the wait."
    elapsed = time.monotonic() - started

    assert 0.25 <= elapsed < 2.0
    assert len(llm.requests) == 2
    assert "tools" in llm.requests[0]
    assert "tools" not in llm.requests[1]
    assert llm.requests[1]["messages"][1:] == [{"role": "user", "content": "hello?"}]
    assert types(events) == ["phase1_start", "phase1_complete", "phase2_start", "phase2_complete"]


async def test_phase1_timeout_preempts_a_slow_tool(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(phase1_timeout_ms=300)
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a"), call("slow", "c2", seconds=30)]),
            Reply(content="That took too long."),
        ]
    )
    events = record(orchestrator)

    started = time.monotonic()
    assert await orchestrator.respond("slowly") == "That took too long."
    elapsed = time.monotonic() - started

    assert 0.25 <= elapsed < 2.0
    assert len(llm.requests) == 2
    final = llm.requests[1]
    assert "tools" not in final
    results = tool_results(final)
    assert json.loads(results["c1"]) == {"key": "a", "value": "A"}
    assert "limit" in error_of(results["c2"])
    slow_done = [
        e for e in events if e.type == "tool_call_complete" and e.data["call"]["id"] == "c2"
    ]
    assert len(slow_done) == 1
    assert slow_done[0].data["error"] is True
    assert_all_requests_valid(llm)


async def test_phase1_timeout_preempts_a_later_round_after_tools_ran(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(phase1_timeout_ms=400)
    llm.script(
        [
            Reply(tool_calls=[call("slow", "c1", seconds=0.1)]),
            Reply(content="Too late.", first_token_delay_s=30),
            Reply(content="Answer."),
        ]
    )

    started = time.monotonic()
    assert await orchestrator.respond("go") == "Answer."

    assert time.monotonic() - started < 2.0
    assert len(llm.requests) == 3
    assert "tools" in llm.requests[1]
    final = llm.requests[2]
    assert "tools" not in final
    assert tool_results(final) == {"c1": "slow done"}  # the finished tool's result is kept
    assert "Too late" not in json.dumps(orchestrator.conversation.messages)


# -- tool failures ---------------------------------------------------------------------------------


async def test_a_raising_tool_gives_an_error_result_and_the_turn_goes_on(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(tool_calls=[call("boom", "c1"), call("lookup", "c2", key="a")]),
            Reply(content="Something broke, but A is A."),
        ]
    )
    events = record(orchestrator)

    assert await orchestrator.respond("go") == "Something broke, but A is A."

    results = tool_results(llm.requests[1])
    assert "kaboom" in error_of(results["c1"])
    assert json.loads(results["c2"]) == {"key": "a", "value": "A"}
    assert "tools" in llm.requests[1]  # Phase 1 continued normally
    failed = [e.data["error"] for e in events if e.type == "tool_call_complete"]
    assert sorted(failed) == [False, True]


async def test_a_tool_timeout_gives_an_error_result(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(tool_calls=[call("sleepy", "c1")]), Reply(content="It timed out.")])

    started = time.monotonic()
    assert await orchestrator.respond("go") == "It timed out."

    assert time.monotonic() - started < 2.0
    assert "timed out" in error_of(tool_results(llm.requests[1])["c1"])


@pytest.mark.parametrize("name", ["launch_rockets", "hidden"])
async def test_an_unknown_or_unoffered_tool_gives_an_error_result(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, name: str
) -> None:
    llm.script([Reply(tool_calls=[call(name, "c1")]), Reply(content="No such tool.")])

    assert await orchestrator.respond("go") == "No such tool."

    assert "unknown tool" in error_of(tool_results(llm.requests[1])["c1"])


@pytest.mark.parametrize("arguments", ['{"nope": 1}', "not json", "[1, 2]"])
async def test_invalid_tool_arguments_give_an_error_result(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, arguments: str
) -> None:
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("lookup", arguments, id="c1")]),
            Reply(content="Bad arguments."),
        ]
    )

    assert await orchestrator.respond("go") == "Bad arguments."

    assert "lookup" in error_of(tool_results(llm.requests[1])["c1"])


async def test_each_failed_tool_call_is_an_error_event_naming_its_source(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(
                tool_calls=[
                    call("boom", "c1"),
                    call("sleepy", "c2"),
                    call("launch_rockets", "c3"),
                    ScriptedToolCall("lookup", '{"key": ', id="c4"),
                    call("lookup", "c5", key="a"),
                ]
            ),
            Reply(content="Some of that failed."),
        ]
    )
    events = record(orchestrator)

    assert await orchestrator.respond("go") == "Some of that failed."

    errors = {e.data["tool"]: e.data for e in events if e.type == "error"}
    assert {name: e["source"] for name, e in errors.items()} == {
        "boom": "tool",  # the tool failed
        "sleepy": "tool",
        "launch_rockets": "tool_call",  # the LLM got the call wrong
        "lookup": "tool_call",
    }
    assert "kaboom" in errors["boom"]["message"]
    assert "timed out" in errors["sleepy"]["message"]
    assert "unknown tool" in errors["launch_rockets"]["message"]
    assert "not valid JSON" in errors["lookup"]["message"]


async def test_a_silent_llm_is_given_up_on_after_llm_timeout(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    # Phase 1's deadline passes first and hands over to the answer call, which hangs too
    orchestrator = make(phase1_timeout_ms=200, llm_timeout_ms=400)
    llm.script([Reply(hang=True), Reply(hang=True), Reply(content="Back.")])
    events = record(orchestrator)

    started = time.monotonic()
    assert await orchestrator.respond("hello?") == DEFAULT_FALLBACK

    assert 0.55 <= time.monotonic() - started < 2.0
    (error,) = [e.data for e in events if e.type == "error"]
    assert error == {"source": "llm", "message": "the LLM sent nothing for 0.4 s"}
    assert await orchestrator.respond("still there?") == "Back."


async def test_the_fallback_line_is_the_spoken_languages_then_the_playbooks(
    write_playbook: Callable[..., Path],
) -> None:
    spec = """
        id: desk
        name: Desk
        initial_stage: main
        fallback: Sorry, one moment.
        languages:
          fr: {name: French, fallback: "Désolé, un instant."}
          de: {name: German}
        stages:
          - {id: main, name: Main, system_prompt: Help.}
    """
    orchestrator = PlaybookOrchestrator(load_playbook(write_playbook(spec)), None)
    assert await orchestrator.respond("hello?") == "Sorry, one moment."
    orchestrator.engine.set_language("fr")
    assert await orchestrator.respond("allô ?") == "Désolé, un instant."
    orchestrator.engine.set_language("de")  # no line of its own: the playbook's
    assert await orchestrator.respond("hallo?") == "Sorry, one moment."
    server_line = OrchestratorOptions(fallback_answer="No LLM here.")  # the server's wins
    overruled = PlaybookOrchestrator(load_playbook(write_playbook(spec)), None, server_line)
    assert await overruled.respond("hello?") == "No LLM here."


async def test_a_stream_stalling_mid_sentence_ends_with_the_fallback(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator]
) -> None:
    orchestrator = make(llm_timeout_ms=300)
    llm.script([Reply(content="Your parcel is on its way. It left", stall_after_chunks=9)])

    items, turn = await run_turn(orchestrator, "where is it?")

    said = "".join(item for item in items if isinstance(item, str))
    assert said == f"Your parcel is on its way. It left… {DEFAULT_FALLBACK}"
    assert turn.answer == said
    assert orchestrator.conversation.messages[-1]["content"] == said


async def test_tools_of_one_round_run_concurrently(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    # ping waits (up to 1 s) for pong: run one after the other, ping would fail
    llm.script(
        [Reply(tool_calls=[call("ping", "c1"), call("pong", "c2")]), Reply(content="Both ran.")]
    )

    assert await orchestrator.respond("go") == "Both ran."

    assert tool_results(llm.requests[1]) == {"c1": "pinged", "c2": "ponged"}


# -- two_phase_execution: false --------------------------------------------------------------------


async def test_single_phase_stage_streams_text_before_tool_calls(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(content="Let me check.", tool_calls=[call("lookup", "c1", key="a")]),
            Reply(content="It is A."),
        ]
    )
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "say it plainly")

    assert orchestrator.engine.stage.id == "plain"
    assert not any(isinstance(item, Retraction) for item in items)
    assert "".join(str(item) for item in items) == "Let me check. It is A."
    assert items[:3] == ["Let", " me", " check."]
    assert turn.answer == "Let me check. It is A."
    assert "answer_retracted" not in types(events)
    assert types(events).count("phase2_start") == 1
    assert len(llm.requests) == 2
    assert_all_requests_valid(llm)


# -- LLM failures and fallbacks --------------------------------------------------------------------


async def test_llm_failure_after_retries_gives_the_fallback_and_the_conversation_continues(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=500)] * 4 + [Reply(content="Back again.")])
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "hello")

    assert items == [DEFAULT_FALLBACK]
    assert turn.answer == DEFAULT_FALLBACK
    assert sleeps.delays == [1.0, 2.0, 4.0]
    errors = [e for e in events if e.type == "error"]
    assert len(errors) == 1
    assert errors[0].data["source"] == "llm"
    assert "500" in errors[0].data["message"]
    assert types(events) == [
        "phase1_start",
        "error",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
    ]

    assert await orchestrator.respond("still there?") == "Back again."

    assert orchestrator.conversation.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": DEFAULT_FALLBACK},
        {"role": "user", "content": "still there?"},
        {"role": "assistant", "content": "Back again."},
    ]
    assert_all_requests_valid(llm)


async def test_failure_of_the_answer_call_gives_the_configured_fallback(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator], sleeps: FakeSleep
) -> None:
    orchestrator = make(fallback_answer="One moment please.", max_tool_calls_per_turn=1)
    llm.script([Reply(tool_calls=[call("lookup", "c1", key="a")])] + [Reply(status=503)] * 4)
    events = record(orchestrator)

    items, _ = await run_turn(orchestrator, "go")

    assert items == ["One moment please."]
    assert len(llm.requests) == 5
    assert "error" in types(events)
    assert types(events)[-1] == "phase2_complete"
    assert events[-1].data == {"response": "One moment please."}
    assert orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": "One moment please.",
    }
    assert_valid_messages(orchestrator.conversation.for_request("system"))


async def test_a_client_error_is_not_retried_and_gets_the_fallback(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=401), Reply(content="never asked")])

    assert await orchestrator.respond("hi") == DEFAULT_FALLBACK

    assert len(llm.requests) == 1
    assert sleeps.delays == []


async def test_a_stream_cut_is_an_error_and_the_next_turn_works(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(tool_calls=[call("lookup", "c1", key="a")]),
            Reply(content="this answer breaks off here", cut_after_chunks=3),
            Reply(content="Fine now."),
        ]
    )
    events = record(orchestrator)

    await orchestrator.respond("go")

    assert "error" in types(events)
    assert types(events)[-1] == "phase2_complete"
    assert await orchestrator.respond("again") == "Fine now."
    assert_all_requests_valid(llm)


async def test_empty_phase_2_gets_the_fallback(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(tool_calls=[call("lookup", "c1", key="a")]), Reply(), Reply()])
    events = record(orchestrator)

    items, turn = await run_turn(orchestrator, "go")

    assert items == [DEFAULT_FALLBACK]
    assert turn.answer == DEFAULT_FALLBACK
    assert len(llm.requests) == 3
    assert "tools" in llm.requests[1]
    assert "tools" not in llm.requests[2]  # an empty round asks once more, without tools
    assert "error" not in types(events)
    assert events[-1].data == {"response": DEFAULT_FALLBACK}
    assert orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": DEFAULT_FALLBACK,
    }


async def test_whitespace_only_answer_gets_the_fallback(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content=["  ", "\n"]), Reply(content=[" "])])

    items, turn = await run_turn(orchestrator, "go")

    assert items[-1] == DEFAULT_FALLBACK
    assert turn.answer == DEFAULT_FALLBACK


# -- events ----------------------------------------------------------------------------------------


async def test_events_have_the_spec_names_in_order_and_on_returns_unsubscribe(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [Reply(tool_calls=[call("pong", "c1")]), Reply(content="Done."), Reply(content="Hi.")]
    )
    first: list[OrchestratorEvent] = []
    second: list[OrchestratorEvent] = []
    unsubscribe = orchestrator.on(first.append)
    orchestrator.on(second.append)

    def broken(event: OrchestratorEvent) -> None:
        raise RuntimeError("a broken subscriber must not break the turn")

    orchestrator.on(broken)

    assert await orchestrator.respond("pong please") == "Done."

    assert types(first) == [
        "phase1_start",
        "tool_call_start",
        "tool_call_complete",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
        "transition_triggered",
        "stage_exited",
        "stage_entered",
    ]
    assert set(types(first)) == SPEC_EVENTS
    by_type = {e.type: e.data for e in first}
    assert by_type["phase1_start"] == {}
    assert by_type["tool_call_start"] == {"call": {"id": "c1", "name": "pong", "arguments": "{}"}}
    assert by_type["tool_call_complete"]["result"] == "ponged"
    assert by_type["tool_call_complete"]["error"] is False
    assert by_type["phase1_complete"] == {"tool_call_count": 1}
    assert by_type["phase2_complete"] == {"response": "Done."}
    assert by_type["transition_triggered"]["transition"]["id"] == "after_pong"
    assert by_type["stage_exited"] == {"stage": {"id": "main", "name": "Main"}}
    assert by_type["stage_entered"] == {"stage": {"id": "side", "name": "Side"}}
    assert all(json.loads(json.dumps(e.to_dict()))["type"] == e.type for e in first)

    unsubscribe()
    unsubscribe()  # idempotent
    count = len(first)
    assert await orchestrator.respond("hello") == "Hi."

    assert len(first) == count
    assert types(second)[count:] == [
        "phase1_start",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
    ]


async def test_pre_turn_transition_events_come_before_phase_1(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="Side here.")])
    events = record(orchestrator)

    await orchestrator.respond("sidestep")

    assert types(events) == [
        "transition_triggered",
        "stage_exited",
        "stage_entered",
        "phase1_start",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
    ]


# -- cancellation (barge-in) -----------------------------------------------------------------------


async def test_cancel_during_a_slow_tool_leaves_a_cancelled_result(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(tool_calls=[call("lookup", "c1", key="a"), call("slow", "c2", seconds=30)])])
    lookup_done = asyncio.Event()
    orchestrator.on(
        lambda e: (
            lookup_done.set()
            if e.type == "tool_call_complete" and e.data["call"]["id"] == "c1"
            else None
        )
    )
    turns: list[Turn] = []

    async def consume() -> None:
        async with orchestrator.turn("do both") as turn:
            turns.append(turn)
            async for _ in turn:
                pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(lookup_done.wait(), 3)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    [turn] = turns
    assert turn.interrupted
    messages = orchestrator.conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": '{"key": "a", "value": "A"}',
    }
    assert messages[3]["tool_call_id"] == "c2"
    assert "cancelled" in error_of(messages[3]["content"])

    # the conversation goes on, with a valid history
    llm.script([Reply(content="Where were we?")])
    assert await orchestrator.respond("never mind") == "Where were we?"
    assert_valid_messages(llm.last_request["messages"])
    assert llm.last_request["messages"][-1] == {"role": "user", "content": "never mind"}


async def _started_tool_call(
    orchestrator: PlaybookOrchestrator, text: str, confirmed: asyncio.Event | None = None
) -> asyncio.Task[None]:
    """A task answering ``text`` in a turn, returned once its first tool call has started."""
    started = asyncio.Event()
    orchestrator.on(lambda e: started.set() if e.type == "tool_call_start" else None)

    async def consume() -> None:
        async with orchestrator.turn(text, confirmed) as turn:
            async for _ in turn:
                pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 3)
    await asyncio.sleep(0.05)
    return task


async def test_a_finishing_tool_completes_despite_cancellation(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [Reply(tool_calls=[call("commit", "c1", seconds=0.4), call("slow", "c2", seconds=30)])]
    )
    task = await _started_tool_call(orchestrator, "commit it")
    loop = asyncio.get_running_loop()
    cancelled_at = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the turn's exit waited for the finishing tool (~0.35 s more), not for the slow one
    assert 0.25 <= loop.time() - cancelled_at < 5

    messages = orchestrator.conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "committed"}
    assert messages[3]["tool_call_id"] == "c2"
    assert "cancelled" in error_of(messages[3]["content"])


async def test_an_unconfirmed_turn_cancelled_never_runs_its_finishing_tool(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    """A preemptive turn undone while its ``on_interrupt: finish`` tool (side effects) waits for
    the confirmation: the tool never started, so it does not run, and the turn ends at once
    instead of waiting for a confirmation that cannot come."""
    llm.script([Reply(tool_calls=[call("commit", "c1", seconds=0.01)])])
    confirmed = asyncio.Event()  # never set: the caller went on
    task = await _started_tool_call(orchestrator, "commit it", confirmed)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 2)
    messages = orchestrator.conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[2]["tool_call_id"] == "c1"
    assert "cancelled" in error_of(messages[2]["content"])


@pytest.mark.parametrize("after_tools", [False, True])
async def test_cancel_during_phase_2_keeps_only_what_was_delivered(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, after_tools: bool
) -> None:
    answer = Reply(
        content="First sentence. Second sentence goes on for quite a while yet.",
        chunk_delay_s=0.05,
    )
    llm.script(
        [Reply(tool_calls=[call("lookup", "c1", key="a")]), answer] if after_tools else [answer]
    )
    delivered = asyncio.Event()
    turns: list[Turn] = []

    async def speak() -> None:
        async with orchestrator.turn("tell me") as turn:
            turns.append(turn)
            heard = ""
            async for item in turn:
                assert isinstance(item, str)
                heard += item
                if heard == "First sentence.":
                    turn.mark_delivered("First sentence.")
                    delivered.set()

    task = asyncio.create_task(speak())
    await asyncio.wait_for(delivered.wait(), 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    [turn] = turns
    assert turn.interrupted
    assert turn.delivered == "First sentence."
    messages = orchestrator.conversation.messages
    assert messages[-1] == {"role": "assistant", "content": "First sentence.", "interrupted": True}
    assert [m["role"] for m in messages] == (
        ["user", "assistant", "tool", "assistant"] if after_tools else ["user", "assistant"]
    )
    assert orchestrator.conversation.for_request("system")[-1] == {
        "role": "assistant",
        "content": "First sentence.",
    }
    await asyncio.wait_for(llm.stream_abandoned.wait(), 3)
    assert llm.streams_abandoned == 1
    assert llm.streams_completed == (1 if after_tools else 0)

    # the next turn works and sends a valid history with the delivered text only
    llm.script([Reply(content="Sure, go ahead.")])
    assert await orchestrator.respond("wait") == "Sure, go ahead."
    sent = llm.last_request["messages"]
    assert_valid_messages(sent)
    assert sent[-2:] == [
        {"role": "assistant", "content": "First sentence."},
        {"role": "user", "content": "wait"},
    ]
    assert "Second sentence" not in json.dumps(sent)


async def test_cancel_before_anything_was_delivered_records_no_answer(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="You will never hear this.", first_token_delay_s=5)])
    requested = asyncio.Event()
    orchestrator.on(lambda e: requested.set() if e.type == "phase1_start" else None)

    async def consume() -> None:
        await orchestrator.respond("hello")

    task = asyncio.create_task(consume())
    await asyncio.wait_for(requested.wait(), 3)
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert orchestrator.conversation.messages == [{"role": "user", "content": "hello"}]
    llm.script([Reply(content="Hello!")])
    assert await orchestrator.respond("hello?") == "Hello!"
    assert_all_requests_valid(llm)


SLOW_CHECK_YAML = """
id: slow_check
name: Slow end-of-turn check
initial_stage: main
tools_module: tools.py
stages:
  - {id: main, name: Main, system_prompt: MAIN PROMPT}
  - {id: next, name: Next, system_prompt: NEXT PROMPT}
transitions:
  - id: checked
    from: main
    condition: {type: custom, function: slow_check}
    action: {target_stage: next}
"""

SLOW_CHECK_PY = """
import asyncio


async def slow_check(context):
    if context.last_user_message == "slow":
        await asyncio.sleep(30)
    return False
"""


@pytest.mark.parametrize("delivered", ["all", "part", "none"])
async def test_cancel_after_the_answer_keeps_what_was_delivered(
    llm: ScriptedLLM,
    client: ChatClient,
    write_playbook: Callable[..., Path],
    delivered: str,
) -> None:
    """Cancelled while end-of-turn transitions are evaluated: the answer is complete."""
    playbook = load_playbook(write_playbook(SLOW_CHECK_YAML, SLOW_CHECK_PY))
    orchestrator = PlaybookOrchestrator(playbook, client)
    llm.script([Reply(content="Same answer."), Reply(content="Same answer.")])
    assert await orchestrator.respond("fast") == "Same answer."
    answered = asyncio.Event()
    orchestrator.on(lambda e: answered.set() if e.type == "phase2_complete" else None)

    async def consume() -> None:
        async with orchestrator.turn("slow") as turn:
            async for item in turn:
                assert isinstance(item, str)
                if delivered == "all" or (delivered == "part" and item == "Same"):
                    turn.mark_delivered(item)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(answered.wait(), 3)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    expected: list[dict[str, Any]] = [
        {"role": "user", "content": "fast"},
        {"role": "assistant", "content": "Same answer."},
        {"role": "user", "content": "slow"},
    ]
    if delivered == "all":
        expected.append({"role": "assistant", "content": "Same answer."})
    elif delivered == "part":
        expected.append({"role": "assistant", "content": "Same", "interrupted": True})
    assert orchestrator.conversation.messages == expected
    assert orchestrator.engine.stage.id == "main"


async def test_breaking_out_early_is_an_interruption(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="One. Two. Three.", chunk_delay_s=0.02)])

    async with orchestrator.turn("count") as turn:
        async for item in turn:
            assert isinstance(item, str)
            turn.mark_delivered(item)
            if item == "One.":
                break

    assert turn.interrupted
    assert orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": "One.",
        "interrupted": True,
    }


async def test_one_turn_at_a_time(llm: ScriptedLLM, orchestrator: PlaybookOrchestrator) -> None:
    llm.script([Reply(content="First."), Reply(content="Second.")])

    async with orchestrator.turn("one") as turn:
        with pytest.raises(RuntimeError):
            orchestrator.turn("two")
        async for _ in turn:
            pass

    assert await orchestrator.respond("two") == "Second."


# -- transitions before the turn -------------------------------------------------------------------


async def test_keyword_in_user_text_makes_the_new_stage_answer_the_same_turn(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "support.yaml"), client)
    llm.script([Reply(content="Sure, what is the order number?")])

    answer = await orchestrator.respond("Where is my order?")

    assert answer == "Sure, what is the order number?"
    assert orchestrator.engine.stage.id == "identify"
    assert len(llm.requests) == 1
    body = llm.requests[0]
    assert "Ask for the order number" in system_prompt(body)
    assert "Welcome the caller" not in system_prompt(body)
    assert tool_names(body) == ["lookup_order", "playbook_transition"]
    assert body["messages"][1:] == [{"role": "user", "content": "Where is my order?"}]


@pytest.mark.parametrize(("confidence", "stage"), [(0.93, "booking"), (0.4, "welcome")])
async def test_intent_is_classified_before_the_turn(
    llm: ScriptedLLM, client: ChatClient, confidence: float, stage: str
) -> None:
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "restaurant.yaml"), client)
    llm.script(
        [
            Reply(content=json.dumps({"intent": "book_table", "confidence": confidence})),
            Reply(content="Gladly. For which day?"),
        ]
    )

    assert await orchestrator.respond("I'd like a table for two") == "Gladly. For which day?"

    assert orchestrator.engine.stage.id == stage
    assert len(llm.requests) == 2  # one classification per turn, then the answer
    classification, answer = llm.requests
    assert not classification.get("stream")
    assert "tools" not in classification
    assert classification["max_tokens"] == 64  # a model that runs on cannot hold the turn
    assert "book_table" in system_prompt(classification)
    assert classification["messages"][-1] == {
        "role": "user",
        "content": "I'd like a table for two",
    }
    assert answer["stream"] is True
    if stage == "booking":
        assert "Collect the date" in system_prompt(answer)
        assert "check_availability" in tool_names(answer)
    else:
        assert "Greet the caller" in system_prompt(answer)


async def test_intent_classification_failure_keeps_the_stage(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "restaurant.yaml"), client)
    llm.script([Reply(status=400), Reply(content="Good evening!")])
    events = record(orchestrator)

    assert await orchestrator.respond("hello") == "Good evening!"

    assert orchestrator.engine.stage.id == "welcome"
    assert [e.data["source"] for e in events if e.type == "error"] == ["intent"]


async def test_a_user_keyword_moves_the_conversation_once(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    orchestrator = PlaybookOrchestrator(load_playbook(EXAMPLES / "support.yaml"), client)
    llm.script([Reply(content="Goodbye, and thanks for calling.")])
    events = record(orchestrator)

    await orchestrator.respond("that's all, goodbye")

    assert orchestrator.engine.stage.id == "farewell"
    assert [(r.from_stage, r.to_stage) for r in orchestrator.engine.history] == [
        ("greeting", "farewell")
    ]
    assert types(events).count("transition_triggered") == 1


async def test_clear_history_keeps_the_current_user_message(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="Hi."), Reply(content="Fresh start here.")])
    await orchestrator.respond("hello")

    assert await orchestrator.respond("please reset") == "Fresh start here."

    assert orchestrator.engine.stage.id == "other"
    body = llm.requests[1]
    assert "OTHER PROMPT" in system_prompt(body)
    assert "Note on entering this stage: FRESH START" in system_prompt(body)
    assert body["messages"][1:] == [{"role": "user", "content": "please reset"}]
    assert orchestrator.conversation.messages == [
        {"role": "user", "content": "please reset"},
        {"role": "assistant", "content": "Fresh start here."},
    ]


async def test_transition_message_is_injected_into_the_system_prompt(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script([Reply(content="Hi."), Reply(content="Side stage.")])
    await orchestrator.respond("hello")

    await orchestrator.respond("sidestep now")

    assert llm.requests[1]["messages"][1:] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "sidestep now"},
    ]
    prompt = system_prompt(llm.requests[1])
    assert "SIDE PROMPT" in prompt
    assert prompt.endswith("Note on entering this stage: MOVED TO SIDE")


# -- history limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [3, 4, 5, 7])
async def test_history_trimming_never_sends_an_orphan_tool_message(
    llm: ScriptedLLM, make: Callable[..., PlaybookOrchestrator], limit: int
) -> None:
    orchestrator = make(history_limit=limit)
    turn_number = 0

    def reply(body: dict[str, Any]) -> Reply:
        nonlocal turn_number
        if body["messages"][-1]["role"] == "user":
            turn_number += 1
            n_calls = turn_number % 4  # 1, 2, 3, 0, 1, ... calls in the first round
            if n_calls:
                return Reply(
                    tool_calls=[
                        call("lookup", f"t{turn_number}_{i}", key=f"k{i}") for i in range(n_calls)
                    ]
                )
        return Reply(content=f"Answer {turn_number}.")

    llm.script(reply)

    for n in range(1, 11):
        assert await orchestrator.respond(f"question {n}") == f"Answer {n}."
        assert len(orchestrator.conversation) <= limit
        assert_valid_messages(orchestrator.conversation.for_request("system"))

    assert len(llm.requests) == 10 + 8  # ten turns, eight of them with a tool round
    assert_all_requests_valid(llm)
    # the turn in progress is never trimmed away: each request still holds its question
    for body in llm.requests:
        assert any(m["role"] == "user" for m in body["messages"])


# -- undo and the turn's contract ------------------------------------------------------------------


async def test_restore_undoes_a_turn_that_moved_stage_and_context(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    """The conversation and every piece of engine state the turn changed go back; the snapshot
    stays as taken, so it can be restored twice."""
    move = call("playbook_transition", "c1", target_stage="other", reason="r", data={"k": "v"})
    llm.script(
        [
            Reply(content="Hi."),
            Reply(tool_calls=[move]),
            Reply(content="Moved."),
            Reply(content="Again."),
        ]
    )
    await orchestrator.respond("hello")
    engine = orchestrator.engine
    snapshot = orchestrator.snapshot()
    kept = copy.deepcopy(snapshot)
    events = record(orchestrator)

    await orchestrator.respond("move on")
    assert engine.stage.id == "other"
    assert engine.context == {"k": "v"}
    orchestrator.conversation.messages[0]["content"] = "changed in place"

    orchestrator.restore(snapshot)

    assert engine.snapshot() == snapshot.engine
    assert orchestrator.conversation.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi."},
    ]
    assert [e.data for e in events if e.type == "stage_entered"] == [
        {"stage": {"id": "other", "name": "Other"}},
        {"stage": {"id": "main", "name": "Main"}, "restored": True},
    ]

    assert await orchestrator.respond("and now?") == "Again."
    orchestrator.conversation.messages[0]["content"] = "changed again"
    engine.context["later"] = True
    orchestrator.restore(snapshot)
    assert orchestrator.snapshot() == snapshot == kept


PRIVATE_ACCESS_FREE = ("orchestrator.py", "turn.py", "tool_calls.py")


@pytest.mark.parametrize("module", PRIVATE_ACCESS_FREE)
def test_the_orchestrator_and_its_turns_use_only_each_others_public_surface(module: str) -> None:
    """``self._x`` is a class's own business; ``other._x`` (as ruff's SLF001 reads it) would tie
    a turn to the orchestrator's internals, which :class:`playbooks.turn.TurnHost` names."""
    path = Path(__file__).resolve().parent.parent / "playbooks" / module
    tree = ast.parse(path.read_text(), str(path))
    reached = [
        f"{module}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert reached == []
