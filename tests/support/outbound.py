"""Outbound calls through a test's server: ``POST /calls``, then its ``GET /calls/{id}`` until
the call has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

__all__ = ["call_ended", "post_call"]


async def post_call(server: TestServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``POST /calls`` with ``body``: the status and the JSON answer."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.make_url("/calls"), json=body) as response,
    ):
        return response.status, await response.json()


async def call_ended(
    server: TestServer, body: dict[str, Any], timeout_s: float = 30.0
) -> dict[str, Any]:
    """Place the call ``body`` describes (it must be accepted: 201) and wait up to
    ``timeout_s`` for it to end; its final ``GET /calls/{id}`` description."""
    status, placed = await post_call(server, body)
    assert status == 201, placed
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout_s):
        url = server.make_url(f"/calls/{placed['session_id']}")
        while True:
            async with http.get(url) as response:
                described: dict[str, Any] = await response.json()
            if described["state"] == "ended":
                return described
            await asyncio.sleep(0.05)
