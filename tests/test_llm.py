"""The LLM client: retry classes and backoff, tool-call assembly, broken streams.

The real ``openai`` client talks to the scripted server; only the retry delays are injected.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from playbooks.llm import (
    ChatClient,
    ChatRequest,
    ChatStream,
    LLMError,
    RetryPolicy,
    StreamDelta,
    ToolCallRequest,
)
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import FakeSleep

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def client(llm: ScriptedLLM, sleeps: FakeSleep) -> AsyncIterator[ChatClient]:
    chat = ChatClient.connect(llm.base_url, None, "scripted", retry=RetryPolicy(sleep=sleeps))
    yield chat
    await chat.aclose()


def request(**kwargs: Any) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, model="scripted", **kwargs)


async def collect(stream: ChatStream) -> list[StreamDelta]:
    try:
        return [delta async for delta in stream]
    finally:
        await stream.aclose()


async def stream_text(client: ChatClient) -> str:
    deltas = await collect(await client.stream(request()))
    return "".join(delta.text for delta in deltas)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- retry classes and backoff ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_retryable_status_is_retried_with_exponential_backoff(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep, status: int
) -> None:
    llm.script([Reply(status=status)] * 3 + [Reply(content="finally here")])

    assert await stream_text(client) == "finally here"

    assert sleeps.delays == [1.0, 2.0, 4.0]
    assert len(llm.requests) == 4
    assert all(body["messages"] == MESSAGES for body in llm.requests)


async def test_mixed_retryable_failures_share_one_backoff_schedule(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=429), Reply(status=502), Reply(content="ok")])

    assert await stream_text(client) == "ok"

    assert sleeps.delays == [1.0, 2.0]
    assert len(llm.requests) == 3


async def test_retry_after_seconds_raises_the_delay_but_never_lowers_it(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script(
        [
            Reply(status=429, headers={"Retry-After": "3"}),  # backoff 1 s < 3 s
            Reply(status=503, headers={"Retry-After": "1"}),  # backoff 2 s > 1 s
            Reply(status=429, headers={"Retry-After": "7.5"}),  # backoff 4 s < 7.5 s
            Reply(content="ok"),
        ]
    )

    assert await stream_text(client) == "ok"

    assert sleeps.delays == [3.0, 2.0, 7.5]


async def test_retry_after_http_date_is_honoured(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    when = email.utils.formatdate(time.time() + 10, usegmt=True)
    llm.script([Reply(status=429, headers={"Retry-After": when}), Reply(content="ok")])

    assert await stream_text(client) == "ok"

    [delay] = sleeps.delays
    assert 8.0 <= delay <= 10.5  # the date has one-second resolution


@pytest.mark.parametrize("value", ["soon", "Thu, 99 Foo 2026 25:61:00 GMT", "-5"])
async def test_unparseable_or_negative_retry_after_falls_back_to_backoff(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep, value: str
) -> None:
    llm.script([Reply(status=503, headers={"Retry-After": value}), Reply(content="ok")])

    assert await stream_text(client) == "ok"

    assert sleeps.delays == [1.0]


@pytest.fixture
def local_time_not_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "EST+05")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("local_time_not_utc")
async def test_retry_after_http_date_without_zone_is_read_as_utc(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    when = email.utils.formatdate(time.time() + 10).rsplit(" ", 1)[0] + " -0000"
    llm.script([Reply(status=429, headers={"Retry-After": when}), Reply(content="ok")])

    assert await stream_text(client) == "ok"

    [delay] = sleeps.delays
    assert 8.0 <= delay <= 10.5


async def test_retry_after_is_capped_by_the_policy_maximum(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=429, headers={"Retry-After": "3600"}), Reply(content="ok")])

    assert await stream_text(client) == "ok"

    assert sleeps.delays == [RetryPolicy().max_delay_s]


@pytest.mark.parametrize("status", [400, 401, 403, 404])
async def test_client_errors_are_never_retried(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep, status: int
) -> None:
    llm.script([Reply(status=status), Reply(content="must not be asked for")])

    with pytest.raises(LLMError) as raised:
        await client.stream(request())

    assert raised.value.status == status
    assert str(status) in str(raised.value)
    assert len(llm.requests) == 1
    assert sleeps.delays == []


async def test_client_errors_are_never_retried_even_with_retry_after(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=400, headers={"Retry-After": "1"}), Reply(content="no")])

    with pytest.raises(LLMError):
        await client.stream(request())

    assert len(llm.requests) == 1
    assert sleeps.delays == []


async def test_exhausted_retries_raise_llm_error_with_the_last_status(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=500), Reply(status=500), Reply(status=500), Reply(status=503)])

    with pytest.raises(LLMError) as raised:
        await client.stream(request())

    assert raised.value.status == 503
    assert len(llm.requests) == 4  # the first attempt and three retries
    assert sleeps.delays == [1.0, 2.0, 4.0]


async def test_retry_count_and_base_delay_are_configurable(
    llm: ScriptedLLM, sleeps: FakeSleep
) -> None:
    policy = RetryPolicy(retries=1, base_delay_s=0.25, sleep=sleeps)
    client = ChatClient.connect(llm.base_url, None, "scripted", retry=policy)
    llm.script([Reply(status=500), Reply(status=500), Reply(content="never")])
    try:
        with pytest.raises(LLMError) as raised:
            await client.stream(request())
    finally:
        await client.aclose()

    assert raised.value.status == 500
    assert len(llm.requests) == 2
    assert sleeps.delays == [0.25]


async def test_no_retries_means_one_attempt(llm: ScriptedLLM, sleeps: FakeSleep) -> None:
    client = ChatClient.connect(
        llm.base_url, None, "scripted", retry=RetryPolicy(retries=0, sleep=sleeps)
    )
    llm.script([Reply(status=429), Reply(content="never")])
    try:
        with pytest.raises(LLMError) as raised:
            await client.stream(request())
    finally:
        await client.aclose()

    assert raised.value.status == 429
    assert len(llm.requests) == 1
    assert sleeps.delays == []


async def test_connection_refused_is_retried_then_raises(sleeps: FakeSleep) -> None:
    client = ChatClient.connect(
        f"http://127.0.0.1:{closed_port()}/v1", None, "scripted", retry=RetryPolicy(sleep=sleeps)
    )
    try:
        with pytest.raises(LLMError) as raised:
            await client.stream(request())
    finally:
        await client.aclose()

    assert raised.value.status is None
    assert sleeps.delays == [1.0, 2.0, 4.0]


async def test_connection_refused_then_recovering_server(
    llm: ScriptedLLM, sleeps: FakeSleep
) -> None:
    """A server that comes up during the backoff is reached by the next attempt."""
    port = closed_port()
    client = ChatClient.connect(
        f"http://127.0.0.1:{port}/v1", None, "scripted", retry=RetryPolicy(sleep=sleeps)
    )

    async def sleep_then_redirect(delay: float) -> None:
        sleeps.delays.append(delay)
        client.client.base_url = llm.base_url  # the endpoint is back (elsewhere)

    client.retry = RetryPolicy(sleep=sleep_then_redirect)
    llm.script([Reply(content="back")])
    try:
        assert await stream_text(client) == "back"
    finally:
        await client.aclose()

    assert sleeps.delays == [1.0]
    assert len(llm.requests) == 1


async def test_request_timeout_is_retried(llm: ScriptedLLM, sleeps: FakeSleep) -> None:
    client = ChatClient.connect(
        llm.base_url, None, "scripted", retry=RetryPolicy(sleep=sleeps), timeout_s=0.2
    )
    llm.script([Reply(hang=True), Reply(content="awake")])
    try:
        assert await stream_text(client) == "awake"
    finally:
        await client.aclose()

    assert sleeps.delays == [1.0]
    assert len(llm.requests) == 2


async def test_non_streamed_completion_is_retried_too(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=429, headers={"Retry-After": "2"}), Reply(content='{"a": 1}')])

    assert await client.complete(request()) == '{"a": 1}'

    assert sleeps.delays == [2.0]
    assert len(llm.requests) == 2
    assert not llm.requests[-1].get("stream")


async def test_non_streamed_client_error_is_not_retried(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(status=401), Reply(content="no")])

    with pytest.raises(LLMError) as raised:
        await client.complete(request())

    assert raised.value.status == 401
    assert len(llm.requests) == 1
    assert sleeps.delays == []


# -- requests --------------------------------------------------------------------------------------


async def test_request_body_carries_tools_choice_and_sampling(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    llm.script([Reply(content="ok")])

    await stream_text_with(
        client,
        request(tools=tools, tool_choice="required", temperature=0.2, max_tokens=50, top_p=0.9),
    )

    body = llm.last_request
    assert body["stream"] is True
    assert body["model"] == "scripted"
    assert body["messages"] == MESSAGES
    assert body["tools"] == tools
    assert body["tool_choice"] == "required"
    assert (body["temperature"], body["max_tokens"], body["top_p"]) == (0.2, 50, 0.9)


async def test_tool_choice_is_not_sent_without_tools(llm: ScriptedLLM, client: ChatClient) -> None:
    llm.script([Reply(content="ok")])

    await stream_text_with(client, request(tool_choice="auto"))

    body = llm.last_request
    assert "tools" not in body
    assert "tool_choice" not in body
    assert "temperature" not in body


async def stream_text_with(client: ChatClient, chat_request: ChatRequest) -> str:
    deltas = await collect(await client.stream(chat_request))
    return "".join(delta.text for delta in deltas)


# -- streamed rounds: content and tool calls -------------------------------------------------------


async def test_content_streams_as_text_deltas(llm: ScriptedLLM, client: ChatClient) -> None:
    llm.script([Reply(content="Your order shipped on Tuesday.")])

    stream = await client.stream(request())
    deltas = await collect(stream)

    assert [d.text for d in deltas] == ["Your", " order", " shipped", " on", " Tuesday."]
    assert not any(d.is_tool_call for d in deltas)
    assert stream.content == "Your order shipped on Tuesday."
    assert stream.tool_calls == []
    assert stream.finish_reason == "stop"
    assert stream.first_chunk_at is not None


async def test_tool_call_arguments_are_assembled_from_fragments(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    arguments = {"order_id": "A1002", "reason": "ordered the wrong colour by mistake"}
    llm.script(
        [
            Reply(
                tool_calls=[
                    ScriptedToolCall("lookup_order", {"order_id": "A1001"}, id="call_a"),
                    ScriptedToolCall("cancel_order", arguments, id="call_b"),
                ]
            )
        ]
    )

    stream = await client.stream(request())
    deltas = await collect(stream)

    # the scripted server sends arguments in 12-character fragments: many chunks per call
    assert len(json.dumps(arguments)) > 3 * 12
    assert deltas == [StreamDelta(is_tool_call=True)]  # announced once, never as text
    assert stream.tool_calls == [
        ToolCallRequest("call_a", "lookup_order", json.dumps({"order_id": "A1001"})),
        ToolCallRequest("call_b", "cancel_order", json.dumps(arguments)),
    ]
    assert stream.content == ""
    assert stream.finish_reason == "tool_calls"


async def test_interleaved_parallel_tool_calls_are_assembled_by_index(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    def fragment(index: int, **function: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": function}]}

    llm.script(
        [
            Reply(
                deltas=[
                    {"role": "assistant", "content": None},
                    {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "call_second",
                                "type": "function",
                                "function": {"name": "weather", "arguments": ""},
                            }
                        ]
                    },
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_first",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": '{"ke'},
                            }
                        ]
                    },
                    fragment(1, arguments='{"city": '),
                    fragment(0, arguments='y": "x'),
                    fragment(1, arguments='"Oslo"}'),
                    fragment(0, arguments='"}'),
                ]
            )
        ]
    )

    stream = await client.stream(request())
    deltas = await collect(stream)

    assert deltas == [StreamDelta(is_tool_call=True)]
    assert stream.tool_calls == [
        ToolCallRequest("call_first", "lookup", '{"key": "x"}'),
        ToolCallRequest("call_second", "weather", '{"city": "Oslo"}'),
    ]


async def test_tool_call_without_id_gets_a_stable_one(llm: ScriptedLLM, client: ChatClient) -> None:
    llm.script(
        [
            Reply(
                deltas=[
                    {"tool_calls": [{"index": 0, "function": {"name": "ping", "arguments": "{}"}}]}
                ]
            )
        ]
    )

    stream = await client.stream(request())
    await collect(stream)

    assert stream.tool_calls == [ToolCallRequest("call_0", "ping", "{}")]


async def test_content_around_tool_calls_is_reported_in_order(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    """The stream reports what arrived; the orchestrator decides what the user hears."""
    llm.script(
        [
            Reply(
                content="Let me check.",
                tool_calls=[ScriptedToolCall("lookup", {"key": "x"}, id="c1")],
                content_after_tools=" Done.",
            )
        ]
    )

    stream = await client.stream(request())
    deltas = await collect(stream)

    assert deltas == [
        StreamDelta(text="Let"),
        StreamDelta(text=" me"),
        StreamDelta(text=" check."),
        StreamDelta(is_tool_call=True),
        StreamDelta(text=" Done."),
    ]
    assert stream.content == "Let me check. Done."
    assert stream.tool_calls == [ToolCallRequest("c1", "lookup", '{"key": "x"}')]


# -- broken and abandoned streams ------------------------------------------------------------------


async def test_stream_cut_midway_raises_llm_error_and_is_not_replayed(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script(
        [
            Reply(content="one two three four five six", cut_after_chunks=3),
            Reply(content="must not be asked for"),
        ]
    )

    stream = await client.stream(request())
    received: list[str] = []

    async def read_all() -> None:
        async for delta in stream:
            received.append(delta.text)

    with pytest.raises(LLMError):
        await read_all()
    await stream.aclose()

    assert received == ["one", " two"]  # chunk 0 is the role; the cut follows chunk 2
    assert len(llm.requests) == 1  # text may have been spoken: a broken stream is not retried
    assert sleeps.delays == []


async def test_stream_cut_inside_tool_call_arguments_raises_llm_error(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    llm.script(
        [
            Reply(
                tool_calls=[ScriptedToolCall("lookup", {"key": "a rather long value here"})],
                cut_after_chunks=3,
            )
        ]
    )

    with pytest.raises(LLMError):
        await collect(await client.stream(request()))


async def test_stream_cut_before_the_first_chunk_is_retried(
    llm: ScriptedLLM, client: ChatClient, sleeps: FakeSleep
) -> None:
    llm.script([Reply(content="lost", cut_after_chunks=0), Reply(content="second try")])

    assert await stream_text(client) == "second try"

    assert len(llm.requests) == 2
    assert sleeps.delays == [1.0]


async def test_closing_a_stream_early_abandons_it_on_the_server(
    llm: ScriptedLLM, client: ChatClient
) -> None:
    llm.script([Reply(content="a b c d e f g h i j k l m n o p", chunk_delay_s=0.05)])

    stream = await client.stream(request())
    async for delta in stream:
        assert delta.text == "a"
        break
    await stream.aclose()

    await asyncio.wait_for(llm.stream_abandoned.wait(), timeout=3)
    assert llm.streams_abandoned == 1
    assert llm.streams_completed == 0
