"""Chat completions through the ``openai`` client: streaming rounds, tool-call assembly, retries.

Works with any OpenAI-compatible endpoint (OpenAI, Ollama, vLLM, llama.cpp's server, ...).
Retries cover opening a stream up to its first chunk; a stream that fails later raises
:class:`LLMError` (its text may already have been spoken, so it cannot be replayed).
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
from openai import AsyncOpenAI

__all__ = [
    "ChatClient",
    "ChatRequest",
    "ChatStream",
    "LLMError",
    "RetryPolicy",
    "StreamDelta",
    "ToolCallRequest",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_NEVER_RETRIED = frozenset({400, 401, 403, 404})


class LLMError(Exception):
    """The LLM endpoint failed and retrying did not help (or could not)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` attempts after the first, waiting ``base_delay_s * 2**n`` (or Retry-After)."""

    retries: int = 3
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def delay_s(self, attempt: int, retry_after_s: float | None) -> float:
        backoff: float = self.base_delay_s * (2.0**attempt)
        if retry_after_s is not None:
            backoff = max(backoff, retry_after_s)
        return min(backoff, self.max_delay_s)


@dataclass(frozen=True)
class ToolCallRequest:
    id: str
    name: str
    arguments: str

    def to_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    model: str
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None

    def create_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "messages": self.messages}
        if self.tools:
            kwargs["tools"] = self.tools
            if self.tool_choice is not None:
                kwargs["tool_choice"] = self.tool_choice
        for name in ("temperature", "max_tokens", "top_p"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


@dataclass(frozen=True)
class StreamDelta:
    """Either answer text, or the news that the round carries tool calls (first such delta only)."""

    text: str = ""
    is_tool_call: bool = False


@dataclass
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ChatStream:
    """One streamed round. Iterate for deltas; afterwards read ``content`` and ``tool_calls``.

    Always close it (``aclose``), also when abandoning it early: that closes the HTTP stream.
    """

    def __init__(self, chunks: AsyncIterator[Any], closer: Callable[[], Awaitable[None]]) -> None:
        self._chunks = chunks
        self._close = closer
        self._parts: dict[int, _ToolCallParts] = {}
        self._content: list[str] = []
        self.finish_reason: str | None = None
        self.first_chunk_at: float | None = None
        self._deltas = self._generate()

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def tool_calls(self) -> list[ToolCallRequest]:
        return [
            ToolCallRequest(
                id=parts.id or f"call_{index}", name=parts.name, arguments="".join(parts.arguments)
            )
            for index, parts in sorted(self._parts.items())
        ]

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._deltas

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()
            await self._close()
        except Exception:  # closing a broken stream must not mask the original problem
            log.debug("closing the LLM stream failed", exc_info=True)

    async def _generate(self) -> AsyncGenerator[StreamDelta, None]:
        try:
            async for chunk in self._chunks:
                if self.first_chunk_at is None:
                    self.first_chunk_at = time.monotonic()
                for delta in self._absorb(chunk):
                    yield delta
        except openai.APIError as exc:
            raise LLMError(f"LLM stream failed: {_describe(exc)}") from exc

    def _absorb(self, chunk: Any) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        for choice in chunk.choices or ():
            if choice.index not in (0, None):
                continue
            delta = choice.delta
            if delta is not None and delta.tool_calls:
                if not self._parts:
                    out.append(StreamDelta(is_tool_call=True))
                for call in delta.tool_calls:
                    parts = self._parts.setdefault(call.index, _ToolCallParts())
                    if call.id:
                        parts.id = call.id
                    if call.function is not None:
                        if call.function.name:
                            parts.name += call.function.name
                        if call.function.arguments:
                            parts.arguments.append(call.function.arguments)
            if delta is not None and delta.content:
                self._content.append(delta.content)
                out.append(StreamDelta(text=delta.content))
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        return out


class ChatClient:
    """Chat completions with retries, against one OpenAI-compatible endpoint."""

    def __init__(self, client: AsyncOpenAI, model: str, retry: RetryPolicy | None = None) -> None:
        self.client = client
        self.model = model
        self.retry = retry or RetryPolicy()

    @classmethod
    def connect(
        cls,
        base_url: str | None,
        api_key: str | None,
        model: str,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
    ) -> ChatClient:
        """A client for ``base_url`` (OpenAI when None); local servers need no real key."""
        client = AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "not-needed",
            max_retries=0,  # retries are ours: one policy, injectable delays
            timeout=timeout_s,
        )
        # the client imports its chat resources on first use (~40-60 ms): here, not in the
        # first caller's turn
        _ = client.chat.completions
        return cls(client, model, retry)

    async def stream(self, request: ChatRequest) -> ChatStream:
        """Open a streamed round; retried per the policy until its first chunk arrives."""

        async def attempt() -> ChatStream:
            raw = await self.client.chat.completions.create(**request.create_kwargs(), stream=True)
            iterator = aiter(raw)
            try:
                first = await anext(iterator)
            except StopAsyncIteration:
                return ChatStream(_empty(), raw.close)
            except BaseException:
                await raw.close()
                raise
            return ChatStream(_prepend(first, iterator), raw.close)

        return await self._with_retries(attempt)

    async def complete(self, request: ChatRequest) -> str:
        """A non-streamed completion's text (used for intent classification)."""

        async def attempt() -> str:
            response = await self.client.chat.completions.create(**request.create_kwargs())
            return (response.choices[0].message.content or "") if response.choices else ""

        return await self._with_retries(attempt)

    async def _with_retries(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        for n in range(self.retry.retries + 1):
            try:
                return await attempt()
            except openai.APIError as exc:
                status = getattr(exc, "status_code", None)
                if not _retryable(exc) or n == self.retry.retries:
                    raise LLMError(_describe(exc), status=status) from exc
                delay = self.retry.delay_s(n, _retry_after_s(exc))
                log.warning(
                    "LLM call failed (%s); retry %d in %.1f s", _describe(exc), n + 1, delay
                )
                await self.retry.sleep(delay)
        raise AssertionError("unreachable")


def _retryable(exc: openai.APIError) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return status not in _NEVER_RETRIED and (status == 429 or status == 408 or status >= 500)
    return False


def _retry_after_s(exc: openai.APIError) -> float | None:
    response = getattr(exc, "response", None)
    if response is None:
        return None
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # an HTTP date
        parsed = email.utils.parsedate_to_datetime(value)
    except (ValueError, TypeError):
        log.debug("ignoring unparseable Retry-After %r", value)
        return None
    if parsed.tzinfo is None:  # "-0000": UTC, of unknown origin (RFC 5322)
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return max(0.0, parsed.timestamp() - time.time())


def _describe(exc: openai.APIError) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "request timed out"
    if isinstance(exc, openai.APIConnectionError):
        return "cannot connect to the LLM endpoint"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    return str(exc) or type(exc).__name__


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover - makes this an async generator
