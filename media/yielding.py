"""Piper runs that give way to more urgent synthesis.

Piper synthesizes a sentence in one onnxruntime run, 50-500 ms of CPU on one thread. A caller
waiting in silence for an answer's first words (``URGENT`` work) could wait that long for
another call's later sentence, which nobody needs for a second or more, to finish first.

Told that more urgent work was submitted (``PriorityPool.on_submit``) while no worker is free,
:class:`GiveWay` stops a less urgent run (onnxruntime's ``terminate`` flag: it stops within a
few milliseconds), runs the urgent work in the same thread (``PriorityPool.run_urgent``), then
runs the stopped one again from its start: the synthesis it belongs to carries on as if it had
not been interrupted. What the stopped run had done is thrown away, so a run is stopped only
while it has done less than it still has to do (by the time per phoneme its session took so
far): at most half a sentence is computed twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .priority_pool import PriorityPool

__all__ = ["GiveWay", "YieldingSession"]

RATE_SMOOTHING = 0.3
"""How far each finished run moves a session's learned time per phoneme towards its own."""


@dataclass
class _Run:
    priority: int
    options: Any
    """onnxruntime ``RunOptions``: its ``terminate`` flag stops the run."""
    started: float
    expected_s: float | None
    stopped: bool = False


class GiveWay:
    """The runs in progress on a pool's workers, stopped for more urgent work (see the module's
    docstring). One per pool; every :class:`YieldingSession` of that pool's voices shares it."""

    def __init__(self, pool: PriorityPool) -> None:
        self.pool = pool
        self.stops = 0
        """Runs stopped for more urgent work so far."""
        self.affordable: Callable[[], bool] = lambda: True
        """Whether the CPU a stopped run throws away can be spared now (a hook: the server
        says no while decodes wait for Whisper, whose callers wait too)."""
        self._runs: list[_Run] = []
        self._lock = threading.Lock()
        pool.on_submit = self._on_submit

    def _on_submit(self, priority: int) -> None:
        if self.pool.idle_workers or not self._runs or not self.affordable():
            return  # a free worker takes it, nothing runs, or the CPU is needed elsewhere
        now = time.perf_counter()
        with self._lock:
            for run in self._runs:
                if priority < run.priority and not run.stopped and _worth_stopping(run, now):
                    run.stopped = True
                    run.options.terminate = True
                    self.stops += 1
                    return

    def start(self, priority: int, expected_s: float | None) -> _Run:
        import onnxruntime

        run = _Run(priority, onnxruntime.RunOptions(), time.perf_counter(), expected_s)
        with self._lock:
            self._runs.append(run)
        return run

    def end(self, run: _Run) -> None:
        with self._lock:
            self._runs.remove(run)


def _worth_stopping(run: _Run, now: float) -> bool:
    """Whether less of ``run`` is done than is left (unknown: yes)."""
    if run.expected_s is None:
        return True
    elapsed = now - run.started
    return elapsed < run.expected_s - elapsed


class YieldingSession:
    """An onnxruntime session of a Piper voice whose runs, on its pool's workers, give way to
    more urgent work (:class:`GiveWay`); elsewhere (warm-up, tests) they simply run."""

    def __init__(self, session: Any, give_way: GiveWay) -> None:
        self.session = session
        self.give_way = give_way
        self.seconds_per_id: float | None = None
        """What a phoneme id took to synthesize on this session, smoothed over runs."""

    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any]) -> Any:
        priority = self.give_way.pool.running_priority()
        if priority is None:
            return self.session.run(output_names, input_feed)
        ids = int(input_feed["input"].shape[-1])
        while True:
            expected = None if self.seconds_per_id is None else ids * self.seconds_per_id
            run = self.give_way.start(priority, expected)
            try:
                result = self.session.run(output_names, input_feed, run.options)
            except Exception:
                if not run.stopped:
                    raise
            else:
                self._learn(ids, time.perf_counter() - run.started)
                return result
            finally:
                self.give_way.end(run)
            self.give_way.pool.run_urgent(than=priority)

    def _learn(self, ids: int, seconds: float) -> None:
        rate = seconds / max(1, ids)
        if self.seconds_per_id is None:
            self.seconds_per_id = rate
        else:
            self.seconds_per_id += RATE_SMOOTHING * (rate - self.seconds_per_id)
