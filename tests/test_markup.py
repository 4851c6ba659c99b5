"""Nothing a model writes as markup is spoken: the filter over every form and every split, then
the same forms through the real ``openai`` client (the scripted LLM) and the orchestrator.

A tool call written as text that names a tool of the stage with valid arguments runs as a tool;
any other is dropped. Plain prose is never held back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from playbooks import (
    ChatClient,
    ChatRequest,
    LoadedPlaybook,
    OrchestratorOptions,
    PlaybookOrchestrator,
    Retraction,
    RetryPolicy,
    load_playbook,
)
from playbooks.llm import ChatStream, StreamDelta
from playbooks.markup import MarkupFilter
from playbooks.schema import arguments_problem
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import FakeSleep

Call = tuple[str, dict[str, Any]]
PARIS: Call = ("get_weather", {"city": "Paris"})


@dataclass(frozen=True)
class Form:
    """Something a model writes; what of it is speech, and the tool calls written in it."""

    id: str
    written: str
    spoken: str
    calls: list[Call] = field(default_factory=list)


TOOL_CALL_FORMS = [
    Form(
        "bare-json",
        'Let me check. {"name": "get_weather", "arguments": {"city": "Paris"}}',
        "Let me check. ",
        [PARIS],
    ),
    Form(
        "parameters-as-string",
        '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}',
        "",
        [PARIS],
    ),
    Form(
        "hermes-tag",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [PARIS],
    ),
    Form(
        "hermes-tag-fenced",
        '<TOOL_CALL>```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
        "</tool_call>",
        "",
        [PARIS],
    ),
    Form(
        "hermes-tag-unclosed",
        'One moment. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "One moment. ",
        [PARIS],
    ),
    Form(
        "generic-tool-call",
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
        "",
        [PARIS],
    ),
    Form(
        "generic-tool-calls",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]}',
        "",
        [PARIS, ("get_time", {})],
    ),
    Form(
        "function",
        '{"type": "function", "function": {"name": "get_weather", '
        '"arguments": "{\\"city\\": \\"Paris\\"}"}}',
        "",
        [PARIS],
    ),
    Form(
        "function-name",
        '{"function": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [PARIS],
    ),
    Form(
        "fenced-json",
        'Checking.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "Checking.\n",
        [PARIS],
    ),
    Form(
        "list",
        '[ {"name": "get_weather", "arguments": {"city": "Paris"}} ]',
        "",
        [PARIS],
    ),
]
"""Each writes a call of ``get_weather`` (some also of ``get_time``) and no speech after it."""

SPEECH_FORMS = [
    Form(
        "think",
        '<think>The user wants {"city": "Paris"}; 3 < 5.</think>\n\nIt is sunny.',
        "It is sunny.",
    ),
    Form("thinking", "<Thinking>hmm `x` {</thinking> It is sunny.", "It is sunny."),
    Form("reasoning", "It is <reasoning>sunny?</reasoning> sunny.", "It is sunny."),
    Form("think-unclosed", "It is sunny. <think>but maybe it rains", "It is sunny. "),
    Form("stray-closing-tag", "</think>It is sunny.", "It is sunny."),
    Form("response", '{"response": "It is sunny."}', "It is sunny."),
    Form("response-after-text", 'Well. {"response": "It is sunny."}', "Well. It is sunny."),
    Form(
        "code-fence",
        'It is sunny.\n```python\nprint("{hi}")\n```\nEnjoy.',
        "It is sunny.\nEnjoy.",
    ),
    Form("code-fence-unclosed", "It is sunny. ```bash\nrm -rf /", "It is sunny. "),
    Form(
        "other-json",
        'It is {"temp": [21, {"unit": "C \\" }"}], "ok": true} sunny.',
        "It is sunny.",
    ),
    Form("json-unfinished", 'It is sunny. {"name": "get_weather", "argu', "It is sunny. "),
    Form(
        "tool-response-echoed",
        '<tool_response>\n{"forecast": "sunny"}\n</tool_response>\nIt is sunny.',
        "It is sunny.",
    ),
    Form("tools-echoed", "<tools>[get_weather]</tools>It is sunny.", "It is sunny."),
    Form("control-tokens", "It is sunny.<|im_end|><|im_start|>", "It is sunny."),
    Form(
        "tool-call-invalid-arguments",
        'It is sunny. {"name": "get_weather", "arguments": "not json"}',
        "It is sunny. ",
    ),
]
"""Markup that is not a tool call: dropped, or (``response``) spoken as its text."""

PROSE_FORMS = [
    Form("less-than", 'Yes: 3 < 5 and 7 > 2. {"x": 1}', "Yes: 3 < 5 and 7 > 2. "),
    Form(
        "unknown-tags",
        "a <b>bold</b> <thought> <toolbox> <t<think>x</think>",
        "a <b>bold</b> <thought> <toolbox> <t",
    ),
    Form(
        "braces-and-brackets",
        "Use { this }, {that}, [brackets], [{x}] and {} <think>no</think>",
        "Use { this }, {that}, [brackets], [{x}] and {} ",
    ),
    Form("backticks", "Type `ls` or ``cd``. ```\nls\n```", "Type `ls` or ``cd``. "),
    Form("ends-held", "<think>x</think>Count: 1 < 2 <th", "Count: 1 < 2 <th"),
    Form("ends-with-brace", "<think>x</think>Open with {", "Open with {"),
    Form("ends-with-bracket", "<think>x</think>Open with [ ", "Open with [ "),
    Form("ends-with-ticks", "<think>x</think>Two ``", "Two ``"),
]
"""Prose with ``<``, ``{``, ``[`` and backticks that open no markup, next to markup that does."""

FORMS = TOOL_CALL_FORMS + SPEECH_FORMS + PROSE_FORMS


def run(pieces: list[str]) -> tuple[str, list[Call]]:
    markup = MarkupFilter()
    spoken = "".join(markup.push(piece) for piece in pieces) + markup.finish()
    return spoken, [(call.name, call.arguments) for call in markup.take_tool_calls()]


def cut(text: str, at: list[int]) -> list[str]:
    bounds = [0, *sorted(set(at)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# -- the filter --------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS, ids=[f.id for f in FORMS])
def test_every_form_split_at_every_boundary(form: Form) -> None:
    assert run([form.written]) == (form.spoken, form.calls)
    assert run(list(form.written)) == (form.spoken, form.calls)
    for at in range(len(form.written) + 1):
        assert run(cut(form.written, [at])) == (form.spoken, form.calls), at


CLOSED_FORMS = [f for f in FORMS if "unclosed" not in f.id and "unfinished" not in f.id]
"""The forms after which more may follow (an unclosed one runs to the end of the round)."""
WHOLE = "".join(f"{form.written} " for form in CLOSED_FORMS)


@given(st.lists(st.integers(min_value=0, max_value=len(WHOLE)), max_size=80))
@settings(max_examples=200, deadline=None)
def test_all_forms_in_one_round_under_any_split(at: list[int]) -> None:
    spoken, calls = run(cut(WHOLE, at))

    assert calls == [call for form in CLOSED_FORMS for call in form.calls]
    assert spoken == run([WHOLE])[0]
    for marker in ("think", "reasoning", "tool_call", "```", '"name"', "get_weather", "print"):
        assert marker not in spoken.lower()
    assert "It is sunny." in spoken
    assert "Yes: 3 < 5 and 7 > 2." in spoken


PROSE = st.text(st.characters(exclude_characters="{[<`", exclude_categories=["Cs"]), min_size=1)


@given(st.lists(PROSE, min_size=1, max_size=20))
@settings(max_examples=200, deadline=None)
def test_plain_prose_is_released_as_it_arrives(deltas: list[str]) -> None:
    markup = MarkupFilter()
    assert [markup.push(delta) for delta in deltas] == deltas
    assert [markup.push(delta) for delta in ["<think>", "hidden", "</think>"]] == ["", "", ""]
    assert markup.finish() == ""


@pytest.mark.parametrize(
    ("deltas", "released"),
    [
        (["3 ", "<", " 5"], ["3 ", "", "< 5"]),
        (["a ", "<", "t", "h", "e", "n"], ["a ", "", "", "", "<the", "n"]),
        (["x ", "<", "/", "b>"], ["x ", "", "", "</b>"]),
        (["x ", "{", " ", "y"], ["x ", "", "", "{ y"]),
        (["x ", "[", "{", "1"], ["x ", "", "", "[{1"]),
        (["use ", "`", "`", "x"], ["use ", "", "", "``x"]),
        (["ok ", "{", '"a', '": 1', "} ", "end"], ["ok ", "", "", "", "", "end"]),
        (["ok <th", "ink>x</think> fine"], ["ok ", "fine"]),
    ],
)
def test_a_possible_opener_is_held_only_until_it_is_known(
    deltas: list[str], released: list[str]
) -> None:
    markup = MarkupFilter()
    assert [markup.push(delta) for delta in deltas] == released
    assert markup.finish() == ""


def test_tool_calls_say_where_they_were_written() -> None:
    markup = MarkupFilter()
    text = markup.push('Hi. {"name": "a", "arguments": {}} and <tool_call>{"name": "b", ')
    text += markup.push('"arguments": {}}</tool_call>bye')
    assert text == "Hi. and bye"
    assert [(c.name, c.at) for c in markup.take_tool_calls()] == [("a", 4), ("b", 8)]
    assert markup.take_tool_calls() == []


def test_what_is_dropped_is_logged_on_one_line_truncated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="playbooks.markup")
    long_thought = "<think>" + "ponder\n" * 200 + "</think>Hi."
    assert run([long_thought, ' {"weird": "json"} ```sh\nls\n``` <think>open'])[0] == "Hi. "

    records = [r for r in caplog.records if r.name == "playbooks.markup"]
    messages = [r.getMessage() for r in records]
    assert len(records) == 4, messages
    assert all("\n" not in m and len(m) < 250 for m in messages)
    assert "reasoning block" in messages[0]
    assert "ponder" in messages[0]
    assert "weird" in messages[1]
    assert "code block" in messages[2]
    assert "unclosed reasoning block" in messages[3]
    assert records[3].levelno == logging.WARNING


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "number"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"city": "Paris"}, None),
        ({"city": "Paris", "days": 2, "metric": True, "hours": [1, 2.5], "note": None}, None),
        ({"city": "Paris", "unit": "C", "note": "hi", "days": 3.0}, None),
        # what the tool itself would take, it takes here too ("yes" is a boolean to pydantic)
        ({"city": "Paris", "metric": "yes", "hours": ["1"]}, None),
        ({}, "arguments.city: Field required"),
        ({"city": 3}, "arguments.city: Input should be a valid string"),
        ({"city": "Paris", "days": 1.5}, "arguments.days: Input should be a valid integer"),
        ({"city": "Paris", "metric": "maybe"}, "arguments.metric: Input should be a valid boolean"),
        ({"city": "Paris", "hours": ["x"]}, "arguments.hours[0]: Input should be a valid number"),
        ({"city": "Paris", "note": 1}, "arguments.note: Input should be a valid string"),
        ({"city": "Paris", "unit": "K"}, "arguments.unit: Input should be 'C' or 'F'"),
        ({"city": "Paris", "country": "FR"}, "arguments.country: Extra inputs are not permitted"),
        (["Paris"], "arguments: must be an object"),
    ],
)
def test_text_tool_calls_are_checked_as_the_tool_checks_its_arguments(
    arguments: object, problem: str | None
) -> None:
    found = arguments_problem(arguments, SCHEMA)
    assert found == problem if problem is None else (found or "").startswith(problem), found


# -- through the openai client ---------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }
    for name, properties in [("get_weather", {"city": {"type": "string"}}), ("get_time", {})]
]


def chunks(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture
async def client(llm: ScriptedLLM, sleeps: FakeSleep) -> AsyncIterator[ChatClient]:
    chat = ChatClient.connect(llm.base_url, None, "scripted", retry=RetryPolicy(sleep=sleeps))
    yield chat
    await chat.aclose()


async def read(
    client: ChatClient, tools: list[dict[str, Any]] | None = TOOLS
) -> tuple[list[StreamDelta], ChatStream]:
    stream = await client.stream(
        ChatRequest(messages=[{"role": "user", "content": "weather?"}], model="m", tools=tools)
    )
    try:
        return [delta async for delta in stream], stream
    finally:
        await stream.aclose()


@pytest.mark.parametrize("form", TOOL_CALL_FORMS, ids=[f.id for f in TOOL_CALL_FORMS])
async def test_a_text_tool_call_of_an_offered_tool_becomes_a_tool_call(
    llm: ScriptedLLM, client: ChatClient, form: Form
) -> None:
    llm.script([Reply(content=chunks(form.written))])

    deltas, stream = await read(client)

    assert "".join(d.text for d in deltas) == form.spoken == stream.content
    assert [d.is_tool_call for d in deltas if d.is_tool_call] == [True]
    assert deltas[-1].is_tool_call  # after the text written before it
    assert [(c.id, c.name, json.loads(c.arguments)) for c in stream.tool_calls] == [
        (f"call_text_{n}", name, arguments) for n, (name, arguments) in enumerate(form.calls)
    ]
    assert stream.raw_content == form.written


@pytest.mark.parametrize("form", SPEECH_FORMS + PROSE_FORMS, ids=lambda f: f.id)
async def test_only_speech_is_streamed(llm: ScriptedLLM, client: ChatClient, form: Form) -> None:
    llm.script([Reply(content=chunks(form.written, 2))])

    deltas, stream = await read(client)

    assert "".join(d.text for d in deltas) == form.spoken == stream.content
    assert not any(d.is_tool_call for d in deltas)
    assert stream.tool_calls == []
    assert stream.raw_content == form.written


@pytest.mark.parametrize(
    ("written", "tools", "why"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, "no tools were offered"),
        ('{"name": "get_stock", "arguments": {"city": "Paris"}}', TOOLS, "no tool 'get_stock'"),
        ('{"name": "get_weather", "arguments": {}}', TOOLS, "arguments.city: Field required"),
        ('{"name": "get_weather", "arguments": {"city": 7}}', TOOLS, "valid string"),
        (
            '{"name": "get_time", "arguments": {"tz": "UTC"}}',
            TOOLS,
            "tz: Extra inputs are not permitted",
        ),
        ('{"name": "get_weather", "arguments": ["Paris"]}', TOOLS, "dropped JSON"),
    ],
)
async def test_a_text_tool_call_that_fits_no_offered_tool_is_dropped(
    llm: ScriptedLLM,
    client: ChatClient,
    caplog: pytest.LogCaptureFixture,
    written: str,
    tools: list[dict[str, Any]] | None,
    why: str,
) -> None:
    caplog.set_level(logging.INFO)
    llm.script([Reply(content=["Sure. ", *chunks(written), " Done."])])

    deltas, stream = await read(client, tools)

    assert "".join(d.text for d in deltas) == "Sure. Done." == stream.content
    assert not any(d.is_tool_call for d in deltas)
    assert stream.tool_calls == []
    assert any(why in record.getMessage() for record in caplog.records), caplog.text


async def test_api_and_text_tool_calls_are_announced_once(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    llm.script(
        [
            Reply(
                content=["<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"],
                tool_calls=[ScriptedToolCall("get_weather", {"city": "Oslo"}, id="api_1")],
            )
        ]
    )

    deltas, stream = await read(client)

    assert deltas == [StreamDelta(is_tool_call=True)]
    assert [(c.id, c.name) for c in stream.tool_calls] == [
        ("api_1", "get_weather"),
        ("call_text_0", "get_time"),
    ]
    assert stream.content == ""


async def test_text_held_at_the_end_is_yielded_before_the_stream_ends(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    llm.script([Reply(content=["<think>x</think>", "Is 1 ", "<", "t"])])

    deltas, stream = await read(client)

    assert [d.text for d in deltas] == ["Is 1 ", "<t"]
    assert stream.content == "Is 1 <t"


async def test_barge_in_inside_markup_closes_the_stream(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    """The consumer is cancelled while the filter holds a reasoning block: the stream closes."""
    thinking = ["<think>", *["thinking "] * 200, "</think>", "Never said."]
    llm.script([Reply(content=["<think>plan</think>", "Hello. ", *thinking], chunk_delay_s=0.01)])
    stream = await client.stream(ChatRequest(messages=[], model="m"))
    heard: list[StreamDelta] = []
    first = asyncio.Event()

    async def consume() -> None:
        try:
            async for delta in stream:
                heard.append(delta)
                first.set()
        finally:
            await stream.aclose()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(5):
        await first.wait()
        await asyncio.sleep(0.1)  # well inside the second block
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await llm.stream_abandoned.wait()

    assert heard == [StreamDelta(text="Hello. ")]
    assert stream.content == "Hello. "
    assert stream.raw_content.startswith("<think>plan</think>Hello. <think>thinking")


async def test_complete_is_not_filtered(llm: ScriptedLLM, client: ChatClient) -> None:
    """Intent classification expects JSON back."""
    written = '{"intent": "weather", "confidence": 0.9}'
    llm.script([Reply(content=[written])])

    assert await client.complete(ChatRequest(messages=[], model="m")) == written


# -- through the orchestrator ----------------------------------------------------------------------

TOOLS_PY = """
from playbooks import tool


@tool
def get_weather(city: str) -> str:
    \"\"\"The weather in a city.

    Args:
        city: The city.
    \"\"\"
    return f"RAN get_weather: sunny in {city}"


@tool
def get_time() -> str:
    \"\"\"The time.\"\"\"
    return "RAN get_time: noon"


@tool
def hidden(city: str) -> str:
    \"\"\"Offered in no stage.\"\"\"
    return "RAN hidden"
"""

PLAYBOOK_YAML = """
id: markup
name: Markup
initial_stage: main
tools_module: tools.py
global_system_prompt: You help.
stages:
  - id: main
    name: Main
    system_prompt: Answer about the weather.
    tools: [get_weather, get_time]
"""

MARKUP_SIGNS = ("{", "}", "<", ">", "`", "get_weather", "think", "argu")


@pytest.fixture
def orchestrator(write_playbook: Callable[..., Path], client: ChatClient) -> PlaybookOrchestrator:
    playbook: LoadedPlaybook = load_playbook(write_playbook(PLAYBOOK_YAML, TOOLS_PY))
    return PlaybookOrchestrator(playbook, client, OrchestratorOptions())


async def turn_items(orchestrator: PlaybookOrchestrator) -> tuple[list[str | Retraction], str]:
    async with orchestrator.turn("what is the weather in Paris?") as turn:
        items = [item async for item in turn]
    return items, turn.answer


def said(items: list[str | Retraction]) -> str:
    return "".join(item for item in items if isinstance(item, str))


@pytest.mark.parametrize("form", SPEECH_FORMS, ids=lambda f: f.id)
async def test_the_answer_carries_no_markup(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, form: Form
) -> None:
    llm.script([Reply(content=chunks(form.written)), Reply(content="Fallback answer.")])

    items, answer = await turn_items(orchestrator)

    assert not any(sign in said(items) for sign in MARKUP_SIGNS), items
    assert answer.strip() == form.spoken.strip()
    assert "sunny" in answer
    assert len(llm.requests) == 1


@pytest.mark.parametrize("form", TOOL_CALL_FORMS, ids=lambda f: f.id)
async def test_a_text_tool_call_runs_the_tool(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, form: Form
) -> None:
    llm.script([Reply(content=chunks(form.written)), Reply(content="It is sunny in Paris.")])

    items, answer = await turn_items(orchestrator)

    assert answer == "It is sunny in Paris."
    assert not any(sign in said(items) for sign in MARKUP_SIGNS), items
    assert items[-1] == " Paris."
    assert len(llm.requests) == 2
    messages = llm.requests[1]["messages"]
    asked = next(m for m in messages if m.get("tool_calls"))
    assert [c["id"] for c in asked["tool_calls"]] == [
        f"call_text_{n}" for n in range(len(form.calls))
    ]
    results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    assert results["call_text_0"] == "RAN get_weather: sunny in Paris"
    if len(form.calls) > 1:
        assert results["call_text_1"] == "RAN get_time: noon"


@pytest.mark.parametrize(
    "written",
    [
        '{"name": "hidden", "arguments": {"city": "Paris"}}',
        '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>',
        '{"tool_call": {"name": "get_weather", "arguments": {"city": ["Paris"]}}}',
    ],
    ids=["tool-not-offered", "unknown-argument", "wrong-type"],
)
async def test_an_invalid_text_tool_call_is_neither_run_nor_spoken(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator, written: str
) -> None:
    llm.script(
        [
            Reply(content=["I will look. ", *chunks(written), " Sorry, no data."]),
            Reply(content="Not reached."),
        ]
    )

    items, answer = await turn_items(orchestrator)

    assert answer == "I will look. Sorry, no data."
    assert not any(sign in said(items) for sign in MARKUP_SIGNS), items
    assert len(llm.requests) == 1
    assert "RAN" not in json.dumps(orchestrator.conversation.messages)


async def test_a_round_of_only_an_invalid_call_is_followed_by_an_answer_round(
    llm: ScriptedLLM, orchestrator: PlaybookOrchestrator
) -> None:
    llm.script(
        [
            Reply(content=chunks('{"name": "hidden", "arguments": {"city": "Paris"}}')),
            Reply(
                content=chunks('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>Noon.')
            ),
        ]
    )

    items, answer = await turn_items(orchestrator)

    assert answer == "Noon."  # the answer round offers no tools: its text call is not run
    assert said(items) == "Noon."
    assert "tools" not in llm.requests[1]
    assert not any(m["role"] == "tool" for m in llm.requests[1]["messages"])
