"""llmrtc playbooks load as they are: ``JSON.stringify`` of an llmrtc ``Playbook`` (inline tool
definitions with camelCase parameters, ``defaultLLMConfig``, ``toolChoice: {"name": ...}``,
``version`` and ``metadata``) runs with a tools module of snake_case Python tools, an HTTP tool,
named stage hooks and named ``custom`` conditions.

``tests/playbooks/llmrtc/support-bot.json`` is in llmrtc's exact shape; its tools module is
``support_tools.py`` beside it, except ``classify_issue``, which the tests serve over HTTP from a
local server (a copy of the file with a ``"url"`` on that definition).
"""

from __future__ import annotations

import asyncio
import copy
import json
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from playbooks import (
    ChatClient,
    LLMConfig,
    OrchestratorEvent,
    PlaybookError,
    PlaybookOrchestrator,
    RetryPolicy,
    load_playbook,
)
from playbooks.context import current_context
from playbooks.models import CustomCondition, NamedToolChoice, Playbook
from server.testkit.loopback import LoopbackServer
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import REPO
from tests.support.processes import run_vocable

LLMRTC = REPO / "tests" / "playbooks" / "llmrtc"
SUPPORT_BOT = LLMRTC / "support-bot.json"
SUPPORT_TOOLS = LLMRTC / "support_tools.py"
NOWHERE = "http://127.0.0.1:9/classify"
"""A url for tests that never call the HTTP tool (the discard port: nothing answers there)."""
SUBPROCESS_TIMEOUT_S = 60

RESOLUTION_METADATA = {
    "requiresConfirmation": ["book_repair", "issue_refund"],
    "refundLimitGbp": 250,
}
PLAYBOOK_METADATA = {
    "owner": "support-ops",
    "locale": "en-GB",
    "channel": "voice",
    "tags": ["support", "orders", "workshop"],
}


# -- helpers ----------------------------------------------------------------------------------


CASE = {"caseRef": "TRI-0042", "queue": "workshop"}
"""What the HTTP tool ``classify_issue`` answers (with the category it was given)."""


class ToolServer(LoopbackServer):
    """The HTTP end of an inline tool with a ``url``: records each JSON body it is POSTed.

    ``/classify`` answers with a case reference; ``/down`` fails with status 500."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[Any] = []
        self.headers: list[dict[str, str]] = []

    @property
    def base_url(self) -> str:
        return self.origin

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/classify", self._classify)
        app.router.add_post("/down", self._down)

    async def _record(self, request: web.Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        return body

    async def _classify(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return web.json_response({**CASE, "category": body.get("category")})

    async def _down(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.Response(status=500, text="workshop system down")


@pytest.fixture
async def tool_server() -> AsyncIterator[ToolServer]:
    server = ToolServer()
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def client(llm: ScriptedLLM) -> AsyncIterator[ChatClient]:
    chat = ChatClient.connect(llm.base_url, None, "scripted", retry=RetryPolicy(retries=0))
    yield chat
    await chat.aclose()


def support_bot(tmp_path: Path, url: str = NOWHERE, **changes: Any) -> Path:
    """A copy of support-bot.json in ``tmp_path`` whose ``classify_issue`` is called at ``url``;
    ``changes`` are set on the resolution stage (``onEnter="..."``)."""
    data = json.loads(SUPPORT_BOT.read_text())
    for definition in _definitions(data):
        if definition["name"] == "classify_issue":
            definition["url"] = url
    data["stages"][3].update(changes)
    path = tmp_path / "support-bot.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def _definitions(data: dict[str, Any]) -> list[dict[str, Any]]:
    entries = [*data.get("globalTools", [])]
    for stage in data["stages"]:
        entries += stage.get("tools", [])
    return [entry for entry in entries if isinstance(entry, dict)]


def write(tmp_path: Path, playbook: dict[str, Any], tools_py: str | None = None) -> Path:
    """``playbook`` as ``playbook.json`` and ``tools_py`` as ``tools.py`` in ``tmp_path``."""
    path = tmp_path / "playbook.json"
    path.write_text(json.dumps(playbook, indent=2))
    if tools_py is not None:
        (tmp_path / "tools.py").write_text(textwrap.dedent(tools_py))
    return path


def module(tmp_path: Path, source: str, name: str = "other_tools.py") -> Path:
    """A tools module ``name`` in ``tmp_path`` holding ``source``."""
    path = tmp_path / name
    path.write_text(source + "\n")
    return path


def llmrtc_playbook(
    stages: list[dict[str, Any]], transitions: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    """A small playbook in llmrtc's shape (``transitions`` is required there)."""
    return {
        "id": "desk",
        "name": "Help desk",
        "stages": stages,
        "transitions": transitions or [],
        "initialStage": stages[0]["id"],
        **extra,
    }


def stage(stage_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": stage_id,
        "name": stage_id.title(),
        "systemPrompt": f"You are {stage_id}.",
        **fields,
    }


def definition(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"The {name} tool",
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


def keyword(transition_id: str, source: str, target: str, word: str, **data: Any) -> dict[str, Any]:
    """A transition on ``word`` in the assistant's answer, carrying ``data``."""
    action: dict[str, Any] = {"targetStage": target}
    if data:
        action["data"] = data
    return {
        "id": transition_id,
        "from": source,
        "condition": {"type": "keyword", "keywords": [word]},
        "action": action,
    }


ORDER_ID = {"orderId": {"type": "string"}}


async def vocable(*args: str, stdin: str = "") -> tuple[int, str, str]:
    """``python -m server ARGS`` with ``stdin``; its exit code, stdout and stderr."""
    return await run_vocable(*args, stdin=stdin, timeout_s=SUBPROCESS_TIMEOUT_S)


def tool_results(request: dict[str, Any]) -> dict[str, list[str]]:
    """The tool results in a request's messages, by the name of the tool called."""
    names: dict[str, str] = {}
    results: dict[str, list[str]] = {}
    for message in request["messages"]:
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool":
            results.setdefault(names[message["tool_call_id"]], []).append(message["content"])
    return results


def offered(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tools a request offers, by name: each one's ``function`` entry."""
    return {tool["function"]["name"]: tool["function"] for tool in request.get("tools", [])}


def record(orchestrator: PlaybookOrchestrator) -> list[OrchestratorEvent]:
    events: list[OrchestratorEvent] = []
    orchestrator.on(events.append)
    return events


def of_type(events: list[OrchestratorEvent], kind: str) -> list[dict[str, Any]]:
    return [event.data for event in events if event.type == kind]


# -- the file as llmrtc wrote it --------------------------------------------------------------


def test_the_file_loads_with_its_tools_module_keeping_version_and_metadata(
    tmp_path: Path,
) -> None:
    loaded = load_playbook(support_bot(tmp_path), SUPPORT_TOOLS)
    spec = loaded.spec
    assert spec.version == "2.1.0"
    assert spec.metadata == PLAYBOOK_METADATA
    assert spec.stage("greeting").metadata == {"uiColor": "#3f9d6b", "greetingVariant": "short"}
    assert spec.stage("resolution").metadata == RESOLUTION_METADATA
    assert spec.stage("triage").metadata == {}
    assert spec.default_llm_config == LLMConfig(
        model="gpt-4o-mini", temperature=0.5, max_tokens=300
    )
    assert spec.stage("triage").tool_choice == NamedToolChoice(tool_name="classify_issue")
    assert spec.stage("resolution").on_enter == "open_resolution_log"
    custom = [t.condition for t in spec.transitions if isinstance(t.condition, CustomCondition)]
    assert [c.function for c in custom] == ["caller_gave_up"]
    assert set(loaded.functions) >= {"open_resolution_log", "caller_gave_up"}
    # get_order is defined (identically) in two stages, as llmrtc users embed it: one tool
    assert spec.stage("triage").tool_names == ["get_order", "classify_issue"]
    assert spec.stage("resolution").tool_names[0] == "get_order"
    assert sorted(loaded.tools) == [
        "book_repair",
        "classify_issue",
        "get_order",
        "issue_refund",
        "open_case",
        "search_help_centre",
        "verify_customer",
    ]
    # the LLM is offered the inline description and schema, not the Python function's
    inline = json.loads(SUPPORT_BOT.read_text())["stages"][2]["tools"][0]
    get_order = loaded.tools["get_order"]
    assert get_order.description == inline["description"]
    assert get_order.parameters == inline["parameters"]


def test_without_its_url_the_one_tool_the_module_lacks_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlaybookError) as caught:
        load_playbook(SUPPORT_BOT, SUPPORT_TOOLS)
    message = str(caught.value)
    assert (
        "stages[2].tools[1]: tool 'classify_issue' is defined here but has no implementation"
        in message
    )
    for bound in ("verify_customer", "get_order", "book_repair", "search_help_centre"):
        assert f"'{bound}'" not in message


async def test_playbook_check_accepts_the_file_and_prints_its_version() -> None:
    code, out, err = await vocable("playbook", "check", str(SUPPORT_BOT))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "playbook spokesmith-support: Spokesmith Cycles Support Line"
    assert lines[1] == "version: 2.1.0"


async def test_playbook_graph_draws_the_file() -> None:
    code, out, err = await vocable("playbook", "graph", str(SUPPORT_BOT))
    assert code == 0, err
    assert out.startswith("stateDiagram-v2")
    assert "authentication --> triage: tool_call verify_customer" in out
    assert "authentication --> farewell: custom caller_gave_up()" in out


async def test_check_connect_with_the_tools_module_binds_every_tool(tmp_path: Path) -> None:
    path = support_bot(tmp_path)
    code, out, err = await vocable(
        "playbook", "check", "--connect", str(path), "--tools-module", str(SUPPORT_TOOLS)
    )
    assert code == 0, err
    assert "version: 2.1.0" in out.splitlines()
    tools_line = next(line for line in out.splitlines() if line.startswith("tools: "))
    assert "classify_issue" in tools_line
    assert "verify_customer" in tools_line


async def test_check_connect_without_a_tools_module_says_how_to_bind_the_tools(
    tmp_path: Path,
) -> None:
    code, out, err = await vocable("playbook", "check", "--connect", str(support_bot(tmp_path)))
    assert code == 2
    assert out == ""
    # global tools come first: search_help_centre is the first definition with no implementation
    assert (
        "global_tools[0]: tool 'search_help_centre' is defined here but has no implementation"
        in err
    )
    assert "@tool function search_help_centre in the tools module" in err
    assert "--tools-module" in err
    assert "MCP server (mcp_servers)" in err
    assert '"url"' in err


# -- a conversation through five stages -------------------------------------------------------


@pytest.mark.timeout(120)
async def test_chat_runs_the_llmrtc_playbook_with_python_and_http_tools(
    tmp_path: Path, llm: ScriptedLLM, tool_server: ToolServer
) -> None:
    path = support_bot(tmp_path, f"{tool_server.base_url}/classify")
    classification = {
        "category": "damaged_part",
        "summary": "Rear derailleur arrived with a bent hanger",
        "orderId": "SC-123456",
    }
    llm.script(
        [
            # greeting: "order" in the answer moves on (keyword)
            Reply(content="Sorry to hear that! Let me find your order."),
            # authentication: verify_customer (Python, camelCase arguments), then tool_call
            Reply(
                tool_calls=[
                    ScriptedToolCall(
                        "verify_customer",
                        {"customerEmail": "rider@example.com", "orderId": "SC-123456"},
                    )
                ]
            ),
            Reply(content="Thanks, you are verified."),
            # triage: classify_issue (HTTP, forced by toolChoice), get_order (Python)
            Reply(tool_calls=[ScriptedToolCall("classify_issue", classification)]),
            Reply(tool_calls=[ScriptedToolCall("get_order", {"orderId": "SC-123456"})]),
            Reply(content="I have logged a damaged part on order SC-123456."),
            # resolution: book_repair, and "anything else" moves on (keyword)
            Reply(
                tool_calls=[
                    ScriptedToolCall(
                        "book_repair",
                        {
                            "orderId": "SC-123456",
                            "preferredDate": "2025-06-03",
                            "dropOffStore": "york",
                        },
                    )
                ]
            ),
            Reply(content="Booked for York on 3 June. Is there anything else?"),
            # farewell
            Reply(content="Thanks for calling Spokesmith. Have a good ride!"),
        ]
    )
    code, out, err = await vocable(
        "chat",
        str(path),
        "--tools-module",
        str(SUPPORT_TOOLS),
        "--llm-base-url",
        llm.base_url,
        "--llm-retries",
        "0",
        "--json",
        stdin="Hi, the rear mech I bought arrived broken.\n"
        "It is rider@example.com and the order is SC-123456.\n"
        "The derailleur hanger is bent and it will not shift.\n"
        "Can you book it into the York workshop on the third of June?\n"
        "No, that is all, thanks.\n",
    )
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [line for line in lines if line["type"] == "error"] == []

    transitions = [line["transition"] for line in lines if line["type"] == "transition_triggered"]
    assert [(t["id"], t["condition"]) for t in transitions] == [
        ("greeting-to-authentication", "keyword"),
        ("authentication-verified", "tool_call"),
        ("triage-classified", "tool_call"),
        ("resolution-wrapped-up", "keyword"),
    ]
    entered = [line["stage"] for line in lines if line["type"] == "stage_entered"]
    assert [s["id"] for s in entered] == ["authentication", "triage", "resolution", "farewell"]
    assert entered[2]["metadata"] == RESOLUTION_METADATA  # the stage's metadata comes along
    assert "metadata" not in entered[0]  # authentication has none
    # each answer with the stage the conversation is in after its turn
    answers = [(line["stage"], line["text"]) for line in lines if line["type"] == "answer"]
    assert answers == [
        ("authentication", "Sorry to hear that! Let me find your order."),
        ("triage", "Thanks, you are verified."),
        ("resolution", "I have logged a damaged part on order SC-123456."),
        ("farewell", "Booked for York on 3 June. Is there anything else?"),
        ("farewell", "Thanks for calling Spokesmith. Have a good ride!"),
    ]
    completed = [line["call"]["name"] for line in lines if line["type"] == "tool_call_complete"]
    assert completed == ["verify_customer", "classify_issue", "get_order", "book_repair"]
    assert not any(line["error"] for line in lines if line["type"] == "tool_call_complete")

    requests = llm.requests
    assert len(requests) == 9
    # greeting: toolChoice "none" offers no tools; defaultLLMConfig under the stage's llmConfig
    assert "tools" not in requests[0]
    assert requests[0]["model"] == "gpt-4o-mini"
    assert requests[0]["temperature"] == 0.6
    assert requests[0]["max_tokens"] == 300

    # authentication: the inline schema is what the LLM sees
    inline = json.loads(SUPPORT_BOT.read_text())
    verify = offered(requests[1])["verify_customer"]
    assert verify["parameters"] == inline["stages"][1]["tools"][0]["parameters"]
    assert "search_help_centre" in offered(requests[1])  # a global tool
    # the Python function got the camelCase arguments under its own names
    verified = json.loads(tool_results(requests[2])["verify_customer"][0])
    assert verified == {
        "verified": True,
        "customerId": "C-1042",
        "customerEmail": "rider@example.com",
        "orderId": "SC-123456",
        "orderMatches": True,
    }

    # triage: {"name": "classify_issue"} forces the first round's tool
    assert requests[3]["tool_choice"] == {
        "type": "function",
        "function": {"name": "classify_issue"},
    }
    assert requests[3]["temperature"] == 0.2
    assert requests[3]["max_tokens"] == 250
    # the HTTP tool got the arguments as they are (camelCase JSON), its answer is the result
    assert tool_server.bodies == [classification]
    assert tool_server.headers[0]["Content-Type"].startswith("application/json")
    case = json.loads(tool_results(requests[4])["classify_issue"][0])
    assert case == {**CASE, "category": "damaged_part"}
    order = json.loads(tool_results(requests[5])["get_order"][0])
    assert order["orderId"] == "SC-123456"
    assert order["found"] is True
    assert order["status"] == "delivered"

    # resolution: its llmConfig (model gpt-4o, topP) over defaultLLMConfig
    assert requests[6]["model"] == "gpt-4o"
    assert requests[6]["top_p"] == 0.9
    assert requests[6]["max_tokens"] == 400
    booking = json.loads(tool_results(requests[7])["book_repair"][0])
    assert booking == {
        "bookingRef": "WS-20250603-YOR",
        "orderId": "SC-123456",
        "date": "2025-06-03",
        "store": "york",
    }
    # farewell: toolChoice "none" again
    assert "tools" not in requests[8]
    assert requests[8]["max_tokens"] == 120


async def test_a_custom_transition_names_its_function_and_fires(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient
) -> None:
    """support-bot.json's authentication-abandoned: ``"evaluate": "caller_gave_up"``."""
    playbook = load_playbook(support_bot(tmp_path), SUPPORT_TOOLS)
    orchestrator = PlaybookOrchestrator(playbook, client)
    events = record(orchestrator)
    llm.script(
        [
            Reply(content="Of course. Which order is it about?"),
            Reply(content="No problem, I understand."),
        ]
    )
    await orchestrator.respond("Hello, I have a question")
    assert orchestrator.engine.stage.id == "authentication"
    await orchestrator.respond("Oh, forget it, I will write in instead")
    assert orchestrator.engine.stage.id == "farewell"
    fired = [e["transition"] for e in of_type(events, "transition_triggered")]
    assert [(t["id"], t["condition"]) for t in fired] == [
        ("greeting-to-authentication", "keyword"),
        ("authentication-abandoned", "custom"),
    ]


async def test_the_resolution_stage_on_enter_hook_gets_the_conversation(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient, tool_server: ToolServer
) -> None:
    playbook = load_playbook(
        support_bot(tmp_path, f"{tool_server.base_url}/classify"), SUPPORT_TOOLS
    )
    hook = playbook.functions["open_resolution_log"]
    log: list[Any] = hook.__globals__["RESOLUTION_LOG"]  # of the module this load imported
    orchestrator = PlaybookOrchestrator(playbook, client)
    events = record(orchestrator)
    llm.script(
        [
            Reply(content="Let me find your order."),
            Reply(
                tool_calls=[ScriptedToolCall("verify_customer", {"customerEmail": "a@example.com"})]
            ),
            Reply(content="You are verified."),
            Reply(
                tool_calls=[
                    ScriptedToolCall("classify_issue", {"category": "other", "summary": "Noisy"})
                ]
            ),
            Reply(content="Noted."),
        ]
    )
    await orchestrator.respond("My order is noisy")
    await orchestrator.respond("a@example.com")
    assert log == []
    await orchestrator.respond("It squeaks")
    assert orchestrator.engine.stage.id == "resolution"
    assert of_type(events, "error") == []
    assert len(log) == 1
    context = log[0]
    assert (context.playbook_id, context.version) == ("spokesmith-support", "2.1.0")
    assert context.metadata == PLAYBOOK_METADATA
    assert context.stage_id == "resolution"
    assert context.stage_metadata == RESOLUTION_METADATA
    assert context.data == {"verifiedBy": "email"}  # authentication-verified's action data


# -- the playbook format ----------------------------------------------------------------------


def test_default_llm_config_is_read_in_llmrtc_spelling() -> None:
    spec = Playbook.model_validate(
        llmrtc_playbook(
            [stage("desk", llmConfig={"temperature": 0.1})],
            defaultLLMConfig={"model": "m-1", "temperature": 0.7, "maxTokens": 400, "topP": 0.5},
        )
    )
    assert spec.default_llm_config == LLMConfig(
        model="m-1", temperature=0.7, max_tokens=400, top_p=0.5
    )
    merged = spec.stage("desk").llm_config.merged_over(spec.default_llm_config)
    assert merged == LLMConfig(model="m-1", temperature=0.1, max_tokens=400, top_p=0.5)


def test_tool_choice_by_name_is_read_and_checked_against_the_stage(tmp_path: Path) -> None:
    lookup = definition("get_order", ORDER_ID, ["orderId"])
    spec = Playbook.model_validate(
        llmrtc_playbook([stage("desk", tools=[lookup], toolChoice={"name": "get_order"})])
    )
    assert spec.stage("desk").tool_choice == NamedToolChoice(tool_name="get_order")
    # the spec's own form still works
    spec = Playbook.model_validate(
        llmrtc_playbook(
            [stage("desk", tools=[lookup], toolChoice={"type": "tool", "toolName": "get_order"})]
        )
    )
    assert spec.stage("desk").tool_choice == NamedToolChoice(tool_name="get_order")

    tools_py = """
        from playbooks import tool

        @tool
        def get_order(order_id: str) -> str:
            return order_id
    """
    path = write(
        tmp_path,
        llmrtc_playbook(
            [
                stage("desk", tools=[lookup], toolChoice={"name": "get_order"}),
                stage("other", toolChoice={"name": "get_order"}),
            ]
        ),
        tools_py,
    )
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path, tmp_path / "tools.py")
    assert "stages[1].tool_choice.tool_name: tool 'get_order' is not offered in stage 'other'" in (
        str(caught.value)
    )


def test_a_custom_condition_without_a_function_name_is_refused(tmp_path: Path) -> None:
    """What JSON.stringify leaves of llmrtc's ``{type: 'custom', evaluate: fn}``."""
    data = llmrtc_playbook(
        [stage("a"), stage("b")],
        [
            {
                "id": "go",
                "from": "a",
                "condition": {"type": "custom"},
                "action": {"targetStage": "b"},
            }
        ],
    )
    with pytest.raises(ValidationError) as invalid:
        Playbook.model_validate(data)
    assert "a custom condition names its function" in str(invalid.value)
    with pytest.raises(PlaybookError) as caught:
        load_playbook(write(tmp_path, data))
    message = str(caught.value)
    assert "transitions[0].condition" in message
    assert 'a custom condition names its function: "evaluate"' in message
    assert "does not survive JSON" in message


def test_a_custom_condition_names_its_function_by_evaluate(tmp_path: Path) -> None:
    data = llmrtc_playbook(
        [stage("a"), stage("b")],
        [
            {
                "id": "go",
                "from": "a",
                "condition": {"type": "custom", "evaluate": "ready"},
                "action": {"targetStage": "b"},
            }
        ],
    )
    condition = Playbook.model_validate(data).transitions[0].condition
    assert isinstance(condition, CustomCondition)
    assert condition.function == "ready"
    path = write(tmp_path, data, "def ready(context):\n    return True\n")
    loaded = load_playbook(path, tmp_path / "tools.py")
    assert "ready" in loaded.functions

    with pytest.raises(PlaybookError) as caught:
        load_playbook(path, module(tmp_path, "def other(context): ..."))
    assert "transitions[0].condition.function: unknown function 'ready'" in str(caught.value)


@pytest.mark.parametrize(
    "hook", [{"code": "ctx => log(ctx)"}, ["log"], 3], ids=["object", "list", "number"]
)
def test_on_enter_that_is_not_a_function_name_is_refused(tmp_path: Path, hook: Any) -> None:
    data = llmrtc_playbook([stage("desk", onEnter=hook)])
    with pytest.raises(ValidationError) as invalid:
        Playbook.model_validate(data)
    assert "must name a function of the tools module" in str(invalid.value)
    with pytest.raises(PlaybookError) as caught:
        load_playbook(write(tmp_path, data))
    assert "must name a function of the tools module, not hold code" in str(caught.value)
    assert "stages[0]" in str(caught.value)


async def test_an_unknown_on_enter_function_is_refused_at_load_and_connect(
    tmp_path: Path,
) -> None:
    path = support_bot(tmp_path, onEnter="open_resolution_journal")
    expected = "stages[3].on_enter: unknown function 'open_resolution_journal'"
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path, SUPPORT_TOOLS)
    assert expected in str(caught.value)
    code, _, err = await vocable(
        "playbook", "check", "--connect", str(path), "--tools-module", str(SUPPORT_TOOLS)
    )
    assert code == 2
    assert expected in err


HOOKS_PY = """
    import asyncio

    ENTERED = []
    LEFT = []

    def explode(context):
        raise RuntimeError("boom")

    async def explode_later(context):
        await asyncio.sleep(0)
        raise RuntimeError("boom later")

    def note_exit(context):
        LEFT.append(context.stage_id)

    async def note_enter(context):
        ENTERED.append((context.stage_id, dict(context.stage_metadata), dict(context.data)))
"""


@pytest.mark.parametrize(
    ("hook", "message"),
    [("explode", "explode: boom"), ("explode_later", "explode_later: boom later")],
)
async def test_a_raising_on_enter_hook_is_an_error_event_and_the_conversation_goes_on(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient, hook: str, message: str
) -> None:
    data = llmrtc_playbook(
        [
            stage("start"),
            stage("middle", onEnter=hook, onExit="note_exit"),
            stage("end", onEnter="note_enter", metadata={"desk": "returns"}),
        ],
        [
            keyword("start-middle", "start", "middle", "onwards"),
            keyword("middle-end", "middle", "end", "onwards", ticket=7),
        ],
    )
    playbook = load_playbook(write(tmp_path, data, HOOKS_PY), tmp_path / "tools.py")
    orchestrator = PlaybookOrchestrator(playbook, client)
    events = record(orchestrator)
    llm.script(
        [
            Reply(content="Let us go onwards."),
            Reply(content="Onwards again."),
            Reply(content="Here we are."),
        ]
    )
    assert await orchestrator.respond("hello") == "Let us go onwards."
    assert orchestrator.engine.stage.id == "middle"
    assert await orchestrator.respond("and now?") == "Onwards again."
    assert await orchestrator.respond("good") == "Here we are."
    assert orchestrator.engine.stage.id == "end"
    await asyncio.sleep(0.05)  # an async hook runs as a task of its own

    errors = [(e["source"], e["message"]) for e in of_type(events, "error")]
    assert errors == [("hook", message)]
    module = playbook.functions["note_exit"].__globals__
    assert module["LEFT"] == ["middle"]
    assert module["ENTERED"] == [("end", {"desk": "returns"}, {"ticket": 7})]


# -- binding inline definitions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("properties", "required", "python", "where", "problem"),
    [
        pytest.param(
            {**ORDER_ID, "giftWrap": {"type": "boolean"}},
            ["orderId"],
            "def get_order(order_id: str) -> str:",
            "stages[0].tools[0].parameters.properties.giftWrap",
            "it takes no argument 'giftWrap'",
            id="an-argument-the-tool-lacks",
        ),
        pytest.param(
            ORDER_ID,
            ["orderId"],
            "def get_order(order_id: str, store_code: str) -> str:",
            "stages[0].tools[0].parameters",
            "it requires 'store_code', which is not defined here",
            id="a-required-argument-not-defined",
        ),
        pytest.param(
            {**ORDER_ID, "storeCode": {"type": "string"}},
            ["orderId"],
            "def get_order(order_id: str, store_code: str) -> str:",
            "stages[0].tools[0].parameters",
            "it requires 'store_code', which is optional here",
            id="a-required-argument-optional-here",
        ),
        pytest.param(
            {"orderId": {"type": "integer"}},
            ["orderId"],
            "def get_order(order_id: str) -> str:",
            "stages[0].tools[0].parameters.properties.orderId",
            "orderId is integer here, string there",
            id="a-type-mismatch",
        ),
        pytest.param(
            {**ORDER_ID, "amount": {"type": "number"}},
            ["orderId", "amount"],
            "def get_order(order_id: str, amount: int) -> str:",
            "stages[0].tools[0].parameters.properties.amount",
            "amount is number here, integer there",
            id="a-number-is-not-an-integer",
        ),
    ],
)
def test_a_definition_that_disagrees_with_its_python_tool_fails_naming_both(
    tmp_path: Path,
    properties: dict[str, Any],
    required: list[str],
    python: str,
    where: str,
    problem: str,
) -> None:
    tools_py = f"from playbooks import tool\n\n@tool\n{python}\n    return 'ok'\n"
    data = llmrtc_playbook([stage("desk", tools=[definition("get_order", properties, required)])])
    with pytest.raises(PlaybookError) as caught:
        load_playbook(write(tmp_path, data), module(tmp_path, tools_py, "shop_tools.py"))
    expected = (
        f"playbook.json: {where}: tool 'get_order' here and in the tools module shop_tools.py"
        f" disagree: {problem}"
    )
    assert expected in str(caught.value).splitlines()


async def test_an_inline_integer_binds_to_a_number_and_arguments_keep_their_python_names(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient
) -> None:
    tools_py = """
        from playbooks import tool

        @tool
        def issue_refund(order_id: str, amount: float, gift_note: str = "none") -> dict:
            return {"order_id": order_id, "amount": amount, "gift_note": gift_note}
    """
    refund = definition(
        "issue_refund",
        {**ORDER_ID, "amount": {"type": "integer", "minimum": 1}, "giftNote": {"type": "string"}},
        ["orderId", "amount"],
    )
    path = write(tmp_path, llmrtc_playbook([stage("desk", tools=[refund])]), tools_py)
    playbook = load_playbook(path, tmp_path / "tools.py")
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("issue_refund", {"orderId": "SC-1", "amount": 0})]),
            Reply(tool_calls=[ScriptedToolCall("issue_refund", {"orderId": "SC-1", "amount": 20})]),
            Reply(content="Refunded 20 pounds."),
        ]
    )
    orchestrator = PlaybookOrchestrator(playbook, client)
    assert await orchestrator.respond("refund please") == "Refunded 20 pounds."
    # the inline schema validates first: amount 0 is under its minimum, the tool never ran
    rejected = tool_results(llm.requests[1])["issue_refund"][0]
    assert "invalid arguments for 'issue_refund'" in rejected
    assert "amount" in rejected
    done = tool_results(llm.requests[2])["issue_refund"][1]
    assert json.loads(done) == {"order_id": "SC-1", "amount": 20, "gift_note": "none"}


def test_two_different_definitions_of_one_name_fail(tmp_path: Path) -> None:
    first = definition("get_order", ORDER_ID, ["orderId"])
    second = definition("get_order", {**ORDER_ID, "verbose": {"type": "boolean"}}, ["orderId"])
    data = llmrtc_playbook([stage("a", tools=[first]), stage("b", tools=[second])])
    with pytest.raises(PlaybookError) as caught:
        load_playbook(write(tmp_path, data))
    assert "stages[1].tools[0]: tool 'get_order' is defined differently at stages[0].tools[0]" in (
        str(caught.value)
    )


def test_identical_definitions_repeated_in_stages_and_global_tools_load(tmp_path: Path) -> None:
    lookup = definition("get_order", ORDER_ID, ["orderId"])
    data = llmrtc_playbook(
        [stage("a", tools=[lookup]), stage("b", tools=[copy.deepcopy(lookup)])],
        globalTools=[copy.deepcopy(lookup)],
    )
    tools_py = "from playbooks import tool\n\n@tool\ndef get_order(order_id: str) -> str:\n"
    loaded = load_playbook(write(tmp_path, data), module(tmp_path, tools_py + "    return ''"))
    assert list(loaded.tools) == ["get_order"]
    assert loaded.spec.stage("b").tool_names == ["get_order"]


def test_a_url_and_a_module_tool_of_the_same_name_fail(tmp_path: Path) -> None:
    """support_tools.py has get_order; giving its definitions a url too is ambiguous."""
    data = json.loads(SUPPORT_BOT.read_text())
    for found in _definitions(data):
        if found["name"] in ("get_order", "classify_issue"):
            found["url"] = NOWHERE
    path = write(tmp_path, data)
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path, SUPPORT_TOOLS)
    assert (
        "stages[2].tools[0].url: tool 'get_order' has a url and is also a tool of the tools module"
        " support_tools.py"
    ) in str(caught.value)


async def test_an_http_tool_answering_500_is_a_failed_call_the_llm_sees(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient, tool_server: ToolServer
) -> None:
    classify = {
        **definition("classify_issue", {"category": {"type": "string"}}, ["category"]),
        "url": f"{tool_server.base_url}/down",
        "headers": {"Authorization": "Bearer workshop-token"},
    }
    playbook = load_playbook(write(tmp_path, llmrtc_playbook([stage("desk", tools=[classify])])))
    orchestrator = PlaybookOrchestrator(playbook, client)
    events = record(orchestrator)
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("classify_issue", {"category": "late_delivery"})]),
            Reply(content="Sorry, our workshop system is down; I will note it by hand."),
            Reply(content="You are welcome."),
        ]
    )
    answer = await orchestrator.respond("My parcel is late")
    assert answer == "Sorry, our workshop system is down; I will note it by hand."
    assert tool_server.bodies == [{"category": "late_delivery"}]
    assert tool_server.headers[0]["Authorization"] == "Bearer workshop-token"
    result = json.loads(tool_results(llm.requests[1])["classify_issue"][0])
    assert "HTTP 500" in result["error"]
    assert "workshop system down" in result["error"]
    completed = of_type(events, "tool_call_complete")
    assert [c["error"] for c in completed] == [True]
    # and the conversation goes on
    assert await orchestrator.respond("Thanks") == "You are welcome."


CONTEXT_PY = """
    from playbooks import tool
    from playbooks.context import current_context

    @tool
    def whoami() -> dict:
        context = current_context()
        assert context is not None
        return {
            "playbook_id": context.playbook_id,
            "version": context.version,
            "metadata": dict(context.metadata),
            "stage_id": context.stage_id,
            "stage_metadata": dict(context.stage_metadata),
            "data": dict(context.data),
        }
"""


async def test_a_python_tool_reads_the_playbook_and_stage_from_current_context(
    tmp_path: Path, llm: ScriptedLLM, client: ChatClient
) -> None:
    whoami = {
        "name": "whoami",
        "description": "Where am I?",
        "parameters": {"type": "object", "properties": {}},
    }
    data = llmrtc_playbook(
        [stage("start"), stage("desk", tools=[whoami], metadata={"desk": "returns", "floor": 2})],
        [
            {
                "id": "to-desk",
                "from": "start",
                "condition": {"type": "keyword", "keywords": ["desk"]},
                "action": {"targetStage": "desk", "data": {"verifiedBy": "email"}},
            }
        ],
        version="0.3.1",
        metadata={"owner": "support-ops"},
    )
    playbook = load_playbook(write(tmp_path, data), module(tmp_path, textwrap.dedent(CONTEXT_PY)))
    assert current_context() is None  # outside a turn
    orchestrator = PlaybookOrchestrator(playbook, client)
    llm.script(
        [
            Reply(content="Let me take you to the desk."),
            Reply(tool_calls=[ScriptedToolCall("whoami")]),
            Reply(content="You are at the returns desk."),
        ]
    )
    await orchestrator.respond("hello")
    assert await orchestrator.respond("where am I?") == "You are at the returns desk."
    seen = json.loads(tool_results(llm.requests[2])["whoami"][0])
    assert seen == {
        "playbook_id": "desk",
        "version": "0.3.1",
        "metadata": {"owner": "support-ops"},
        "stage_id": "desk",
        "stage_metadata": {"desk": "returns", "floor": 2},
        "data": {"verifiedBy": "email"},
    }
