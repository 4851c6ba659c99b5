"""What every route shares: JSON errors, CORS, and never a second response on a started one."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSCloseCode, web

__all__ = ["cors", "errors_as_json", "json_error", "remember_prepared"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STARTED = web.RequestKey("started_response", web.StreamResponse)


def json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


async def remember_prepared(request: web.Request, response: web.StreamResponse) -> None:
    """An ``on_response_prepare`` hook: notes the response whose headers are going out, so an
    error raised after that (on an upgraded WebSocket, say) does not write a second one."""
    request[_STARTED] = response


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors as JSON ``{"error": message}``; an unexpected exception is logged and answered
    500, or, once a response has started, that response is ended instead (a WebSocket is
    closed with 1011) and returned as it is."""
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's own 404, 405, 413...: JSON like ours
        started = await _end_started(request)
        if started is not None:
            log.warning("%s %s: %s after the response started", request.method, request.path, exc)
            return started
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return json_error(exc.status, exc.reason)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        started = await _end_started(request)
        return started if started is not None else json_error(500, "internal server error")


async def _end_started(request: web.Request) -> web.StreamResponse | None:
    """The response already started for ``request``, a WebSocket of it closed; None if none."""
    started = request.get(_STARTED)
    if isinstance(started, web.WebSocketResponse) and not started.closed:
        await started.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal server error")
    return started


def cors(origins: tuple[str, ...]) -> Any:
    """CORS headers for allowlisted origins only (``*`` allows any); none for the others."""
    allowed = set(origins)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        permitted = origin is not None and ("*" in allowed or origin in allowed)
        if request.method == "OPTIONS" and permitted:
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if permitted and origin is not None and not response.prepared:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Vary"] = "Origin"
        return response

    return middleware
