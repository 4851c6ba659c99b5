"""Requests about a call another process holds, passed on to it: one relay for workers and
replicas.

A call lives in one process. Under ``--workers N`` that may be a sibling worker on this host,
named by the call id's prefix (``w1.…``) and reached over its control socket
(:mod:`server.http.siblings`). With ``--redis-url`` it may be another replica, found in the
call directory (:mod:`server.runtime.call_directory`) and reached at its internal URL. Both are
a holder found by :meth:`Relay.holder`, and :meth:`Relay.answer` passes the request on (an
event stream as it comes) and the holder's answer back. ``GET /calls/{id}``, its events and
``DELETE /sessions/{id}`` thus answer the same whichever process receives them; the client sees
neither the holder nor its address.

A relayed request carries FORWARDED with the hops it made. The directory is asked only by the
process that received the request from its client, and a request goes to a sibling only if it
has made no worker hop on this host (a replica hop starts afresh on the next host): a stale
directory entry or a dead worker can never bounce a request around.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web

from server.runtime.call_directory import CallDirectory, DirectoryUnavailable

from .middleware import json_error
from .siblings import Siblings, worker_of

__all__ = ["FORWARDED", "Holder", "Relay"]

log = logging.getLogger(__name__)

FORWARDED = "X-Vocable-Forwarded"
"""The hops a relayed request made, comma-separated: ``replica``, ``worker``."""
RETRY_AFTER_S = 5
_PASSED_HEADERS = ("Authorization",)
_CONNECT_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=3.0, sock_connect=3.0, sock_read=None)
"""A holder must be reached within 3 s; an event stream it relays may then last the call."""

Hop = Literal["replica", "worker"]


@dataclass(frozen=True)
class Holder:
    """The process holding a call, as reached from this one."""

    http: aiohttp.ClientSession
    """A session that reaches it (a sibling's control socket, or TCP)."""
    base: str
    """Its base URL on that session."""
    hop: Hop

    @property
    def gone_with_it(self) -> bool:
        """Whether an unreachable holder means its calls are gone: a worker's calls die with
        it, while a replica out of reach may be back in a moment."""
        return self.hop == "worker"


class Relay:
    """Finds the process holding a call and passes requests about it on: to a sibling over
    its control socket, to a replica through the application's HTTP client ``http``."""

    def __init__(
        self, siblings: Siblings, directory: CallDirectory | None, http: aiohttp.ClientSession
    ) -> None:
        self.siblings = siblings
        self.directory = directory
        self.http = http

    async def holder(self, call_id: str, hops: frozenset[str]) -> Holder | None:
        """The other process holding ``call_id``, for a request that made ``hops``; None when
        no other does (as far as this process may ask). Raises DirectoryUnavailable."""
        if self.directory is not None and not hops:
            url = await self.directory.holder(call_id)
            if url is not None and url != self.directory.me:
                return Holder(self.http, url, "replica")
        worker = worker_of(call_id)
        if worker is not None and "worker" not in hops:
            session = self.siblings.session(worker)
            if session is not None:
                return Holder(session, "http://worker", "worker")
        return None

    async def answer(
        self, request: web.Request, call_id: str, *, gone: str
    ) -> web.StreamResponse | None:
        """The holding process's answer to ``request`` about ``call_id``; None when this
        process must answer itself (no other holds the call). An unreachable holder answers
        404 ``gone`` for a worker (its calls went with it) and 503 with Retry-After for a
        replica or the directory."""
        hops = _hops(request)
        try:
            holder = await self.holder(call_id, hops)
        except DirectoryUnavailable as exc:
            return json_error(503, str(exc), **{"Retry-After": str(RETRY_AFTER_S)})
        if holder is None:
            return None
        headers = {name: value for name in _PASSED_HEADERS if (value := request.headers.get(name))}
        made = {holder.hop} if holder.hop == "replica" else {*hops, holder.hop}
        headers[FORWARDED] = ",".join(sorted(made))
        try:
            async with holder.http.request(
                request.method,
                holder.base + str(request.rel_url),
                headers=headers,
                timeout=_CONNECT_TIMEOUT,
            ) as upstream:
                if upstream.content_type == "text/event-stream":
                    return await _stream(request, upstream)
                body = await upstream.read()
                return web.Response(
                    status=upstream.status, body=body, content_type=upstream.content_type
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("call %s: its %s cannot be reached: %r", call_id, holder.hop, exc)
            if holder.gone_with_it:
                return json_error(404, gone)
            return json_error(
                503,
                "the server holding this call cannot be reached",
                **{"Retry-After": str(RETRY_AFTER_S)},
            )


def _hops(request: web.Request) -> frozenset[str]:
    """The hops ``request`` made before reaching this process."""
    marked = request.headers.get(FORWARDED, "")
    return frozenset(hop.strip() for hop in marked.split(",") if hop.strip())


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
