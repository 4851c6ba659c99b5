"""A scripted OpenAI-compatible chat-completions server: the LLM of deterministic test runs.

It speaks the real wire format (SSE streaming with content and tool-call deltas, non-streamed
completions with the first token's logprobs when asked, error statuses with Retry-After) on
127.0.0.1, so the real ``openai`` client code path runs. Every request body is recorded;
streams the client abandons are counted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from server.testkit.loopback import LoopbackServer

__all__ = ["Reply", "ScriptedLLM", "ScriptedToolCall", "answers_by_words"]


@dataclass(frozen=True)
class ScriptedToolCall:
    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None

    @property
    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments)


@dataclass(frozen=True)
class Reply:
    """One scripted response.

    ``content`` streams first (split into word tokens unless given as a list of chunks), then the
    tool calls, then ``content_after_tools``. ``status`` other than 200 answers with an OpenAI-style
    error body. ``hang`` never answers (until the client gives up or the server closes).
    ``cut_after_chunks`` drops the connection mid-stream; ``stall_after_chunks`` stops sending
    mid-stream but keeps the connection open (until the client gives up). ``deltas``, when
    given, replaces all of the above for a streamed reply: each dict is sent verbatim as one
    chunk's ``delta`` (for shapes the other fields cannot express, such as interleaved parallel
    tool-call fragments).
    """

    content: str | list[str] = ""
    tool_calls: list[ScriptedToolCall] = field(default_factory=list)
    content_after_tools: str | list[str] = ""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    first_token_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    hang: bool = False
    cut_after_chunks: int | None = None
    stall_after_chunks: int | None = None
    deltas: list[dict[str, Any]] | None = None
    error: dict[str, Any] | None = None
    """With ``status``: the error object sent, as a server words it (e.g. llama.cpp's
    ``{"code": 503, "message": "Loading model", "type": "unavailable_error"}``)."""


ReplySource = Iterable[Reply] | Callable[[dict[str, Any]], Reply]

NO_INTENT = Reply(content='{"intent": "none", "confidence": 0.1}')


def answers_by_words(
    answers: dict[str, Reply | str], otherwise: Reply | str
) -> Callable[[dict[str, Any]], Reply]:
    """A reply source for voice calls, where requests started early on part of the caller's
    words may be undone: each streamed request is answered by the first key (a lowercase word or
    prefix) found in its last message, else ``otherwise``; non-streamed intent checks get "none".
    """

    def reply(body: dict[str, Any]) -> Reply:
        if not body.get("stream"):
            return NO_INTENT
        last = str(body["messages"][-1]["content"]).lower()
        chosen = next((r for key, r in answers.items() if key in last), otherwise)
        return chosen if isinstance(chosen, Reply) else Reply(content=chosen)

    return reply


class ScriptedLLM(LoopbackServer):
    """``async with ScriptedLLM([...]) as llm:`` then point a client at ``llm.base_url``."""

    def __init__(self, replies: ReplySource = ()) -> None:
        super().__init__()
        self._source = replies if callable(replies) else iter(list(replies))
        self.requests: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        """``time.monotonic()`` when each of ``requests`` arrived."""
        self.streams_abandoned = 0
        self.stream_abandoned = asyncio.Event()
        self.streams_completed = 0
        """Streams sent to the end (``[DONE]`` written)."""
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)

    def script(self, replies: ReplySource) -> None:
        """Replace the remaining replies (or the function choosing a reply per request body)."""
        self._source = replies if callable(replies) else iter(list(replies))

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``http://127.0.0.1:PORT/v1``) once started."""
        return f"{self.origin}/v1"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)

    async def start(self) -> str:
        """Serve on a free port; returns :attr:`base_url`."""
        await super().start()
        return self.base_url

    async def close(self) -> None:
        self._closing.set()  # streams still open end now
        await super().close()

    async def _models(self, request: web.Request) -> web.Response:
        """The model list local servers answer (what Vocable's search for one asks)."""
        return web.json_response(
            {"object": "list", "data": [{"id": "scripted", "object": "model"}]}
        )

    @property
    def last_request(self) -> dict[str, Any]:
        return self.requests[-1]

    @property
    def user_turns(self) -> list[str]:
        """The last user message of each streamed request: what the LLM was asked to answer."""
        return [str(r["messages"][-1]["content"]) for r in self.requests if r.get("stream")]

    def _next_reply(self, body: dict[str, Any]) -> Reply | None:
        if callable(self._source):
            return self._source(body)
        return next(self._source, None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.received_at.append(time.monotonic())
        reply = self._next_reply(body)
        if reply is None:
            return _error(400, "the scripted LLM has no reply left for this request", {})
        if reply.hang:
            await self._wait(request, None)
            return _error(504, "the scripted LLM hung up", {})
        if reply.status != 200 and reply.error is not None:
            return web.json_response(
                {"error": reply.error}, status=reply.status, headers=reply.headers
            )
        if reply.status != 200:
            return _error(reply.status, f"scripted status {reply.status}", reply.headers)
        if reply.first_token_delay_s and not await self._wait(request, reply.first_token_delay_s):
            return _error(504, "the client left before the first token", {})
        if body.get("stream"):
            return await self._stream(request, body, reply)
        return web.json_response(self._completion(body, reply))

    async def _wait(self, request: web.Request, seconds: float | None) -> bool:
        """Sleep ``seconds`` (None: forever); False early if the client left or the server
        closes, so an abandoned request does not hold up the server's shutdown."""
        loop = asyncio.get_running_loop()
        until = None if seconds is None else loop.time() + seconds
        while not self._closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return False
            if until is not None and loop.time() >= until:
                return True
            step = 0.02 if until is None else min(0.02, until - loop.time())
            await asyncio.sleep(max(step, 0))
        return False

    async def _stream(
        self, request: web.Request, body: dict[str, Any], reply: Reply
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk_id = f"chatcmpl-{next(self._ids)}"
        model = body.get("model", "scripted")
        deltas = list(self._deltas(reply))
        # the role-only opening chunk goes out with the first token, as a real server's does:
        # ``first_token_delay_s`` is the time to the first token, ``chunk_delay_s`` the time
        # between tokens
        paced_from = 1 if reply.deltas is None else 0
        try:
            for n, (delta, finish) in enumerate(deltas):
                if reply.cut_after_chunks is not None and n >= reply.cut_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if reply.stall_after_chunks is not None and n >= reply.stall_after_chunks:
                    await self._wait(request, None)
                    raise ConnectionResetError
                if n > paced_from and reply.chunk_delay_s:
                    await asyncio.sleep(reply.chunk_delay_s)
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError
                chunk = {
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            self.streams_completed += 1
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self.streams_abandoned += 1
            self.stream_abandoned.set()
        return response

    def _deltas(self, reply: Reply) -> Iterable[tuple[dict[str, Any], str | None]]:
        if reply.deltas is not None:
            for delta in reply.deltas:
                yield delta, None
            yield {}, "tool_calls" if any("tool_calls" in d for d in reply.deltas) else "stop"
            return
        yield {"role": "assistant", "content": ""}, None
        for token in _tokens(reply.content):
            yield {"content": token}, None
        for index, call in enumerate(reply.tool_calls):
            call_id = call.id or f"call_{next(self._ids)}"
            yield (
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                },
                None,
            )
            arguments = call.arguments_json
            for start in range(0, len(arguments), 12):
                yield (
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "function": {"arguments": arguments[start : start + 12]},
                            }
                        ]
                    },
                    None,
                )
        for token in _tokens(reply.content_after_tools):
            yield {"content": token}, None
        yield {}, "tool_calls" if reply.tool_calls else "stop"

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        text = "".join(_tokens(reply.content))
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_{next(self._ids)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json},
                }
                for call in reply.tool_calls
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if reply.tool_calls else "stop",
        }
        tokens = _tokens(reply.content)
        if body.get("logprobs") and tokens:  # the first token, certain (yes-or-no questions)
            first = {"token": tokens[0], "logprob": 0.0, "bytes": None}
            choice["logprobs"] = {"content": [{**first, "top_logprobs": [first]}]}
        return {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "scripted"),
            "choices": [choice],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


def _tokens(content: str | list[str]) -> list[str]:
    if isinstance(content, list):
        return content
    return re.findall(r"\s*\S+", content)


def _error(status: int, message: str, headers: dict[str, str]) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "scripted_error", "code": status}},
        status=status,
        headers=headers,
    )
