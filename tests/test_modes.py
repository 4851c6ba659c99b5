"""Stage execution modes and the ``playbook`` commands, through the real ``vocable`` process.

The requests the scripted LLM received show how each mode ran: how many rounds, with which tools.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from playbooks.orchestrator import ITERATIVE_NOTE
from server.testkit.scripted_llm import NO_INTENT, Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES
from tests.support.processes import run_vocable
from tests.test_cli import _json_lines

TOOLS_PY = '''
from playbooks import tool


@tool(side_effects=False)
def progress(step: int) -> str:
    """Record progress.

    Args:
        step: The step done.
    """
    return f"step {step} done"


@tool
def finish() -> str:
    """Finish the work."""
    return "finished"
'''

MODES = """\
---
initial_stage: {initial}
tools_module: tools.py
stages:
  work: {{mode: {work_mode}}}
  quick: {{mode: single-shot}}
transitions:
  - id: done
    from: work
    condition: {{type: tool_call, tool_name: finish}}
    action: {{target_stage: quick}}
    description: The work is finished.
---
# Modes

## Work

Do the work with your tools.

### Tools

- progress
- finish

## Quick

Answer in one line.

### Tools

- progress
"""


def _playbook(tmp_path: Path, *, work_mode: str = "iterative", initial: str = "work") -> Path:
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS_PY))
    path = tmp_path / "modes.md"
    path.write_text(MODES.format(work_mode=work_mode, initial=initial))
    return path


async def _chat(llm: ScriptedLLM, path: Path, stdin: str, *extra: str) -> list[dict[str, Any]]:
    code, out, err = await run_vocable(
        "chat", str(path), "--json", "--llm-base-url", llm.base_url, *extra, stdin=stdin
    )
    assert code == 0, err
    return _json_lines(out)


def _tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools") or []]


def _system(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


async def test_single_shot_is_one_streamed_call_without_tools(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script([Reply(content="Hello."), Reply(content="Fine.")])
    lines = await _chat(llm, _playbook(tmp_path, initial="quick"), "hi\nhow are you\n")
    assert [line["text"] for line in lines if line["type"] == "answer"] == ["Hello.", "Fine."]
    assert len(llm.requests) == 2  # one per turn
    for request in llm.requests:
        assert request["stream"] is True
        assert "tools" not in request  # the stage lists progress, but none is offered
        assert _system(request).endswith("Answer in one line.")
    assert not [line for line in lines if line["type"].startswith("tool_call")]


async def test_iterative_stops_the_tool_loop_when_an_exit_condition_holds(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("progress", {"step": 1})]),
            Reply(tool_calls=[ScriptedToolCall("finish")]),
            Reply(content="All done."),
        ]
    )
    lines = await _chat(llm, _playbook(tmp_path), "do it\n")
    assert [line["text"] for line in lines if line["type"] == "answer"] == ["All done."]
    first, second, answer = llm.requests
    for request in (first, second):
        assert _tool_names(request) == ["progress", "finish"]
        assert ITERATIVE_NOTE in _system(request)
        assert "This stage ends when:\n- The work is finished." in _system(request)
    # `finish` satisfied `done` mid-turn: the answer comes from the new stage, without tools
    assert "tools" not in answer
    assert _system(answer).endswith("Answer in one line.")
    types = [line["type"] for line in lines]
    assert types.index("transition_triggered") < types.index("phase2_start")
    assert lines[-1]["stage"] == "quick"


async def test_playbook_mode_keeps_the_loop_going_until_the_llm_answers(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("progress", {"step": 1})]),
            Reply(tool_calls=[ScriptedToolCall("finish")]),
            Reply(content="All done."),
        ]
    )
    lines = await _chat(llm, _playbook(tmp_path, work_mode="playbook"), "do it\n")
    assert [_tool_names(r) for r in llm.requests] == [["progress", "finish"]] * 3
    assert all(ITERATIVE_NOTE not in _system(r) for r in llm.requests)
    types = [line["type"] for line in lines]
    assert types.index("phase2_complete") < types.index("transition_triggered")  # end of turn
    assert lines[-1]["stage"] == "quick"


async def test_iterative_is_bounded_by_the_tool_call_limit(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("progress", {"step": 1})]),
            Reply(tool_calls=[ScriptedToolCall("progress", {"step": 2})]),
            Reply(content="Still at it."),
        ]
    )
    lines = await _chat(llm, _playbook(tmp_path), "do it\n", "--max-tool-calls", "2")
    assert [line["text"] for line in lines if line["type"] == "answer"] == ["Still at it."]
    assert [bool(_tool_names(r)) for r in llm.requests] == [True, True, False]
    assert lines[-1]["stage"] == "work"


async def test_chat_runs_the_markdown_example(llm: ScriptedLLM) -> None:
    intent = "The caller asks about an order, a delivery, a refund or a cancellation"
    llm.script(
        [
            Reply(content=f'{{"intent": "{intent}", "confidence": 0.9}}'),
            Reply(content="Sure, what is the order number?"),
        ]
    )
    lines = await _chat(llm, EXAMPLES / "markdown" / "support.md", "Where is my parcel?\n")
    assert lines[0] == {
        "type": "greeting",
        "text": "Hello, this is Acme support. How can I help you today?",
    }
    assert lines[-1]["stage"] == "identify"
    assert "stream" not in llm.requests[0]  # the intent check
    assert _tool_names(llm.requests[1]) == ["lookup_order", "playbook_transition"]
    assert "1. Ask for the order number" in _system(llm.requests[1])


async def test_playbook_check_lists_stages_and_transitions() -> None:
    code, out, err = await run_vocable(
        "playbook", "check", str(EXAMPLES / "markdown" / "support.md")
    )
    assert code == 0, err
    assert out.startswith("playbook support: Acme customer support\ninitial stage: greeting\n")
    assert "stage identify: Identify the order [iterative]\n  tools: lookup_order\n" in out
    assert "  -> farewell when tool_call cancel_order  [cancelled]\n" in out
    assert "from any stage:\n  -> farewell when keyword in user: goodbye" in out


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.md", "# X\n## A\nhi\n### Triggers\n- on → b\n", "bad.md:5: unknown stage 'b'"),
        ("bad.yaml", "id: x\nname: [unclosed\n", "bad.yaml: YAML syntax error at line"),
        (  # found after validation, still at its line
            "bad.md",
            "# X\n## A\nhi\n### Tools\n- mcp:orders\n",
            "bad.md:5: no MCP server 'orders' (mcp_servers: none)",
        ),
        (
            "bad.yaml",
            "id: x\nname: X\ninitial_stage: a\nstages:\n  - {id: a, name: A, system_prompt: hi}\n"
            "transitions:\n  - id: t\n    from: a\n    condition: {type: llm_decision}\n"
            "    action: {target_stage: b}\n",
            "bad.yaml:10: transitions[0].action.target_stage: unknown stage 'b'",
        ),
    ],
)
@pytest.mark.parametrize("action", ["check", "graph"])
async def test_playbook_commands_reject_an_invalid_file_with_one_line(
    tmp_path: Path, name: str, text: str, expected: str, action: str
) -> None:
    (tmp_path / name).write_text(text)
    code, out, err = await run_vocable("playbook", action, str(tmp_path / name))
    assert (code, out) == (2, "")
    assert err.splitlines() == [err.strip()]
    assert err.startswith(expected)


async def test_playbook_graph_prints_mermaid(tmp_path: Path) -> None:
    code, out, err = await run_vocable("playbook", "graph", str(EXAMPLES / "support.yaml"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert '    state "Identify the order" as identify' in lines
    assert "    [*] --> greeting" in lines
    assert "    order_help --> farewell: tool_call cancel_order" in lines
    assert "    identify --> farewell: max_turns 4" in lines  # the stage's default filled in
    # a transition from "*" is drawn from every other stage
    goodbye = [line for line in lines if "goodbye" in line]
    assert [line.split(" -->")[0].strip() for line in goodbye] == [
        "greeting",
        "identify",
        "order_help",
    ]


async def test_playbook_check_notes_what_a_single_shot_stage_cannot_do(tmp_path: Path) -> None:
    code, out, err = await run_vocable("playbook", "check", str(_playbook(tmp_path)))
    assert code == 0, err
    assert "stage work: Work [iterative]\n" in out
    assert "stage quick: Quick [single-shot]\n  tools: progress\n" in out
    assert out.rstrip().endswith("  note: single-shot offers no tools")


OFFLINE = """\
---
tools_module: tools.py
mcp_servers:
  - {name: orders, command: /nonexistent/orders-mcp}
stages:
  desk: {delegates: {workers: [orders]}}
---
# Offline

## Desk

Help the caller.

### Triggers

- The caller asks about an order → orders

## Orders

Look orders up.

### Tools

- mcp:orders
- progress
"""


async def test_check_and_graph_run_nothing_of_the_playbook_unless_asked(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "tools.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n" + textwrap.dedent(TOOLS_PY)
    )
    path = tmp_path / "offline.md"
    path.write_text(OFFLINE)

    code, out, err = await run_vocable("playbook", "graph", str(path))
    assert code == 0, err
    assert out.splitlines() == [
        "stateDiagram-v2",
        '    state "Desk" as desk',
        '    state "Orders" as orders',
        "    [*] --> desk",
        "    desk --> orders: intent 'The caller asks about an order' (confidence 0.7)",
        "    desk --> orders: delegates",
    ]
    code, out, err = await run_vocable("playbook", "check", str(path))
    assert code == 0, err
    assert "\ntools: not loaded (--connect imports tools.py and starts the MCP servers)\n" in out
    assert "MCP server orders: /nonexistent/orders-mcp\n" in out
    assert "stage orders: Orders [playbook]\n  tools: mcp:orders, progress\n" in out
    assert not marker.exists()  # the tools module was not imported, no server started

    # --connect loads it as chat and serve do: the module runs, the server must start
    code, out, err = await run_vocable("playbook", "check", "--connect", str(path))
    assert (code, out) == (2, "")
    assert err.startswith("offline.md:4: cannot connect to MCP server 'orders'")
    assert marker.exists()


async def test_check_connect_lists_the_loaded_tools(tmp_path: Path) -> None:
    code, out, err = await run_vocable("playbook", "check", "--connect", str(_playbook(tmp_path)))
    assert code == 0, err
    assert "\ntools: finish, progress\n" in out


LOOP = """\
---
tools_module: tools.py
stages:
  work: {mode: iterative, max_turns: 5}
transitions:
  - id: done
    from: work
    condition: {type: tool_call, tool_name: finish}
    action: {target_stage: quick}
    description: The work is finished.
  - id: by_hand
    from: work
    condition: {type: llm_decision}
    action: {target_stage: quick}
    description: The caller asks for a person.
  - id: bye
    from: work
    condition: {type: keyword, keywords: [bye], in: user}
    action: {target_stage: quick}
    description: The caller says bye.
  - id: tired
    from: work
    condition: {type: max_turns}
    action: {target_stage: quick}
    description: Five turns have passed.
  - id: back
    from: "*"
    condition: {type: tool_call, tool_name: progress}
    action: {target_stage: work}
    description: Progress was made somewhere.
---
# Loop

## Work

Do the work.

### Triggers

- The caller wants to stop → quick

### Tools

- progress
- finish

## Quick

Answer in one line.
"""


async def test_iterative_lists_only_the_exits_its_loop_can_take(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    """Triggers and other conditions on the caller's words are checked before the turn, the
    answer's after it, turns at its end: none can end the tool loop, so none is listed."""
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS_PY))
    path = tmp_path / "loop.md"
    path.write_text(LOOP)
    llm.script(
        [
            NO_INTENT,
            Reply(tool_calls=[ScriptedToolCall("progress", {"step": 1})]),
            Reply(content="Working on it."),
            Reply(content='{"intent": "The caller wants to stop", "confidence": 0.9}'),
            Reply(content="Stopped."),
        ]
    )
    lines = await _chat(llm, path, "do it\nplease stop\n")
    assert [line["text"] for line in lines if line["type"] == "answer"] == [
        "Working on it.",
        "Stopped.",
    ]
    classify, work, work_again, classify_again, quick = llm.requests
    for request in (work, work_again):
        assert _system(request).endswith(
            f"{ITERATIVE_NOTE}\n\n"
            "This stage ends when:\n- The work is finished.\n- The caller asks for a person."
        )
    assert "The caller wants to stop" not in _system(work)
    # the trigger still moves the conversation, before the turn
    assert "- The caller wants to stop" in _system(classify_again)
    assert "stream" not in classify
    assert "stream" not in classify_again
    assert _system(quick).endswith("Answer in one line.")
    assert lines[-1]["stage"] == "quick"
