"""MCP servers' tools in playbooks: a FastMCP server (tests/support/mcp_server.py) over stdio and
streamable HTTP, driven through ``vocable chat --json`` with the scripted LLM."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from playbooks import PlaybookError, ToolError, load_playbook
from playbooks.mcp import close_mcp_sessions
from playbooks.tools import InvalidToolCall
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import REPO
from tests.support.processes import popen, run_vocable
from tests.test_cli import _json_lines

ALL_TOOLS = {"lookup_order", "refund", "explode", "slow", "echo", "crash", "pid"}
STDIO: dict[str, Any] = {
    "name": "orders",
    "command": sys.executable,
    "args": ["-m", "tests.support.mcp_server"],
    "env": {"PYTHONPATH": str(REPO)},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def http_server() -> Iterator[dict[str, Any]]:
    """The test server on streamable HTTP, as an ``mcp_servers`` entry."""
    port = _free_port()
    process = popen(
        [sys.executable, "-m", "tests.support.mcp_server", "--http", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, "the MCP test server exited"
                assert time.monotonic() < deadline, "the MCP test server did not start"
                time.sleep(0.1)
        yield {"name": "orders", "url": f"http://127.0.0.1:{port}/mcp"}
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    yield
    close_mcp_sessions()


def _playbook(folder: Path, server: dict[str, Any], stage_tools: list[str], **options: Any) -> Path:
    spec = {
        "id": "mcp",
        "name": "MCP",
        "initial_stage": "main",
        "mcp_servers": [{**server, **options}],
        "stages": [{"id": "main", "name": "Main", "system_prompt": "Help.", "tools": stage_tools}],
    }
    path = folder / "mcp.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def _offered(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in request.get("tools") or []}


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_chat_calls_mcp_tools_like_python_tools(
    transport: str, llm: ScriptedLLM, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    server = STDIO if transport == "stdio" else request.getfixturevalue("http_server")
    playbook = _playbook(tmp_path, server, sorted(ALL_TOOLS), timeout_ms=1500)
    llm.script(
        [
            Reply(
                tool_calls=[
                    ScriptedToolCall("lookup_order", {"order_id": "A1001"}),
                    ScriptedToolCall("refund", {"order_id": "A1001"}),
                    ScriptedToolCall("explode", {}),
                ]
            ),
            Reply(content="A1001 shipped."),
            Reply(tool_calls=[ScriptedToolCall("slow", {"seconds": 10})]),
            Reply(content="That took too long."),
        ]
    )
    code, out, err = await run_vocable(
        "chat",
        str(playbook),
        "--llm-base-url",
        llm.base_url,
        "--llm-model",
        "scripted-model",
        "--json",
        stdin="Where is A1001?\nAnd slowly?\n",
    )
    assert code == 0, err
    offered = _offered(llm.requests[0])
    assert set(offered) == ALL_TOOLS
    assert offered["lookup_order"]["description"].startswith("Look up an order's status.")
    assert offered["lookup_order"]["parameters"]["properties"]["order_id"]["type"] == "string"
    assert offered["refund"]["parameters"]["required"] == ["order_id", "amount"]

    results = [m["content"] for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert '"status": "shipped"' in results[0]  # the server's answer reached the LLM
    assert "invalid arguments for 'refund': amount: Field required" in results[1]
    assert "the warehouse is on fire" in results[2]
    slow_result = [m["content"] for m in llm.requests[3]["messages"] if m["role"] == "tool"]
    assert "timed out after 1.5 s" in slow_result[-1]

    lines = _json_lines(out)
    errors = [(e["source"], e["tool"], e["message"]) for e in lines if e["type"] == "error"]
    assert [(source, tool) for source, tool, _ in errors] == [
        ("tool_call", "refund"),
        ("tool", "explode"),
        ("tool", "slow"),
    ]
    answers = [line["text"] for line in lines if line["type"] == "answer"]
    assert answers == ["A1001 shipped.", "That took too long."]


async def test_the_tools_filter_leaves_the_other_tools_out(tmp_path: Path) -> None:
    playbook = _playbook(tmp_path, STDIO, ["lookup_order"], tools=["lookup_order", "echo"])
    loaded = await asyncio.to_thread(load_playbook, playbook)
    assert set(loaded.tools) == {"lookup_order", "echo"}  # refund, explode... are not loaded
    assert loaded.servers == {"orders": ("lookup_order", "echo")}

    # a stage naming a tool the filter leaves out is refused, naming what the server gives
    playbook = _playbook(tmp_path, STDIO, ["lookup_order", "refund"], tools=["lookup_order"])
    with pytest.raises(PlaybookError) as caught:
        await asyncio.to_thread(load_playbook, playbook)
    assert str(caught.value) == (
        "mcp.yaml:1: stages[0].tools[1]: unknown tool 'refund'"
        " (MCP server 'orders' gives (by its tools list): lookup_order)"
    )


async def test_a_stage_takes_all_of_a_servers_tools_by_mcp_server_name(
    llm: ScriptedLLM, tmp_path: Path
) -> None:
    """``mcp:<server>`` offers every tool the server gives (after its filter), in one stage."""
    stages = [
        {"id": "main", "name": "Main", "system_prompt": "Help.", "tools": ["mcp:orders"]},
        {"id": "quiet", "name": "Quiet", "system_prompt": "Chat.", "tools": []},
        {"id": "few", "name": "Few", "system_prompt": "Look.", "tools": ["echo", "mcp:few"]},
    ]
    servers = [  # the same test server twice, splitting its tools
        {**STDIO, "tools": sorted(ALL_TOOLS - {"lookup_order"})},
        {**STDIO, "name": "few", "tools": ["lookup_order"]},
    ]
    path = tmp_path / "all.yaml"
    spec = {"id": "mcp", "name": "MCP", "initial_stage": "main", "stages": stages}
    path.write_text(json.dumps({**spec, "mcp_servers": servers}))
    loaded = await asyncio.to_thread(load_playbook, path)
    offered = {stage.id: stage.tools for stage in loaded.spec.stages}
    assert set(offered["main"]) == ALL_TOOLS - {"lookup_order"}
    assert offered["quiet"] == []
    assert offered["few"] == ["echo", "lookup_order"]

    # through chat: the stage offers the server's tools and they run
    path.write_text(json.dumps({**spec, "mcp_servers": [STDIO], "stages": stages[:2]}))
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1002"})]),
            Reply(content="A1002 is being prepared."),
        ]
    )
    code, _, err = await run_vocable(
        "chat", str(path), "--llm-base-url", llm.base_url, "--json", stdin="Where is A1002?\n"
    )
    assert code == 0, err
    assert set(_offered(llm.requests[0])) == ALL_TOOLS
    results = [m["content"] for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert '"status": "processing"' in results[0]


async def test_a_stage_naming_an_unknown_server_is_refused_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    server = json.dumps(STDIO)
    path.write_text(
        "id: bad\nname: Bad\ninitial_stage: main\n"
        f"mcp_servers:\n  - {server}\n"
        "stages:\n  - id: main\n    name: Main\n    system_prompt: Help.\n"
        "    tools:\n      - mcp:orders\n      - mcp:billing\n"
    )
    with pytest.raises(PlaybookError) as caught:
        await asyncio.to_thread(load_playbook, path)
    assert str(caught.value) == (
        "bad.yaml:12: stages[0].tools[1]: no MCP server 'billing' (mcp_servers: orders)"
    )


async def test_annotations_give_side_effects_and_a_lost_server_reconnects(
    tmp_path: Path,
) -> None:
    loaded = await asyncio.to_thread(load_playbook, _playbook(tmp_path, STDIO, []))
    tools = loaded.tools
    assert not tools["lookup_order"].side_effects
    assert tools["refund"].side_effects
    assert tools["refund"].on_interrupt == "finish"
    assert tools["explode"].side_effects  # no annotations: assume side effects
    first = await tools["pid"].call("{}")
    with pytest.raises(ToolError, match="lost the connection to MCP server 'orders'"):
        await tools["crash"].call("{}")
    second = await tools["pid"].call("{}")
    assert second != first  # a new server process answered
    assert '"status": "processing"' in await tools["lookup_order"].call('{"order_id": "A1002"}')


async def test_arguments_are_validated_against_the_json_schema(tmp_path: Path) -> None:
    loaded = await asyncio.to_thread(load_playbook, _playbook(tmp_path, STDIO, [], tools=["echo"]))
    echo = loaded.tools["echo"]
    # optional arguments left out are not sent (the server's defaults apply); "2" becomes 2
    assert json.loads(await echo.call('{"text": "ab"}')) == {"text": "ab", "tags": None}
    result = json.loads(await echo.call('{"text": "ab", "times": "2", "tags": ["x"]}'))
    assert result == {"text": "abab", "tags": ["x"]}
    with pytest.raises(InvalidToolCall, match=r"'echo': tags\.0: Input should be a valid string"):
        await echo.call('{"text": "ab", "tags": [1]}')
    with pytest.raises(InvalidToolCall, match="not valid JSON"):
        await echo.call("{text")


@pytest.mark.parametrize(
    ("server", "message"),
    [
        (
            {**STDIO, "tools": ["lookup_order", "nope"]},
            "mcp.yaml:1: mcp_servers[0].tools[1]: MCP server 'orders' has no tool 'nope'",
        ),
        (
            {"name": "gone", "command": "/nonexistent/mcp-server"},
            "mcp.yaml:1: mcp_servers[0]: cannot connect to MCP server 'gone'",
        ),
        (
            {**STDIO, "url": "http://127.0.0.1:9/mcp"},
            "give exactly one of command (stdio) or url (streamable HTTP)",
        ),
    ],
)
async def test_an_unusable_server_is_refused_at_load(
    server: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(PlaybookError) as caught:
        await asyncio.to_thread(load_playbook, _playbook(tmp_path, server, []))
    assert message in str(caught.value)
