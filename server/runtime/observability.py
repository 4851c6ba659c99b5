"""Prometheus metrics of one server process, fed by the calls' voice events."""

from __future__ import annotations

import asyncio
import os
import resource
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from server.call.events import VoiceEvent

__all__ = ["ServerMetrics", "process_snapshot"]


def process_snapshot() -> dict[str, float | int]:
    """This process's footprint, for leak checks: resident memory (current and peak), open file
    descriptors, OS threads (native ones too) and asyncio tasks. Linux (reads ``/proc``)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {
        "rss_mb": round(resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "open_files": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "asyncio_tasks": _asyncio_tasks(),
    }


def _asyncio_tasks() -> int:
    """Live tasks of the running event loop (0 outside one)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


_LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class ServerMetrics:
    """Counters and histograms in a registry of their own (one per app, so tests stay isolated)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, open fds...
        self.asyncio_tasks = Gauge(
            "vocable_asyncio_tasks", "Live asyncio tasks in this process.", registry=self.registry
        )
        self.asyncio_tasks.set_function(_asyncio_tasks)
        self.active_sessions = Gauge(
            "vocable_active_sessions", "Calls in progress.", registry=self.registry
        )
        self.sip_registered = Gauge(
            "vocable_sip_registered",
            "1 while the SIP registration (--sip-register) holds, else 0 (also without one).",
            registry=self.registry,
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
        self.turn_ends = Counter(
            "vocable_turn_ends",
            "Caller utterances ended, by why: words, words+audio (the turn model agreed), audio "
            "(the voice went on: a longer wait), hold (the hold limit), silence, forced.",
            ["reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "vocable_errors", "Errors by source.", ["source"], registry=self.registry
        )
        self.transfers = Counter(
            "vocable_transfers",
            "Call transfers to a person: started, answered, requested (not confirmed), failed (by"
            " reason).",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.recording_failures = Counter(
            "vocable_recording_failures",
            "Call recordings ended early: a write failed, or the writer fell behind.",
            ["reason"],
            registry=self.registry,
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
            case "speech_end" if event.data.get("reason"):
                self.turn_ends.labels(reason=str(event.data["reason"])).inc()
            case "speculation":
                self.speculations.labels(outcome=str(event.data.get("outcome"))).inc()
            case (
                "transfer_started" | "transfer_answered" | "transfer_requested" | "transfer_failed"
            ):
                reason = (
                    str(event.data.get("reason") or "") if event.type == "transfer_failed" else ""
                )
                self.transfers.labels(
                    outcome=event.type.removeprefix("transfer_"), reason=reason
                ).inc()
            case "error":
                self.errors.labels(source=str(event.data.get("source", "unknown"))).inc()
            case "recording_failed":
                self.recording_failures.labels(reason=str(event.data.get("reason"))).inc()
            case "turn_metrics":
                for name, value in event.data.items():
                    if isinstance(value, int | float) and name.endswith("_ms"):
                        self.latency.labels(stage=name.removesuffix("_ms")).observe(value / 1000)
            case _:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
