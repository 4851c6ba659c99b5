"""The shared bearer token (``--auth-token``): who may place and end calls."""

from __future__ import annotations

import hmac
import json

from aiohttp import web

__all__ = ["bearer_matches", "require_token"]


def _raw(text: str) -> bytes | None:
    """The bytes ``text`` stands for: aiohttp decodes header bytes that are not UTF-8 as
    surrogate escapes, and this undoes it; None for text no bytes produce (a lone surrogate)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def bearer_matches(given: str, token: str) -> bool:
    """Whether the ``Authorization`` value ``given`` is ``Bearer TOKEN``: compared as bytes in
    constant time; never raises, whatever characters or bytes either holds."""
    expected = _raw(f"Bearer {token}") or b""
    raw = _raw(given)
    same = hmac.compare_digest(raw if raw is not None else b"", expected)
    return same and raw is not None and bool(expected)


def require_token(request: web.Request, token: str | None, *, in_query: bool = False) -> None:
    """With ``token`` set, require ``Authorization: Bearer TOKEN`` (or, where the peer cannot
    set headers, e.g. Twilio's WebSocket, ``?token=TOKEN``); raises HTTPUnauthorized (401,
    JSON, the token never echoed)."""
    if token is None:
        return
    given = request.headers.get("Authorization", "")
    if in_query and not given and "token" in request.query:
        given = f"Bearer {request.query['token']}"
    if not bearer_matches(given, token):
        raise web.HTTPUnauthorized(
            text=json.dumps({"error": "missing or wrong bearer token"}),
            content_type="application/json",
            headers={"WWW-Authenticate": "Bearer"},
        )
