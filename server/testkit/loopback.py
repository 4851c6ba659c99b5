"""Serve an aiohttp app (the scripted LLM, a test's stand-in API) on a free loopback port."""

from __future__ import annotations

import asyncio
from typing import Self

from aiohttp import web

__all__ = ["LoopbackServer", "start_on_loopback"]


async def start_on_loopback(
    app: web.Application, idle_timeout_s: float = 75.0
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1 at a port the OS picks, closing a connection idle for
    ``idle_timeout_s`` (aiohttp's keep-alive default); returns the runner (``cleanup()`` it
    when done) and the port."""
    runner = web.AppRunner(app, shutdown_timeout=0.5, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    port: int = server.sockets[0].getsockname()[1]
    return runner, port


class LoopbackServer:
    """A stand-in HTTP server on 127.0.0.1, open from :meth:`start` (or ``async with``) to
    :meth:`close`; :attr:`origin` is where it listens. A subclass adds its routes in
    :meth:`routes`."""

    client_max_size = 1024**2
    """The largest request body it takes (aiohttp's default)."""
    idle_timeout_s = 75.0
    """It closes a client's connection idle this long (aiohttp's default)."""

    def __init__(self) -> None:
        self.origin = ""
        """``http://127.0.0.1:PORT`` once started."""
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        """Add the server's routes to ``app``."""
        raise NotImplementedError

    async def start(self) -> str:
        """Serve on a free port; returns :attr:`origin`."""
        app = web.Application(client_max_size=self.client_max_size)
        self.routes(app)
        self._runner, port = await start_on_loopback(app, self.idle_timeout_s)
        self.origin = f"http://127.0.0.1:{port}"
        return self.origin

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
