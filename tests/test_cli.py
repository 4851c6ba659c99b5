"""``vocable chat`` as a user runs it: a real subprocess talking to the scripted LLM over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES, REPO
from tests.support.processes import run_vocable, spawn, until_ready


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_chat_holds_a_conversation_in_plain_text(llm: ScriptedLLM) -> None:
    llm.script(
        [
            Reply(content="Sure. What is your order number?"),
            Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1002"})]),
            Reply(content="Order A1002 is processing and should arrive on Friday."),
        ]
    )
    code, out, err = await run_vocable(
        "chat",
        str(EXAMPLES / "support.yaml"),
        "--llm-base-url",
        llm.base_url,
        "--llm-model",
        "scripted-model",
        stdin="Hi, I have a question about my order\nIt is A1002\n",
    )
    assert code == 0, err
    assert out.splitlines() == [
        "Hello, this is Acme support. How can I help you today?",
        "Sure. What is your order number?",
        "Order A1002 is processing and should arrive on Friday.",
    ]
    assert {r["model"] for r in llm.requests} == {"scripted-model"}
    # The tool really ran: its result went back to the LLM.
    tool_results = [m for m in llm.requests[2]["messages"] if m["role"] == "tool"]
    assert '"status": "processing"' in tool_results[0]["content"]


async def test_chat_json_lines_carry_every_event_and_the_answer(llm: ScriptedLLM) -> None:
    llm.script(
        [
            Reply(content="Which order?"),
            Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1001"})]),
            Reply(content="It shipped and arrives Tuesday."),
        ]
    )
    code, out, err = await run_vocable(
        "chat",
        str(EXAMPLES / "support.yaml"),
        "--json",
        stdin="Where is my order?\nA1001\n",
        env={"VOCABLE_LLM_BASE_URL": llm.base_url, "VOCABLE_LLM_MODEL": "m"},
    )
    assert code == 0, err
    lines = _json_lines(out)
    types = [line["type"] for line in lines]
    assert types[0] == "greeting"
    # turn 1: the keyword "order" (in: user) moves greeting -> identify before Phase 1
    assert types[1:4] == ["transition_triggered", "stage_exited", "stage_entered"]
    assert lines[1]["transition"]["to"] == "identify"
    answers = [line for line in lines if line["type"] == "answer"]
    assert [a["text"] for a in answers] == ["Which order?", "It shipped and arrives Tuesday."]
    second_turn = types[types.index("answer") + 1 :]
    assert second_turn == [
        "phase1_start",
        "tool_call_start",
        "tool_call_complete",
        "phase1_complete",
        "phase2_start",
        "phase2_complete",
        "answer",
    ]
    complete = lines[types.index("tool_call_complete")]
    assert complete["call"]["name"] == "lookup_order"
    assert complete["error"] is False


async def test_chat_falls_back_to_openai_variables(llm: ScriptedLLM) -> None:
    llm.script(
        [
            Reply(
                content='{"intent": "none", "confidence": 0.9}'
            ),  # the welcome stage's intent check
            Reply(content="Hello there."),
        ]
    )
    code, out, err = await run_vocable(
        "chat",
        str(EXAMPLES / "restaurant.yaml"),
        stdin="hello\n",
        env={"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": "sk-test"},
    )
    assert code == 0, err
    assert out.splitlines()[-1] == "Hello there."
    assert [r["model"] for r in llm.requests] == ["gpt-4o-mini"] * 2
    assert "stream" not in llm.requests[0]
    assert llm.requests[1]["stream"] is True


async def test_chat_with_a_dead_endpoint_speaks_the_fallback_and_goes_on() -> None:
    async with ScriptedLLM() as llm:
        base_url = llm.base_url  # closed on exit: nothing listens there any more
    code, out, err = await run_vocable(
        "chat",
        str(EXAMPLES / "restaurant.yaml"),
        "--json",
        "--llm-base-url",
        base_url,
        "--llm-retries",
        "0",
        stdin="hello\nanyone there?\n",
    )
    assert code == 0, err
    lines = _json_lines(out)
    answers = [line["text"] for line in lines if line["type"] == "answer"]
    assert answers == ["Sorry, I'm having trouble right now."] * 2
    errors = [line for line in lines if line["type"] == "error"]
    assert errors
    assert all("connect" in e["message"] for e in errors)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "id: x\nname: X\ninitial_stage: nowhere\nstages:\n"
            "  - {id: a, name: A, system_prompt: hi}\n",
            "initial_stage: unknown stage 'nowhere'",
        ),
        ("id: x\nname: [unclosed\n", "YAML syntax error at line"),
    ],
)
async def test_chat_rejects_an_invalid_playbook_with_exit_status_2(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    code, out, err = await run_vocable("chat", str(path), "--llm-base-url", "http://127.0.0.1:9/v1")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "bad.yaml" in lines[0]
    assert expected in lines[0]


async def test_chat_without_any_endpoint_says_how_to_configure_one() -> None:
    code, _, err = await run_vocable("chat", str(EXAMPLES / "support.yaml"))
    assert code == 2
    assert "--llm-base-url" in err
    assert "OPENAI_API_KEY" in err


async def test_serve_starts_says_where_and_stops_cleanly(unused_tcp_port: int) -> None:
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("VOCABLE_", "OPENAI_"))}
    process = await spawn(
        sys.executable,
        "-m",
        "server",
        "serve",
        "--port",
        str(unused_tcp_port),
        "--llm",
        "none",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=clean_env,
    )
    assert process.stdout is not None
    try:
        line = await until_ready(process)
        assert f"http://127.0.0.1:{unused_tcp_port}".encode() in line
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{unused_tcp_port}/healthz") as response,
        ):
            health = await response.json()
        assert health["status"] == "ok"
        assert health["llm_configured"] is False
    finally:
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()
    assert b"no LLM (--llm none)" in err
    assert b"Traceback" not in err
