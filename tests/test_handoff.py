"""Handoff with a summary: an ``llm_decision`` transition with ``require_summary``, through
``vocable chat --json`` against the scripted LLM."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playbooks import ChatClient, PlaybookOrchestrator, load_playbook
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.support.processes import run_vocable
from tests.test_cli import _json_lines

PLAYBOOK = """
id: handoff
name: Handoff
initial_stage: intake
global_system_prompt: GLOBAL PROMPT
stages:
  - id: intake
    name: Intake
    system_prompt: INTAKE PROMPT
  - id: billing
    name: Billing
    description: Billing questions.
    system_prompt: BILLING PROMPT
transitions:
  - id: to_billing
    from: intake
    condition: {type: llm_decision, require_summary: true}
    action: {target_stage: billing, clear_history: true}
"""

SUMMARY = "The caller was charged twice for invoice 42."
NOTE = f"Handoff notes from the previous stage: {SUMMARY}"


async def _chat(path: Path, llm: ScriptedLLM, lines: str) -> list[dict[str, Any]]:
    code, out, err = await run_vocable(
        "chat",
        str(path),
        "--json",
        stdin=lines,
        env={"VOCABLE_LLM_BASE_URL": llm.base_url, "VOCABLE_LLM_MODEL": "m"},
    )
    assert code == 0, err
    return _json_lines(out)


def _transition_tool(request: dict[str, Any]) -> dict[str, Any]:
    (tool,) = [t for t in request["tools"] if t["function"]["name"] == "playbook_transition"]
    return dict(tool["function"])


def _system(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


async def test_the_summary_reaches_the_target_stage_and_replaces_the_cleared_history(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    move = {"target_stage": "billing", "reason": "a billing question", "summary": SUMMARY}
    llm.script(
        [
            Reply(content="Which invoice is it?"),
            Reply(tool_calls=[ScriptedToolCall("playbook_transition", move)]),
            Reply(content="I see the double charge on invoice 42."),
            Reply(content="You are welcome."),
        ]
    )
    lines = await _chat(write_playbook(PLAYBOOK), llm, "I was charged twice\nInvoice 42\nThanks\n")

    # the tool asks for the summary, as a required argument
    parameters = _transition_tool(llm.requests[0])["parameters"]
    assert "summary" in parameters["properties"]
    assert "summary" in parameters["required"]
    assert NOTE not in _system(llm.requests[1])

    # the new stage's answer: its own prompt, carrying the summary
    answer_request = llm.requests[2]
    assert "BILLING PROMPT" in _system(answer_request)
    assert NOTE in _system(answer_request)
    # clear_history kept the summary (and the user's words being answered), nothing else
    assert answer_request["messages"][1:] == [
        {"role": "assistant", "content": NOTE},
        {"role": "user", "content": "Invoice 42"},
    ]
    # ... and it stays in the history of the next turns
    assert llm.requests[3]["messages"][1] == {"role": "assistant", "content": NOTE}

    (triggered,) = [line for line in lines if line["type"] == "transition_triggered"]
    assert triggered["transition"]["summary"] == SUMMARY
    answers = [line for line in lines if line["type"] == "answer"]
    assert [a["stage"] for a in answers] == ["intake", "billing", "billing"]


async def test_a_missing_summary_is_an_error_result_and_the_stage_stays(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    move = {"target_stage": "billing", "reason": "a billing question"}
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("playbook_transition", move)]),
            Reply(content="Could you tell me more about the charge?"),
        ]
    )
    lines = await _chat(write_playbook(PLAYBOOK), llm, "I was charged twice\n")

    (tool_result,) = [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert "summary is required" in json.loads(tool_result["content"])["error"]
    assert "INTAKE PROMPT" in _system(llm.requests[1])
    assert not [line for line in lines if line["type"] == "transition_triggered"]
    errors = [line for line in lines if line["type"] == "error"]
    assert [e["source"] for e in errors] == ["tool_call"]
    assert lines[-1] == {
        "type": "answer",
        "text": "Could you tell me more about the charge?",
        "stage": "intake",
    }


async def test_without_require_summary_the_summary_is_optional_and_clearing_empties(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    playbook = PLAYBOOK.replace(", require_summary: true", "")
    move = {"target_stage": "billing", "reason": "billing"}
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("playbook_transition", move)]),
            Reply(content="Billing here."),
        ]
    )
    await _chat(write_playbook(playbook), llm, "I was charged twice\n")
    assert "summary" not in _transition_tool(llm.requests[0])["parameters"]["properties"]
    assert llm.requests[1]["messages"][1:] == [{"role": "user", "content": "I was charged twice"}]
    assert "Handoff notes" not in _system(llm.requests[1])


async def test_an_undone_handoff_announces_the_stage_it_goes_back_to(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    """A turn undone after its handoff (a preemptive turn the caller spoke on through) puts the
    stage and history back, and says so: listeners last hear of the stage the call is in."""
    move = {"target_stage": "billing", "reason": "billing", "summary": SUMMARY}
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("playbook_transition", move)]),
            Reply(content="I will refund it."),
        ]
    )
    client = ChatClient.connect(llm.base_url, None, "m")
    orchestrator = PlaybookOrchestrator(load_playbook(write_playbook(PLAYBOOK)), client)
    entered: list[tuple[str, bool]] = []
    orchestrator.on(
        lambda e: (
            entered.append((e.data["stage"]["id"], e.data.get("restored", False)))
            if e.type == "stage_entered"
            else None
        )
    )
    try:
        snapshot = orchestrator.snapshot()
        await orchestrator.respond("I was charged twice.")
        assert orchestrator.engine.stage.id == "billing"

        orchestrator.restore(snapshot)

        assert orchestrator.engine.stage.id == "intake"
        assert orchestrator.conversation.messages == snapshot.messages
        assert entered == [("billing", False), ("intake", True)]
        orchestrator.restore(snapshot)  # nothing changed: nothing to announce
        assert entered == [("billing", False), ("intake", True)]
    finally:
        await client.aclose()
