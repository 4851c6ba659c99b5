"""Per-turn OpenTelemetry spans built from the voice events a call emits."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from server.call.events import VoiceEvent
from server.runtime.logs import bind_session
from server.runtime.tracing import STAGES, TurnTracer


@pytest.fixture
def spans() -> tuple[TurnTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return TurnTracer(provider.get_tracer("test")), exporter


METRICS = {
    "end_of_speech_ms": 400.0,
    "stt_ms": 2.0,
    "llm_first_token_ms": 230.0,
    "first_sentence_ms": 120.0,
    "tts_first_audio_ms": 150.0,
    "first_frame_out_ms": 8.0,
    "voice_to_voice_ms": 910.0,
}


def test_a_turn_span_holds_its_stages_end_to_end(
    spans: tuple[TurnTracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans

    async def call() -> None:
        bind_session("w0.abc")
        tracer.observe(VoiceEvent("stage_change", {"stage": "greeting"}))
        tracer.observe(VoiceEvent("turn_metrics", dict(METRICS)))

    asyncio.run(call())
    finished = exporter.get_finished_spans()
    (turn,) = [s for s in finished if s.name == "turn"]
    children = sorted((s for s in finished if s.name != "turn"), key=lambda s: s.start_time or 0)
    assert [s.name for s in children] == [name for _, name in STAGES]
    assert all(s.parent is not None and s.parent.span_id == turn.context.span_id for s in children)
    for (key, _), span in zip(STAGES, children, strict=True):
        assert span.end_time is not None
        assert span.start_time is not None
        assert (span.end_time - span.start_time) / 1e6 == pytest.approx(METRICS[key], abs=0.01)
    for earlier, later in itertools.pairwise(children):
        assert earlier.end_time == later.start_time  # consecutive hops, no gaps
    assert turn.start_time == children[0].start_time
    assert turn.end_time == children[-1].end_time
    assert turn.attributes is not None
    assert turn.attributes["vocable.session_id"] == "w0.abc"
    assert turn.attributes["vocable.stage"] == "greeting"
    assert turn.attributes["vocable.voice_to_voice_ms"] == 910.0


def test_a_typed_turn_has_only_the_stages_that_happened(
    spans: tuple[TurnTracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    typed = {**METRICS, "end_of_speech_ms": None, "stt_ms": None, "voice_to_voice_ms": None}
    tracer.observe(VoiceEvent("turn_metrics", typed))
    names = {s.name for s in exporter.get_finished_spans()}
    assert names == {
        "turn",
        "llm_first_token",
        "first_sentence",
        "tts_first_audio",
        "first_frame_out",
    }


def test_a_turn_cut_before_any_audio_leaves_no_span(
    spans: tuple[TurnTracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    tracer.observe(VoiceEvent("turn_metrics", {key: None for key in METRICS}))
    assert exporter.get_finished_spans() == ()
