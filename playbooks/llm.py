"""Chat completions through the ``openai`` client: streaming rounds, tool-call assembly, retries.

Works with any OpenAI-compatible endpoint (OpenAI, Ollama, vLLM, llama.cpp's server, ...).
Retries cover opening a stream up to its first chunk; a stream that fails later raises
:class:`LLMError` (its text may already have been spoken, so it cannot be replayed).
A stream's text passes through :class:`~playbooks.markup.MarkupFilter`: only prose is yielded,
and a tool call the model wrote as text counts as a tool call when it fits a tool offered.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
from openai import AsyncOpenAI

from .forced_calls import forced_call_format
from .markup import MarkupFilter, TextToolCall
from .schema import arguments_problem

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

    def __init__(
        self, message: str, *, status: int | None = None, context_overflow: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.context_overflow = context_overflow
        """When the request outgrew the model's context: the share of it that fits (1.0 when
        the endpoint does not say); None otherwise."""


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
    response_format: dict[str, Any] | None = None
    """The answer's form (``{"type": "json_schema", ...}``), for a non-streamed completion."""

    def create_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "messages": self.messages}
        if self.tools:
            kwargs["tools"] = self.tools
            if self.tool_choice is not None:
                kwargs["tool_choice"] = self.tool_choice
        for name in ("temperature", "max_tokens", "top_p", "response_format"):
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

    The text deltas are the speakable text only (see :mod:`playbooks.markup`); a tool call the
    model wrote as text, naming one of ``tools`` (the request's tool definitions) with arguments
    that fit its ``parameters``, is a tool call like those of the API (id ``call_text_<n>``);
    any other is dropped and logged. The first tool call, either way, is announced by one
    ``StreamDelta(is_tool_call=True)``, after the text written before it.

    Always close it (``aclose``), also when abandoning it early: that closes the HTTP stream.
    """

    def __init__(
        self,
        chunks: AsyncIterator[Any],
        closer: Callable[[], Awaitable[None]],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self._chunks = chunks
        self._close = closer
        self._offered = _parameters_by_name(tools)
        self._parts: dict[int, _ToolCallParts] = {}
        self._text_calls: list[ToolCallRequest] = []
        self._markup = MarkupFilter()
        self._raw: list[str] = []
        self._content: list[str] = []
        self._spoken = 0
        self._announced = False
        self.finish_reason: str | None = None
        self.first_chunk_at: float | None = None
        self._deltas = self._generate()

    @property
    def content(self) -> str:
        """The speakable text yielded so far."""
        return "".join(self._content)

    @property
    def raw_content(self) -> str:
        """What the model wrote, markup included (for logs)."""
        return "".join(self._raw)

    @property
    def tool_calls(self) -> list[ToolCallRequest]:
        """The API's tool calls, then those written as text that were accepted."""
        api_calls = [
            ToolCallRequest(
                id=parts.id or f"call_{index}", name=parts.name, arguments="".join(parts.arguments)
            )
            for index, parts in sorted(self._parts.items())
        ]
        return api_calls + self._text_calls

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
            out: list[StreamDelta] = []
            self._speak(self._markup.finish(), out)
            for delta in out:
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
                self._announce_tool_call(out)
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
                self._raw.append(delta.content)
                self._speak(self._markup.push(delta.content), out)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        return out

    def _speak(self, text: str, out: list[StreamDelta]) -> None:
        """Yield ``text`` (what the filter released), and the tool calls written within it at
        their places."""
        for call in self._markup.take_tool_calls():
            cut = min(max(call.at - self._spoken, 0), len(text))
            self._say(text[:cut], out)
            text = text[cut:]
            self._adopt(call, out)
        self._say(text, out)

    def _say(self, text: str, out: list[StreamDelta]) -> None:
        if text:
            self._content.append(text)
            self._spoken += len(text)
            out.append(StreamDelta(text=text))

    def _adopt(self, call: TextToolCall, out: list[StreamDelta]) -> None:
        """Make a tool call written as text a real one, if it fits a tool offered."""
        if not self._offered:
            problem: str | None = "no tools were offered"
        elif call.name not in self._offered:
            problem = f"no tool {call.name!r} was offered"
        else:
            problem = arguments_problem(call.arguments, self._offered[call.name])
        if problem is not None:
            log.warning("dropped a tool call written as text (%s): %.160r", problem, call.markup)
            return
        self._text_calls.append(
            ToolCallRequest(
                id=f"call_text_{len(self._text_calls)}",
                name=call.name,
                arguments=json.dumps(call.arguments, ensure_ascii=False),
            )
        )
        log.info("a tool call written as text is run: %s", call.name)
        self._announce_tool_call(out)

    def _announce_tool_call(self, out: list[StreamDelta]) -> None:
        if not self._announced:
            self._announced = True
            out.append(StreamDelta(is_tool_call=True))


class ChatClient:
    """Chat completions with retries, against one OpenAI-compatible endpoint."""

    def __init__(
        self,
        client: AsyncOpenAI,
        model: str,
        retry: RetryPolicy | None = None,
        *,
        constrain_forced_calls: bool = False,
        prefills: bool = False,
    ) -> None:
        self.client = client
        self.prefills = prefills
        """The endpoint keeps the prompts it has seen (llama.cpp's prompt cache), so
        :meth:`prefill` is worth its cost."""
        self.model = model
        self.retry = retry or RetryPolicy()
        self.constrain_forced_calls = constrain_forced_calls
        """Send a forced ``tool_choice`` as a JSON schema too (see
        :mod:`playbooks.forced_calls`), for servers that do not enforce it (llama.cpp's)."""

    @classmethod
    def connect(
        cls,
        base_url: str | None,
        api_key: str | None,
        model: str,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        *,
        constrain_forced_calls: bool = False,
        prefills: bool = False,
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
        return cls(
            client,
            model,
            retry,
            constrain_forced_calls=constrain_forced_calls,
            prefills=prefills,
        )

    async def aclose(self) -> None:
        """Close the connections to the endpoint (idempotent)."""
        await self.client.close()

    async def stream(self, request: ChatRequest) -> ChatStream:
        """Open a streamed round; retried per the policy until its first chunk arrives."""

        async def attempt() -> ChatStream:
            kwargs = request.create_kwargs()
            if self.constrain_forced_calls:
                forced = forced_call_format(request.tools, request.tool_choice)
                if forced is not None:
                    kwargs["response_format"] = forced
            raw = await self.client.chat.completions.create(**kwargs, stream=True)
            iterator = aiter(raw)
            try:
                first = await anext(iterator)
            except StopAsyncIteration:
                return ChatStream(_empty(), raw.close, request.tools)
            except BaseException:
                await raw.close()
                raise
            return ChatStream(_prepend(first, iterator), raw.close, request.tools)

        return await self._with_retries(attempt)

    async def prefill(self, request: ChatRequest) -> None:
        """Have the endpoint read ``request``'s prompt (and generate one token), so that it
        keeps it cached for the requests that start the same way; failures are only logged.
        Costs the prompt's tokens: for endpoints that keep prompts (``prefills``)."""
        kwargs = {**request.create_kwargs(), "max_tokens": 1}
        kwargs.pop("tool_choice", None)
        try:
            await self.client.chat.completions.create(**kwargs)
        except openai.APIError as exc:
            log.debug("prefilling the prompt failed: %s", _describe(exc))

    async def first_token_odds(self, request: ChatRequest, top: int = 10) -> dict[str, float]:
        """The probabilities of the likeliest first tokens of the answer to ``request``
        (stripped and lower-cased, summed over spellings); empty when the endpoint gives none
        (not every OpenAI-compatible server returns ``logprobs``)."""

        async def attempt() -> dict[str, float]:
            kwargs = {**request.create_kwargs(), "max_tokens": 1}
            response = await self.client.chat.completions.create(
                **kwargs, logprobs=True, top_logprobs=top
            )
            choice = response.choices[0] if response.choices else None
            tokens = choice.logprobs.content if choice and choice.logprobs else None
            odds: dict[str, float] = {}
            for candidate in tokens[0].top_logprobs if tokens else []:
                word = candidate.token.strip().lower()
                odds[word] = odds.get(word, 0.0) + math.exp(candidate.logprob)
            return odds

        return await self._with_retries(attempt)

    async def complete(self, request: ChatRequest) -> str:
        """A non-streamed completion's text, unfiltered (used for intent classification, which
        expects JSON)."""

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
                    overflow = _context_overflow(exc)
                    raise LLMError(
                        _describe(exc), status=status, context_overflow=overflow
                    ) from exc
                delay = self.retry.delay_s(n, _retry_after_s(exc))
                log.warning(
                    "LLM call failed (%s); retry %d in %.1f s", _describe(exc), n + 1, delay
                )
                await self.retry.sleep(delay)
        raise AssertionError("unreachable")


def _parameters_by_name(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The JSON-schema ``parameters`` of each function tool in a request's ``tools``."""
    offered: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            offered[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return offered


def _retryable(exc: openai.APIError) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return status not in _NEVER_RETRIED and (status == 429 or status == 408 or status >= 500)
    return False


_OVERFLOW_WORDS = re.compile(r"context (length|size|window)|too many tokens|maximum context", re.I)


def _context_overflow(exc: openai.APIError) -> float | None:
    """For a request refused because it does not fit the model's context (llama.cpp's
    ``exceed_context_size_error``, OpenAI's ``context_length_exceeded``, vLLM's message): the
    share of the request that fits; None for any other error."""
    if not isinstance(exc, openai.BadRequestError):
        return None
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    error = error if isinstance(error, dict) else {}
    kind = f"{error.get('type', '')} {error.get('code', '')}"
    named = "exceed_context" in kind or "context_length" in kind
    if not named and not _OVERFLOW_WORDS.search(str(error.get("message") or exc.message)):
        return None
    prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")
    if isinstance(prompt, int) and isinstance(context, int) and prompt > 0:
        return min(1.0, context / prompt)
    return 1.0


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
