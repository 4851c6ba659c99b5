"""HTTP requests written byte by byte, for what aiohttp's client will not send (header values that
are not UTF-8)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

__all__ = ["raw_request"]


async def raw_request(
    host: str, port: int, method: str, path: str, headers: bytes = b"", body: bytes = b""
) -> tuple[int, Any]:
    """Send one request (``headers``: raw ``Name: value\\r\\n`` lines) and return its status and
    JSON body (None if the body is not JSON)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode()
            + headers
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, None
