"""Tools: schema from type hints and docstrings, argument validation, sync/async calls, timeouts."""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from playbooks import Tool, ToolError, tool
from playbooks.tools import DEFAULT_TOOL_TIMEOUT_S, tool_of


def as_tool(function: Callable[..., Any]) -> Tool:
    found = tool_of(function)
    assert found is not None, f"{function.__name__} is not a @tool"
    return found


def keys_named(schema: Any, key: str) -> list[Any]:
    """Every value stored under ``key`` in the schema, except property names themselves."""
    found: list[Any] = []
    if isinstance(schema, dict):
        for name, value in schema.items():
            if name == key:
                found.append(value)
            if name == "properties" and isinstance(value, dict):
                for prop in value.values():
                    found.extend(keys_named(prop, key))
            else:
                found.extend(keys_named(value, key))
    elif isinstance(schema, list):
        for item in schema:
            found.extend(keys_named(item, key))
    return found


class Address(BaseModel):
    street: str
    city: str = "Springfield"


@tool
def book_table(
    day: str,
    guests: int,
    name: str = "guest",
    vip: bool | None = None,
    seating: Literal["inside", "terrace"] = "inside",
    budget: float = 50.0,
    requests: list[str] | None = None,
    title: str = "",
    address: Address | None = None,
) -> dict[str, Any]:
    """Book a table for a party.

    This line is detail for humans, not part of the summary.

    Args:
        day: Day of the week,
            like friday.
        guests (int): Number of guests.
        name: Name for the booking.
        seating: Where to sit.
        title: How to address the guest.

    Returns:
        The booking.

    Raises:
        ValueError: never.
    """
    return {"day": day, "guests": guests}


def test_schema_from_type_hints_and_docstring() -> None:
    schema = as_tool(book_table).openai_schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "book_table"
    assert function["description"] == "Book a table for a party."
    parameters = function["parameters"]
    assert parameters["type"] == "object"
    assert parameters["additionalProperties"] is False
    assert parameters["required"] == ["day", "guests"]
    props = parameters["properties"]
    assert list(props) == [
        "day",
        "guests",
        "name",
        "vip",
        "seating",
        "budget",
        "requests",
        "title",
        "address",
    ]
    assert props["day"] == {"type": "string", "description": "Day of the week, like friday."}
    assert props["guests"] == {"type": "integer", "description": "Number of guests."}
    assert props["name"] == {
        "type": "string",
        "default": "guest",
        "description": "Name for the booking.",
    }
    assert props["vip"] == {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None}
    assert props["seating"] == {
        "type": "string",
        "enum": ["inside", "terrace"],
        "default": "inside",
        "description": "Where to sit.",
    }
    assert props["budget"] == {"type": "number", "default": 50.0}
    assert props["requests"] == {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
        "default": None,
    }
    assert props["title"] == {
        "type": "string",
        "default": "",
        "description": "How to address the guest.",
    }
    assert "Returns" not in json.dumps(parameters)
    assert "never" not in json.dumps(parameters), "the Raises section is not an argument"


def test_schema_has_no_pydantic_titles() -> None:
    parameters = as_tool(book_table).parameters
    assert keys_named(parameters, "title") == []
    assert "title" in parameters["properties"], "a parameter called title survives"
    address = parameters["$defs"]["Address"]
    assert address["required"] == ["street"]
    assert set(address["properties"]) == {"street", "city"}


def test_title_keys_in_default_values_are_kept() -> None:
    def label(
        names: dict[str, str] = {"title": "Dr"},  # noqa: B006
        mode: Literal["title", "plain"] = "title",
    ) -> str:
        return "ok"

    props = Tool.from_function(label).parameters["properties"]
    assert props["names"]["default"] == {"title": "Dr"}
    assert props["mode"]["enum"] == ["title", "plain"]
    assert props["mode"]["default"] == "title"


def test_schema_of_an_undocumented_untyped_function() -> None:
    def anything(x, y=3):  # type: ignore[no-untyped-def]
        return x

    made = Tool.from_function(anything)
    assert made.name == "anything"
    assert made.description == ""
    assert made.parameters["required"] == ["x"]
    assert made.parameters["properties"] == {"x": {}, "y": {"default": 3}}


def test_variadic_parameters_are_not_in_the_schema() -> None:
    def flexible(query: str, *args: str, **kwargs: str) -> str:
        """Search."""
        return query

    made = Tool.from_function(flexible)
    assert list(made.parameters["properties"]) == ["query"]


def test_multi_line_summary_is_joined() -> None:
    def lookup(order_id: str) -> str:
        """Look up an order
        by its number.

        Args:
            order_id: The number.
        """
        return order_id

    assert Tool.from_function(lookup).description == "Look up an order by its number."


def test_continuation_lines_with_a_colon_belong_to_the_argument_above() -> None:
    def remind(time: str, note: str) -> str:
        """Set a reminder.

        Args:
            time: Time of day.
                Format: HH:MM, like 19:30.
            note: What to say.
        """
        return note

    props = Tool.from_function(remind).parameters["properties"]
    assert props["time"]["description"] == "Time of day. Format: HH:MM, like 19:30."
    assert props["note"]["description"] == "What to say."


def test_decorator_options_and_the_function_stays_callable() -> None:
    @tool(name="find", description="Find a thing.", timeout_s=2.5)
    def search(query: str) -> str:
        """Ignored summary."""
        return query.upper()

    found = as_tool(search)
    assert (found.name, found.description, found.timeout_s) == ("find", "Find a thing.", 2.5)
    assert found.openai_schema()["function"]["name"] == "find"
    assert search("abc") == "ABC", "the decorated function is returned unchanged"
    assert as_tool(book_table).timeout_s == DEFAULT_TOOL_TIMEOUT_S == 30.0


def test_plain_function_is_not_a_tool() -> None:
    def helper() -> None:
        return None

    assert tool_of(helper) is None
    assert tool_of(42) is None


# -- arguments -------------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def tool(self) -> Tool:
        def order(order_id: str, quantity: int, gift: bool = False) -> str:
            """Order something.

            Args:
                order_id: Which.
                quantity: How many.
                gift: Wrap it.
            """
            self.calls.append({"order_id": order_id, "quantity": quantity, "gift": gift})
            return "ok"

        return Tool.from_function(order)


async def test_valid_arguments_reach_the_function_with_defaults() -> None:
    recorder = Recorder()
    result = await recorder.tool().call('{"order_id": "A1", "quantity": 2}')
    assert result == "ok"
    assert recorder.calls == [{"order_id": "A1", "quantity": 2, "gift": False}]


async def test_validated_values_are_converted() -> None:
    received: list[Any] = []

    async def ship(address: Address, when: datetime.date) -> str:
        received.extend([address, when])
        return "shipped"

    made = Tool.from_function(ship)
    await made.call('{"address": {"street": "Main St"}, "when": "2024-05-01"}')
    assert received == [Address(street="Main St", city="Springfield"), datetime.date(2024, 5, 1)]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ("{not json", "arguments for 'order' are not valid JSON"),
        ("[1, 2]", "arguments for 'order' must be a JSON object"),
        ('"A1"', "arguments for 'order' must be a JSON object"),
        (
            '{"order_id": "A1", "quantity": "many"}',
            "invalid arguments for 'order': quantity: Input should be a valid integer",
        ),
        (
            '{"order_id": 7, "quantity": 1}',
            "invalid arguments for 'order': order_id: Input should be a valid string",
        ),
        (
            '{"order_id": "A1", "quantity": 1.5}',
            "invalid arguments for 'order': quantity: Input should be a valid integer",
        ),
        ('{"order_id": "A1"}', "invalid arguments for 'order': quantity: Field required"),
        (
            "{}",
            "invalid arguments for 'order': order_id: Field required; quantity: Field required",
        ),
        ("", "invalid arguments for 'order': order_id: Field required"),
        (
            '{"order_id": "A1", "quantity": 1, "colour": "red"}',
            "invalid arguments for 'order': colour: Extra inputs are not permitted",
        ),
    ],
)
async def test_invalid_arguments_are_rejected_before_the_call(
    arguments: str, expected: str
) -> None:
    recorder = Recorder()
    with pytest.raises(ToolError) as caught:
        await recorder.tool().call(arguments)
    assert str(caught.value).startswith(expected)
    assert recorder.calls == [], "the function must not run with invalid arguments"


async def test_no_arguments_for_a_tool_without_parameters() -> None:
    def now() -> str:
        """The time."""
        return "noon"

    made = Tool.from_function(now)
    assert await made.call("") == "noon"
    assert await made.call("{}") == "noon"
    assert made.parameters["properties"] == {}
    assert "required" not in made.parameters


# -- running ---------------------------------------------------------------------------------------


async def test_sync_tool_runs_in_a_worker_thread() -> None:
    threads: list[int] = []

    def where() -> str:
        threads.append(threading.get_ident())
        return "done"

    assert await Tool.from_function(where).call("{}") == "done"
    assert len(threads) == 1
    assert threads[0] != threading.get_ident()


async def test_async_tool_runs_on_the_event_loop() -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    async def where() -> str:
        seen.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return "done"

    assert await Tool.from_function(where).call("{}") == "done"
    assert seen == [asyncio.get_running_loop()]


async def test_sync_tools_do_not_block_the_loop() -> None:
    release = threading.Event()

    def wait_for_release() -> str:
        return "released" if release.wait(timeout=2) else "stuck"

    task = asyncio.create_task(Tool.from_function(wait_for_release).call("{}"))
    await asyncio.sleep(0.01)
    release.set()  # only possible because the loop is still running
    assert await asyncio.wait_for(task, 1) == "released"


async def test_async_tool_times_out() -> None:
    async def slow() -> str:
        await asyncio.sleep(10)
        return "late"

    made = Tool.from_function(slow, timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(ToolError) as caught:
        await made.call("{}")
    assert time.monotonic() - started < 1
    assert str(caught.value) == "tool 'slow' timed out after 0.05 s"


async def test_sync_tool_times_out() -> None:
    release = threading.Event()

    def stuck() -> str:
        release.wait(timeout=2)
        return "late"

    made = Tool.from_function(stuck, timeout_s=0.05)
    started = time.monotonic()
    try:
        with pytest.raises(ToolError, match=r"^tool 'stuck' timed out after 0\.05 s$"):
            await made.call("{}")
        assert time.monotonic() - started < 1
    finally:
        release.set()  # let the worker thread finish


async def test_timeout_from_the_decorator() -> None:
    @tool(timeout_s=0.05)
    async def dawdle() -> None:
        await asyncio.sleep(10)

    with pytest.raises(ToolError, match="timed out"):
        await as_tool(dawdle).call("{}")


@pytest.mark.parametrize("is_async", [False, True])
async def test_raising_tool_gives_a_tool_error_with_the_exception_text(is_async: bool) -> None:
    def broken_sync(order_id: str) -> str:
        raise LookupError(f"no order {order_id} in the database")

    async def broken_async(order_id: str) -> str:
        raise LookupError(f"no order {order_id} in the database")

    made = Tool.from_function(broken_async if is_async else broken_sync, name="lookup")
    with pytest.raises(ToolError) as caught:
        await made.call('{"order_id": "A9"}')
    assert str(caught.value) == "tool 'lookup' failed: LookupError: no order A9 in the database"
    assert isinstance(caught.value.__cause__, LookupError)


async def test_tool_error_raised_by_the_tool_passes_through() -> None:
    def picky() -> str:
        raise ToolError("ask the caller for the order number first")

    with pytest.raises(ToolError) as caught:
        await Tool.from_function(picky).call("{}")
    assert str(caught.value) == "ask the caller for the order number first"


async def test_cancellation_propagates() -> None:
    started = asyncio.Event()

    async def forever() -> str:
        started.set()
        await asyncio.sleep(10)
        return "never"

    task = asyncio.create_task(Tool.from_function(forever).call("{}"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class Booking(BaseModel):
    reference: str
    guests: int


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("plain text", "plain text"),
        ("", ""),
        ({"found": True, "items": ["kettle"]}, '{"found": true, "items": ["kettle"]}'),
        ([1, 2], "[1, 2]"),
        (42, "42"),
        (None, "null"),
        (True, "true"),
        ({"city": "Zürich"}, '{"city": "Zürich"}'),
        ({"when": datetime.date(2024, 5, 1)}, '{"when": "2024-05-01"}'),
        (Booking(reference="T1", guests=2), '{"reference":"T1","guests":2}'),
    ],
)
@pytest.mark.parametrize("is_async", [False, True])
async def test_results_are_serialised_to_json_text(value: Any, text: str, is_async: bool) -> None:
    def sync_result() -> Any:
        return value

    async def async_result() -> Any:
        return value

    made = Tool.from_function(async_result if is_async else sync_result)
    result = await made.call("{}")
    assert isinstance(result, str)
    assert result == text
