"""The aiohttp application: signalling, the web client, health and metrics.

Routes: ``GET /`` (the web client), ``GET /config``, ``POST /offer``, ``DELETE /sessions/{id}``,
``POST /calls``, ``GET /calls/{id}`` (outbound SIP calls), ``GET /calls/{id}/events`` (any call),
``GET /healthz``, ``GET /metrics``, ``GET /playbooks``. Every error is JSON ``{"error": message}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, web

from server.admission.ratelimit import RateLimited, client_address
from server.call.events import VoiceEvent
from server.call.recordings import OPT_OUT_HEADER, wants_recording
from server.config.server import ServerConfig
from server.runtime.call_directory import CallDirectory
from server.runtime.engines import Engines
from server.runtime.observability import ServerMetrics, process_snapshot
from server.runtime.registry import CallRegistry, OverCapacity, UnknownPlaybook
from server.runtime.tracing import TurnTracer, otlp_provider
from server.transports.base import TransportCall
from server.transports.phone.audiosocket import AudioSocketServer
from server.transports.phone.media_streams import (
    MAX_MESSAGE_BYTES,
    BadStart,
    close_reason,
    serve_media_stream,
)
from server.transports.sip.outbound import OutboundCall
from server.transports.sip.server import SipServer
from server.transports.webrtc.call import BadOffer, open_webrtc_call

from .auth import require_token
from .bodies import BadBody, OfferBody, PlaceCallBody, read_body
from .middleware import cors, errors_as_json, json_error, remember_prepared
from .relay import Relay
from .siblings import Siblings, merge_metrics

__all__ = ["AUDIOSOCKET", "CALLS", "CONFIG", "ENGINES", "METRICS", "create_app"]

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ServerConfig)
ENGINES = web.AppKey("engines", Engines)
CALLS = web.AppKey("calls", CallRegistry)
METRICS = web.AppKey("metrics", ServerMetrics)
AUDIOSOCKET = web.AppKey("audiosocket", AudioSocketServer)
SIP = web.AppKey("sip", SipServer)
SIBLINGS = web.AppKey("siblings", Siblings)
RELAY = web.AppKey("relay", Relay)

MAX_SDP_BYTES = 64 * 1024


def create_app(config: ServerConfig, engines: Engines | None = None) -> web.Application:
    """The server. ``engines`` may be passed in (already loaded, e.g. shared by tests); otherwise
    they are loaded on startup, before the first call is accepted, and closed on shutdown."""
    app = web.Application(
        middlewares=[errors_as_json, cors(config.cors_origins)],
        client_max_size=MAX_SDP_BYTES * 2,
    )
    app.on_response_prepare.append(remember_prepared)
    app[CONFIG] = config
    app[METRICS] = ServerMetrics()
    app[SIBLINGS] = Siblings(config)
    app.cleanup_ctx.append(_siblings_context)
    app.cleanup_ctx.append(_engines_context(engines))
    app.cleanup_ctx.append(_calls_context)
    app.router.add_get("/", _index)
    app.router.add_get("/config", _client_config)
    app.router.add_post("/offer", _offer)
    app.router.add_delete("/sessions/{session_id}", _hangup)
    app.router.add_post("/calls", _place_call)
    app.router.add_get("/calls/{session_id}", _call_status)
    app.router.add_get("/calls/{session_id}/events", _call_events)
    app.router.add_get("/healthz", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/playbooks", _playbooks)
    app.router.add_get("/twilio/media", _media_stream)
    if config.web_client_dir.is_dir():
        app.router.add_static("/client/", config.web_client_dir)
    return app


def _engines_context(
    given: Engines | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        engines = given or await Engines.load(app[CONFIG])
        app[ENGINES] = engines
        yield
        if given is None:
            await engines.close()

    return context


async def _siblings_context(app: web.Application) -> AsyncIterator[None]:
    await app[SIBLINGS].start()
    yield
    await app[SIBLINGS].aclose()


async def _calls_context(app: web.Application) -> AsyncIterator[None]:
    metrics = app[METRICS]
    config = app[CONFIG]
    provider = otlp_provider() if config.otel else None
    tracer = TurnTracer(provider.get_tracer("vocable")) if provider is not None else None

    def observe(event: VoiceEvent) -> None:
        metrics.observe(event)
        if tracer is not None:
            tracer.observe(event)

    http = aiohttp.ClientSession()  # the calls' own requests: one session for the application
    calls = CallRegistry(config, app[ENGINES], observe, http)
    app[CALLS] = calls
    metrics.active_sessions.set_function(lambda: len(calls))
    audiosocket = None
    if config.audiosocket is not None:
        audiosocket = AudioSocketServer(calls, *config.audiosocket)
        await audiosocket.start()
        app[AUDIOSOCKET] = audiosocket
    sip = None
    if config.sip is not None:
        sip = SipServer(calls, config.sip)
        await sip.start()
        app[SIP] = sip
        if sip.registrar is not None:
            registrar = sip.registrar
            metrics.sip_registered.set_function(lambda: float(registrar.registered))
    directory_renewal = None
    if config.redis_url is not None:
        directory = CallDirectory(config.redis_url, config.reachable_at, lambda: list(calls.calls))
        await directory.start()  # raises DirectoryUnavailable: the server does not start
        calls.directory = directory
        directory_renewal = asyncio.create_task(directory.run(), name="call-directory")
    app[RELAY] = Relay(app[SIBLINGS], calls.directory, http)
    async with calls.load.running(), calls.recordings.running():
        yield
    if directory_renewal is not None:
        directory_renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await directory_renewal
    if sip is not None:
        await sip.close()
    if audiosocket is not None:
        await audiosocket.close()
    await calls.close_all()
    await http.close()
    if calls.directory is not None:
        await calls.directory.aclose()
    if provider is not None:
        # exports the spans still batched; off the loop, as it may wait for the collector
        await asyncio.to_thread(provider.shutdown)


def _client_address(request: web.Request) -> str:
    config = request.app[CONFIG]
    forwarded = request.headers.get("X-Forwarded-For", "")
    return client_address(request.remote, forwarded, config.trusted_proxies)


def _recorded(request: web.Request) -> bool:
    """Whether the call may be recorded: no ``X-Vocable-Record: off`` header (nor, for clients
    that cannot set headers, ``?record=off``)."""
    asked = request.headers.get(OPT_OUT_HEADER) or request.query.get("record")
    return wants_recording(asked)


def _require_token(request: web.Request, *, in_query: bool = False) -> None:
    require_token(request, request.app[CONFIG].auth_token, in_query=in_query)


# -- handlers ----------------------------------------------------------------------------------


async def _index(request: web.Request) -> web.StreamResponse:
    index = request.app[CONFIG].web_client_dir / "index.html"
    if not index.is_file():
        return json_error(404, "the web client is not installed")
    return web.FileResponse(index)


async def _client_config(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    engines = request.app[ENGINES]
    return web.json_response(
        {
            "ice_servers": [server.to_client() for server in config.ice_servers],
            "auth_required": config.auth_token is not None,
            "llm_configured": engines.llm is not None,
            "llm": engines.llm_provider.status.to_json(),
            "default_playbook": engines.default_playbook,
        }
    )


async def _offer(request: web.Request) -> web.Response:
    _require_token(request)
    if request.content_length is not None and request.content_length > MAX_SDP_BYTES:
        return json_error(413, f"offer too large (at most {MAX_SDP_BYTES} bytes)")
    try:
        offer = await read_body(request, OfferBody)
    except BadBody as exc:
        return json_error(400, str(exc))
    if len(offer.sdp.encode()) > MAX_SDP_BYTES:
        return json_error(413, f"offer too large (at most {MAX_SDP_BYTES} bytes)")
    calls = request.app[CALLS]
    try:
        call = await open_webrtc_call(
            calls, offer.sdp, offer.playbook, _client_address(request), record=_recorded(request)
        )
    except BadOffer as exc:
        return json_error(400, str(exc))
    except (UnknownPlaybook, OverCapacity, RateLimited) as exc:
        return _refused(exc)
    request.app[METRICS].sessions.inc()
    await calls.announced(call.id)
    return web.json_response(
        {"sdp": call.pc.localDescription.sdp, "type": "answer", "session_id": call.id}
    )


def _refused(exc: UnknownPlaybook | OverCapacity | RateLimited) -> web.Response:
    """The answer to a call the registry would not start: 404, or 503 / 429 with when to try
    again."""
    if isinstance(exc, UnknownPlaybook):
        return json_error(404, str(exc))
    if isinstance(exc, OverCapacity):
        return json_error(503, str(exc), **{"Retry-After": str(exc.retry_after_s)})
    return json_error(429, str(exc), **{"Retry-After": f"{exc.retry_after_s:.0f}"})


async def _media_stream(request: web.Request) -> web.StreamResponse:
    """A Twilio (or Telnyx) media stream: ``wss://HOST/twilio/media[?playbook=ID&token=T]``.
    Refused before the upgrade: 401 (token), 503 (full); after it, a stream that cannot start
    is closed with 1008 and the reason."""
    _require_token(request, in_query=True)
    calls = request.app[CALLS]
    try:
        calls.check_capacity()
    except OverCapacity as exc:
        return _refused(exc)
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=MAX_MESSAGE_BYTES)
    await ws.prepare(request)
    try:
        await serve_media_stream(
            ws, calls, request.query.get("playbook"), record=_recorded(request)
        )
    except (BadStart, OverCapacity, UnknownPlaybook) as exc:
        log.warning("media stream refused: %s", exc)
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=close_reason(str(exc)))
    return ws


async def _hangup(request: web.Request) -> web.StreamResponse:
    _require_token(request)
    session_id = request.match_info["session_id"]
    calls = request.app[CALLS]
    if session_id not in calls.calls:
        relayed = await request.app[RELAY].answer(request, session_id, gone="no such session")
        if relayed is not None:
            return relayed
    if not await calls.hangup(session_id):
        return json_error(404, "no such session")
    return web.json_response({"status": "hung up"})


async def _place_call(request: web.Request) -> web.Response:
    """``{"to": "sip:user@host[:port]", "playbook"?: ID, "trunk"?: NAME, "ring_timeout_s"?: S}``
    -> ``{"session_id"}``: an outbound SIP call, placed in the background (follow it with
    ``GET /calls/{id}``). 409 without ``--sip``."""
    _require_token(request)
    sip = request.app.get(SIP)
    if sip is None:
        return json_error(409, "outbound calls need the SIP endpoint: start the server with --sip")
    try:
        body = await read_body(request, PlaceCallBody)
    except BadBody as exc:
        return json_error(400, str(exc))
    try:
        call = sip.place_call(
            body.to,
            body.playbook,
            ring_timeout_s=body.ring_timeout_s,
            trunk=body.trunk,
            address=_client_address(request),
        )
    except ValueError as exc:
        return json_error(400, str(exc))
    except (UnknownPlaybook, OverCapacity, RateLimited) as exc:
        return _refused(exc)
    request.app[METRICS].sessions.inc()
    await request.app[CALLS].announced(call.id)
    return web.json_response({"session_id": call.id}, status=201)


def _outbound(request: web.Request) -> OutboundCall | None:
    """The outbound call the request names, live or among the latest ended; None if unknown."""
    sip = request.app.get(SIP)
    return sip.outbound.get(request.match_info["session_id"]) if sip is not None else None


def _followed(request: web.Request) -> TransportCall | None:
    """The call the request names that this process holds, of any transport (an outbound
    call also once ended, while it is kept); None if unknown."""
    call = request.app[CALLS].get(request.match_info["session_id"])
    if isinstance(call, TransportCall):
        return call
    return _outbound(request)


async def _held_elsewhere(request: web.Request, what: str) -> web.StreamResponse:
    """The answer of the process (worker or replica) holding the call the request names
    (none here); raises 404 ``{"error": what}`` when no process does."""
    session_id = request.match_info["session_id"]
    relayed = await request.app[RELAY].answer(request, session_id, gone=what)
    if relayed is None:
        raise web.HTTPNotFound(text=json.dumps({"error": what}), content_type="application/json")
    return relayed


async def _call_status(request: web.Request) -> web.StreamResponse:
    """An outbound call: ``state`` (ringing, answered, ended), ``result``, ``reason``..."""
    _require_token(request)
    call = _outbound(request)
    if call is None:
        return await _held_elsewhere(request, "no such outbound call")
    return web.json_response(call.describe())


async def _call_events(request: web.Request) -> web.StreamResponse:
    """Any call's events as server-sent events (``data: {json}``), from its first (the last
    500 kept): its voice events as its caller sees them, a ``hangup`` item with the reason and,
    for an outbound call, a ``call`` item at each state. The stream ends when the call has
    ended; 404 for a call no process holds (a WebRTC or inbound call is forgotten once it
    ended; an outbound one is kept a while)."""
    _require_token(request)
    call = _followed(request)
    if call is None:
        return await _held_elsewhere(request, "no such call")
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    queue = call.events.listen()
    try:
        while (item := await queue.get()) is not None:
            await response.write(f"data: {json.dumps(item)}\n\n".encode())
    except ConnectionResetError:
        pass
    finally:
        call.events.unlisten(queue)
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


async def _health(request: web.Request) -> web.Response:
    """200 while calls are admitted; 503 ``draining`` once shutdown has begun."""
    engines = request.app[ENGINES]
    calls = request.app[CALLS]
    draining = calls.draining
    return web.json_response(
        status=503 if draining else 200,
        data={
            "status": "draining" if draining else "ok",
            "models_loaded": True,
            "llm_configured": engines.llm is not None,
            "llm": engines.llm_provider.status.to_json(),
            "active_sessions": len(request.app[CALLS]),
            "max_sessions": request.app[CONFIG].max_sessions,
            "load": {
                **{key: round(value, 1) for key, value in calls.load.measured().items()},
                "call_cpu_percent": round(calls.load.call_cost * 100, 1),
                "capacity_calls": calls.load.capacity(),
                "cpu_limit": {"cores": calls.cpu_limit.cores, "source": calls.cpu_limit.source},
            },
            "refused_overloaded": calls.refused,
            **_sip_health(request),
            "process": {"pid": os.getpid(), **process_snapshot()},
            "worker": request.app[CONFIG].worker_index,
        },
    )


def _sip_health(request: web.Request) -> dict[str, Any]:
    """The SIP registration's state, for ``/healthz`` (nothing without ``--sip-register``)."""
    sip = request.app.get(SIP)
    if sip is None or sip.registrar is None:
        return {}
    return {"sip_registration": sip.registrar.describe()}


async def _metrics(request: web.Request) -> web.Response:
    """This process's metrics (an embedded model's ``llamacpp:*`` among them); with several
    workers, all of theirs, labelled by ``worker`` (``?local=1``: this worker's alone)."""
    own = request.app[METRICS].render()
    own += (await request.app[ENGINES].llm_provider.metrics_text()).encode()
    siblings = request.app[SIBLINGS]
    if siblings.sockets and "local" not in request.query:
        texts = await siblings.metrics()
        texts[siblings.me] = own.decode()
        own = merge_metrics(texts)
    return web.Response(
        body=own, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def _playbooks(request: web.Request) -> web.Response:
    playbooks = request.app[ENGINES].playbooks
    return web.json_response(
        [
            {"id": p.spec.id, "name": p.spec.name, "description": p.spec.description}
            for p in playbooks.values()
        ]
    )
