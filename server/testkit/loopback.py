"""Serve an aiohttp app (the scripted LLM, a test's stand-in API) on a free loopback port."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def start_on_loopback(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1 at a port the OS picks; returns the runner (``cleanup()`` it
    when done) and the port."""
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    port: int = server.sockets[0].getsockname()[1]
    return runner, port
