"""Optional OpenTelemetry traces: one ``turn`` span per answered turn, a child span per stage.

Built from the ``turn_metrics`` voice event after the turn's first audio has left, so tracing
adds nothing to the turn's own path. Stages are consecutive hops (end of speech, STT, LLM first
token, first sentence, TTS first audio, first frame out), laid end to end back from the moment
the metrics were emitted. The turn span carries the session id and the playbook stage.

Enabled with ``--otel`` when the ``otel`` extra is installed (``pip install 'vocable[otel]'``);
the exporter follows the standard ``OTEL_EXPORTER_OTLP_*`` environment variables.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from server.call.events import VoiceEvent

from .logs import current_session

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

__all__ = ["STAGES", "TurnTracer", "otlp_provider"]

STAGES = (
    ("end_of_speech_ms", "end_of_speech"),
    ("stt_ms", "stt"),
    ("llm_first_token_ms", "llm_first_token"),
    ("first_sentence_ms", "first_sentence"),
    ("tts_first_audio_ms", "tts_first_audio"),
    ("first_frame_out_ms", "first_frame_out"),
)


class TurnTracer:
    """Feeds on voice events (all calls' events, from the tasks of each call) and records
    spans with ``tracer``."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._stages: dict[str | None, str] = {}

    def observe(self, event: VoiceEvent) -> None:
        session = current_session()
        if event.type == "stage_change":
            self._stages[session] = str(event.data.get("stage"))
        elif event.type == "state" and event.data.get("state") == "closed":
            self._stages.pop(session, None)
        elif event.type == "turn_metrics":
            self._record(event, session)

    def _record(self, event: VoiceEvent, session: str | None) -> None:
        from opentelemetry import trace

        wall_ns = time.time_ns() - round((time.monotonic() - event.t) * 1e9)
        stages = [(name, event.data.get(key)) for key, name in STAGES]
        # walk back from the last hop while the chain of durations is unbroken
        chain: list[tuple[str, int, int]] = []
        end_ns = wall_ns
        for name, ms in reversed(stages):
            if not isinstance(ms, int | float):
                if chain:
                    break
                continue
            start_ns = end_ns - round(ms * 1e6)
            chain.append((name, start_ns, end_ns))
            end_ns = start_ns
        if not chain:
            return
        attributes: dict[str, Any] = {"vocable.session_id": session or ""}
        if session in self._stages:
            attributes["vocable.stage"] = self._stages[session]
        v2v = event.data.get("voice_to_voice_ms")
        if isinstance(v2v, int | float):
            attributes["vocable.voice_to_voice_ms"] = float(v2v)
        turn = self.tracer.start_span("turn", start_time=end_ns, attributes=attributes)
        context = trace.set_span_in_context(turn)
        for name, start_ns, stop_ns in reversed(chain):
            self.tracer.start_span(name, context=context, start_time=start_ns).end(stop_ns)
        turn.end(wall_ns)


def otlp_provider(service_name: str = "vocable") -> TracerProvider:
    """A tracer provider exporting over OTLP/HTTP in batches; raises ImportError without the
    ``otel`` extra."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
