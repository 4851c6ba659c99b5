"""Requests about a call that another replica holds, passed on to it (``--redis-url``).

``GET /calls/{id}``, ``GET /calls/{id}/events`` and ``DELETE /sessions/{id}`` answer the same on
any replica: one that does not hold the call asks the call directory
(:mod:`server.runtime.call_directory`) which replica does, and relays the request to it (the
event stream as it comes) and its answer back. The client sees neither the holder nor its
address. A relayed request carries FORWARDED, and the holder answers it itself: a stale entry
can never bounce a request between replicas.
"""

from __future__ import annotations

import contextlib
import logging

import aiohttp
from aiohttp import web

from server.runtime.call_directory import CallDirectory, DirectoryUnavailable

from .middleware import json_error

__all__ = ["FORWARDED", "relay_to_holder"]

log = logging.getLogger(__name__)

FORWARDED = "X-Vocable-Forwarded"
"""Marks a request one replica relayed to another."""
RETRY_AFTER_S = 5
_CONNECT = aiohttp.ClientTimeout(total=None, connect=3.0, sock_connect=3.0, sock_read=None)
_PASSED_HEADERS = ("Authorization",)


async def relay_to_holder(
    request: web.Request, directory: CallDirectory | None, call_id: str
) -> web.StreamResponse | None:
    """The holding replica's answer to ``request`` about ``call_id``; None when no other
    replica holds it (or there is no directory, or the request was relayed already): the
    caller answers for itself. 503 with the reason when the directory or the holder cannot be
    reached."""
    if directory is None or FORWARDED in request.headers:
        return None
    try:
        holder = await directory.holder(call_id)
    except DirectoryUnavailable as exc:
        return json_error(503, str(exc), **{"Retry-After": str(RETRY_AFTER_S)})
    if holder is None or holder == directory.me:
        return None
    headers = {name: request.headers[name] for name in _PASSED_HEADERS if name in request.headers}
    headers[FORWARDED] = "1"
    try:
        async with (
            aiohttp.ClientSession(timeout=_CONNECT) as session,
            session.request(
                request.method, holder + str(request.rel_url), headers=headers
            ) as upstream,
        ):
            if upstream.content_type == "text/event-stream":
                return await _stream(request, upstream)
            body = await upstream.read()
            return web.Response(
                status=upstream.status, body=body, content_type=upstream.content_type
            )
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.warning("call %s: its replica cannot be reached: %r", call_id, exc)
        return json_error(
            503,
            "the server holding this call cannot be reached",
            **{"Retry-After": str(RETRY_AFTER_S)},
        )


async def _stream(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The holder's event stream, relayed as it comes until it ends or the client leaves."""
    response = web.StreamResponse(
        status=upstream.status,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await response.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
    except (aiohttp.ClientError, OSError) as exc:  # the holder went away mid-stream
        log.warning("a relayed event stream ended early: %r", exc)
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response
