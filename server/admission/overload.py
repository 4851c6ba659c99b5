"""When a server process refuses new calls because it is past its capacity (see
``server/admission/load.py``, which measures it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverloadSettings"]


@dataclass(frozen=True)
class OverloadSettings:
    """When new calls are refused; a limit of 0 is not checked."""

    max_loop_lag_ms: float = 150.0
    """Median event-loop lag over the window."""
    max_decode_backlog: int = 3
    """Decodes waiting for a worker, at the least over the window."""
    max_synthesis_backlog: int = 3
    """Answers' first words waiting for a synthesis worker, at the least over the window."""
    max_cpu_percent: float = 0.0
    """Process CPU over the window, as a share of the usable cores (100: all of them)."""
    capacity_cpu_percent: float = 100.0
    """Admit a call only while the calls live, each at its measured CPU cost, fit in this share
    of the CPU the process may use (its control group's quota, less what the group's other
    processes take of it; else its cores): a burst is refused before its own load shows (0: not
    checked), and the symptoms above refuse calls past what the machine serves. On a 2-core
    EPYC with the callers on the same cores (``benchmarks/results/admission-24``), 24 callers
    arriving over 6 s were cut to 7 calls at 50 % (p95 701 ms) and to 14 at 100 % (p95 721
    ms); 40 over 10 s to 16 (p95 742 ms); the goal is 1.5 s."""
    assumed_call_cpu_percent: float = 15.0
    """A call's CPU cost, as a share of one core, until calls have been measured (one caller
    of the latency benchmark, its answers and barge-ins included, uses 16-18 % on a 2-core
    Xeon)."""
    window_s: float = 2.0
