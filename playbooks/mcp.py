"""Tools of MCP servers (stdio or streamable HTTP) as playbook tools, with the official SDK.

Each distinct server gets one session per process, opened when a playbook naming it is loaded and
kept on a dedicated event-loop thread (so the synchronous loader can list tools, and any event
loop can call them); :func:`close_mcp_sessions` closes them all (also run at exit). A session
that is lost is reopened once per call: the call is retried only for read-only tools, since a
tool with side effects may have run before the connection broke.

An MCP tool becomes a :class:`~playbooks.tools.Tool`: its JSON Schema is shown to the LLM as is
and turned into a pydantic model that validates the LLM's arguments like a Python tool's; the
server's ``timeout_ms`` bounds each call; an ``isError`` result, an exception or a dead server
becomes a :class:`~playbooks.tools.ToolError`. Annotations give ``side_effects`` (False only for
``readOnlyHint``) and ``on_interrupt`` (``finish`` for ``destructiveHint``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import json
import re
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
from mcp import ClientSession, McpError, StdioServerParameters, stdio_client
from mcp import types as mcp_types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from .models import McpServer
from .schema import UNSET, arguments_model, plain
from .tools import Tool, ToolError, _strip_titles

__all__ = ["McpLoadError", "close_mcp_sessions", "mcp_tools"]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What chat-completions APIs accept as a function name."""
_LOST = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)


class McpLoadError(Exception):
    """A server that cannot be used at load: ``path`` is the playbook field, ``message`` why."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class _Loop:
    """One daemon thread running the event loop that owns every MCP session."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mcp", daemon=True).start()
                cls._loop = loop
            return cls._loop


class _Connection:
    """One server's session, living in a task of the MCP loop (anyio scopes need one task)."""

    def __init__(self, server: McpServer, cwd: Path) -> None:
        self.server = server
        self.cwd = cwd
        self._session: ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def timeout_s(self) -> float:
        return self.server.timeout_ms / 1000

    async def list_tools(self) -> list[mcp_types.Tool]:
        session = await self._ensure()
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        while True:
            page = await session.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.nextCursor
            if not cursor:
                return tools

    async def call(self, name: str, arguments: dict[str, Any], retry: bool) -> str:
        session = await self._ensure()
        try:
            return _result_text(name, await session.call_tool(name, arguments))
        except Exception as exc:
            if not _is_lost(exc):
                raise
        await self.close()
        if not retry:
            raise ToolError(
                f"tool {name!r} failed: lost the connection to MCP server {self.server.name!r}"
                " during the call; it may or may not have run"
            )
        session = await self._ensure()
        return _result_text(name, await session.call_tool(name, arguments))

    async def _ensure(self) -> ClientSession:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._session is not None and self._task is not None and not self._task.done():
                return self._session
            await self.close()
            ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._task = asyncio.create_task(self._run(ready, self._stop))
            try:
                async with asyncio.timeout(self.timeout_s):
                    self._session = await asyncio.shield(ready)
            except TimeoutError:
                await self.close()
                raise ToolError(
                    f"MCP server {self.server.name!r} did not answer within {self.timeout_s:g} s"
                ) from None
            except Exception as exc:
                await self.close()
                raise ToolError(
                    f"cannot connect to MCP server {self.server.name!r}: {_describe(exc)}"
                ) from None
            return self._session

    async def _run(self, ready: asyncio.Future[ClientSession], stop: asyncio.Event) -> None:
        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(stack))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                ready.set_result(session)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ToolError("cancelled"))
            if not isinstance(exc, Exception):
                raise

    def _transport(self, stack: AsyncExitStack) -> Any:
        server = self.server
        if server.command is not None:
            params = StdioServerParameters(
                command=server.command, args=server.args, env=server.env or None, cwd=self.cwd
            )
            return stdio_client(params)
        assert server.url is not None
        client = create_mcp_http_client(
            headers=server.headers or None, timeout=httpx.Timeout(self.timeout_s)
        )
        return _with_client(stack, client, server.url)

    async def close(self) -> None:
        """End the session (and a stdio server's process); it reopens on the next use."""
        task, stop = self._task, self._stop
        self._session = self._task = self._stop = None
        if task is None or stop is None:
            return
        stop.set()
        try:
            async with asyncio.timeout(5):
                await asyncio.gather(task, return_exceptions=True)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _with_client(stack: AsyncExitStack, client: httpx.AsyncClient, url: str) -> Any:
    stack.push_async_callback(client.aclose)

    class _Streams:
        async def __aenter__(self) -> tuple[Any, Any]:
            read, write, _ = await stack.enter_async_context(
                streamable_http_client(url, http_client=client)
            )
            return read, write

        async def __aexit__(self, *exc: object) -> None:
            return None

    return _Streams()


_connections: dict[str, _Connection] = {}
_connections_lock = threading.Lock()


def _connection(server: McpServer, cwd: Path) -> _Connection:
    key = json.dumps([server.model_dump(mode="json"), str(cwd)], sort_keys=True)
    with _connections_lock:
        found = _connections.get(key)
        if found is None:
            found = _connections[key] = _Connection(server, cwd)
        return found


def _on_loop(coroutine: Any, timeout: float | None = None) -> Any:
    """Run ``coroutine`` on the MCP loop from a thread that is not that loop's, and wait."""
    return asyncio.run_coroutine_threadsafe(coroutine, _Loop.get()).result(timeout)


def mcp_tools(servers: list[McpServer], cwd: Path) -> dict[str, dict[str, Tool]]:
    """Connect to each server (stdio commands run in ``cwd``) and build the tools it lists: by
    server name, the server's tools by tool name, only those its ``tools`` filter names (every
    one for ``all``).

    Raises :class:`McpLoadError` for a server that cannot be reached, a tool name asked for but
    not offered, or a name given twice.
    """
    tools: dict[str, Tool] = {}
    by_server: dict[str, dict[str, Tool]] = {}
    for i, server in enumerate(servers):
        where = f"mcp_servers[{i}]"
        if any(other.name == server.name for other in servers[:i]):
            raise McpLoadError(f"{where}.name", f"duplicate MCP server name {server.name!r}")
        connection = _connection(server, cwd)
        try:
            listed = _on_loop(connection.list_tools(), connection.timeout_s + 5)
        except ToolError as exc:
            raise McpLoadError(where, str(exc)) from None
        except Exception as exc:
            raise McpLoadError(
                where, f"MCP server {server.name!r} failed listing tools: {_describe(exc)}"
            ) from None
        by_name = {t.name: t for t in listed}
        if server.tools == "all":
            wanted = list(by_name)
        else:
            wanted = server.tools
            for j, name in enumerate(wanted):
                if name not in by_name:
                    offered = ", ".join(sorted(by_name)) or "none"
                    raise McpLoadError(
                        f"{where}.tools[{j}]",
                        f"MCP server {server.name!r} has no tool {name!r} (it offers: {offered})",
                    )
        taken: dict[str, Tool] = {}
        by_server[server.name] = taken
        for name in wanted:
            if not _TOOL_NAME.match(name):
                raise McpLoadError(where, f"MCP tool name {name!r} is not a valid function name")
            if name in tools:
                raise McpLoadError(where, f"tool {name!r} is offered by two MCP servers")
            tools[name] = taken[name] = _tool(connection, by_name[name])
    return by_server


def close_mcp_sessions() -> None:
    """Close every MCP session of this process (blocking); later calls reopen them."""
    loop = _Loop._loop
    if loop is None or not loop.is_running():
        return
    with _connections_lock:
        connections = list(_connections.values())

    async def close_all() -> None:
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)

    with contextlib.suppress(Exception):  # shutting down anyway
        _on_loop(close_all(), 10)


atexit.register(close_mcp_sessions)


def _tool(connection: _Connection, spec: mcp_types.Tool) -> Tool:
    hints = spec.annotations
    read_only = hints is not None and hints.readOnlyHint is True
    destructive = hints is not None and hints.destructiveHint is True and not read_only
    schema = copy.deepcopy(spec.inputSchema)
    _strip_titles(schema)
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    model, aliases = arguments_model(spec.name, schema)
    name = spec.name

    async def call(**arguments: Any) -> str:
        sent = {aliases[k]: plain(v) for k, v in arguments.items() if v is not UNSET}
        future = asyncio.run_coroutine_threadsafe(
            connection.call(name, sent, retry=read_only), _Loop.get()
        )
        result: str = await asyncio.wrap_future(future)
        return result

    return Tool(
        name=name,
        description=spec.description or spec.title or name,
        parameters=schema,
        function=call,
        timeout_s=connection.timeout_s,
        on_interrupt="finish" if destructive else "cancel",
        side_effects=not read_only,
        arguments_model=model,
    )


def _result_text(name: str, result: mcp_types.CallToolResult) -> str:
    parts: list[str] = []
    for item in result.content:
        if isinstance(item, mcp_types.TextContent):
            parts.append(item.text)
        else:
            parts.append(f"[{item.type} content]")
    text = "\n".join(parts)
    if not text and result.structuredContent is not None:
        text = json.dumps(result.structuredContent, ensure_ascii=False)
    if result.isError:
        raise ToolError(f"tool {name!r} failed: {text or 'error without a message'}")
    return text


def _is_lost(exc: BaseException) -> bool:
    if isinstance(exc, McpError):
        return exc.error.code == mcp_types.CONNECTION_CLOSED
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_lost(e) for e in exc.exceptions)
    return isinstance(exc, (*_LOST, httpx.TransportError))


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
