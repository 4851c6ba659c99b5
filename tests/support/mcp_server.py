"""A small MCP server for the tests, written with the official SDK's FastMCP.

``python -m tests.support.mcp_server`` serves over stdio; ``--http PORT`` serves streamable HTTP on
127.0.0.1:PORT at ``/mcp``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from mcp.server.fastmcp import FastMCP
from mcp.types import ToolAnnotations

server = FastMCP("orders", host="127.0.0.1", log_level="WARNING")
ORDERS = {"A1001": "shipped", "A1002": "processing"}


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order's status.

    Args:
        order_id: The order number, like A1001.
    """
    return {"order_id": order_id, "status": ORDERS.get(order_id, "unknown")}


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
def refund(order_id: str, amount: float) -> str:
    """Refund part of an order."""
    return f"refunded {amount:.2f} on {order_id}"


@server.tool()
def explode() -> str:
    """Always fails."""
    raise ValueError("the warehouse is on fire")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "finally"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo(text: str, times: int = 1, tags: list[str] | None = None) -> dict[str, Any]:
    """Echo the arguments as the server received them."""
    return {"text": text * times, "tags": tags}


@server.tool()
def crash() -> str:
    """End the server process at once (a server that dies)."""
    os._exit(3)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def pid() -> int:
    """The server's process id."""
    return os.getpid()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.settings.port = int(sys.argv[2])
        server.run("streamable-http")
    else:
        server.run("stdio")
