"""A minimal OTLP/HTTP trace collector on 127.0.0.1, for tests of what ``--otel`` exports.

It speaks the receiving side of the OTLP/HTTP protocol for traces: ``POST /v1/traces`` with an
``application/x-protobuf`` body (optionally gzip- or deflate-encoded) holding an
``ExportTraceServiceRequest``, answered 200 with an empty ``ExportTraceServiceResponse``. Any
other content type is refused with 415 and an undecodable body with 400, so an exporter speaking
something else fails loudly instead of being counted.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from server.testkit.loopback import LoopbackServer

__all__ = ["ExportedSpan", "OtlpCollector", "attributes", "collector_in_thread"]

PROTOBUF = "application/x-protobuf"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    """OTLP ``KeyValue`` pairs as a plain dict."""
    out: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        out[pair.key] = _value(pair.value)
    return out


@dataclass(frozen=True)
class ExportedSpan:
    """One span as received, with the resource and instrumentation scope it was sent under."""

    span: Span
    resource: dict[str, Any]
    scope: str

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.span.attributes)

    @property
    def duration_ms(self) -> float:
        return (self.span.end_time_unix_nano - self.span.start_time_unix_nano) / 1e6


class OtlpCollector(LoopbackServer):
    """``async with OtlpCollector() as collector:`` then export to ``collector.endpoint`` (the
    base URL, as in ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[ExportTraceServiceRequest] = []
        self.refused: list[tuple[int, str]] = []
        """(status, reason) of each request that was not accepted."""

    @property
    def endpoint(self) -> str:
        return self.origin

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/traces", self._traces)

    def spans(self) -> list[ExportedSpan]:
        """Every span received so far, in arrival order."""
        return [
            ExportedSpan(
                span, attributes(resource_spans.resource.attributes), scope_spans.scope.name
            )
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    async def _traces(self, request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            return self._refuse(415, f"content type {request.content_type!r}")
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding != "identity":
                return self._refuse(415, f"content encoding {encoding!r}")
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
        except (OSError, zlib.error, DecodeError) as exc:
            return self._refuse(400, f"undecodable body: {exc}")
        self.requests.append(message)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF
        )

    def _refuse(self, status: int, reason: str) -> web.Response:
        self.refused.append((status, reason))
        return web.Response(status=status, text=reason)


@contextmanager
def collector_in_thread(timeout_s: float = 10.0) -> Iterator[OtlpCollector]:
    """An :class:`OtlpCollector` served by its own event loop in a thread, for an exporter that
    blocks the test's loop while it sends (the app's synchronous flush in its cleanup)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="otlp-collector", daemon=True)
    thread.start()
    collector = OtlpCollector()
    try:
        asyncio.run_coroutine_threadsafe(collector.__aenter__(), loop).result(timeout_s)
        yield collector
    finally:
        asyncio.run_coroutine_threadsafe(collector.__aexit__(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        loop.close()
