"""Prometheus metrics of one server process, fed by the calls' voice events."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .events import VoiceEvent

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class ServerMetrics:
    """Counters and histograms in a registry of their own (one per app, so tests stay isolated)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.active_sessions = Gauge(
            "vocable_active_sessions", "Calls in progress.", registry=self.registry
        )
        self.sessions = Counter("vocable_sessions", "Calls accepted.", registry=self.registry)
        self.turns = Counter(
            "vocable_turns", "User turns transcribed and answered.", registry=self.registry
        )
        self.barge_ins = Counter(
            "vocable_barge_ins", "Times a caller interrupted the agent.", registry=self.registry
        )
        self.resumes = Counter(
            "vocable_resumes",
            "Times the agent, paused by a sound, resumed (a backchannel or noise).",
            registry=self.registry,
        )
        self.speculations = Counter(
            "vocable_speculative_transcriptions",
            "Transcriptions started at a pause: used for the turn, or wasted (the caller went on).",
            ["outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "vocable_errors", "Errors by source.", ["source"], registry=self.registry
        )
        self.latency = Histogram(
            "vocable_turn_latency_seconds",
            "Per-turn latency by pipeline stage (see turn_metrics).",
            ["stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )

    def observe(self, event: VoiceEvent) -> None:
        match event.type:
            case "transcript" if event.data.get("text"):
                self.turns.inc()
            case "interrupted":
                self.barge_ins.inc()
            case "resumed":
                self.resumes.inc()
            case "speculation":
                self.speculations.labels(outcome=str(event.data.get("outcome"))).inc()
            case "error":
                self.errors.labels(source=str(event.data.get("source", "unknown"))).inc()
            case "turn_metrics":
                for name, value in event.data.items():
                    if isinstance(value, int | float) and name.endswith("_ms"):
                        self.latency.labels(stage=name.removesuffix("_ms")).observe(value / 1000)
            case _:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
