"""How loaded this server process is, measured, and whether it may take another call.

A server past its capacity does not fail: every call gets slower. So admission looks at the
symptoms of being past it, sustained over ``window_s`` (a single slow moment refuses nothing):

- **event-loop lag**: how late a timer that should fire every ``period_s`` fires. Every call's
  audio, pacing and signalling run on the loop; when the loop is late, callers hear it.
- **decode backlog**: utterances waiting for a Whisper worker. Each waiting decode is time a
  caller waits for an answer.
- **synthesis backlog**: answers' first words waiting for a Piper worker: callers waiting in
  silence while the answer's text is there.
- **CPU** (off by default): the process's CPU time over the window, as a share of the cores it
  may use. A busy machine can still serve within its latency goal, so this is a backstop for
  operators who want headroom, not the main signal.

Those symptoms show only once calls are talking, so a burst of calls arriving together would all
be admitted before any of them loads the machine. Admission therefore also counts calls by their
**measured cost**: the process's CPU per live call over windows in which the number of calls held
steady and most of them were in turns (speaking or being answered: a call is counted over its
turns, not averaged over its silences), smoothed across windows and remembered between bursts.
An LLM run in the process (llama.cpp) is counted apart: its threads' CPU (``server/llm/
llamacpp.py``: ``ModelThreads``) is left out of the calls' cost and taken out of their room.
While the live calls, at that cost each, fill ``capacity_cpu_percent`` of the CPU the process
may use (its control group's quota, else its cores: ``server/admission/cgroup.py``), the next one
is refused. Under a quota,
what the group's other processes took over the window (a sibling worker) is set aside first.
A neighbour outside it (another container, callers on the same machine: ``server/admission/
cores.py`` measures it) refuses calls only once the calls' own symptoms above show it starves
them.

A refused caller is asked to come back (``Retry-After``) after the window, plus as long as the
overload has lasted so far, between RETRY_MIN_S and RETRY_MAX_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .cgroup import cpu_limit
from .overload import OverloadSettings

__all__ = ["LoadGauge", "LoadSample", "Overload"]

RETRY_MIN_S = 2
RETRY_MAX_S = 30
IN_TURN_SHARE = 0.5
"""The share of the live calls that must be in turns, on average over a window, for the window
to teach admission what a call costs."""
COST_SMOOTHING = 0.25
"""How far each steady window moves the learned cost of a call towards what it measured: a
moment of heavy work (a greeting synthesized while a decode runs) is not taken for the norm."""


@dataclass(frozen=True)
class LoadSample:
    at: float
    loop_lag_s: float
    decode_backlog: int
    cpu_s: float
    """The process's CPU time so far."""
    calls: int = 0
    """Calls live."""
    cores_busy_s: float | None = None
    """How long the process's cores have been busy so far, whoever kept them busy (None: not
    known here)."""
    synthesis_backlog: int = 0
    """Answers' first words waiting for a synthesis worker."""
    calls_in_turn: int = 0
    """Live calls doing a turn's work (the caller speaking, or the agent answering)."""
    model_cpu_s: float | None = None
    """The CPU time of the LLM run in the process so far (None: none runs here)."""


@dataclass(frozen=True)
class Overload:
    reason: str
    retry_after_s: int


class LoadGauge:
    """Samples the process's load every ``period_s`` (:meth:`run`) and judges it
    (:meth:`overload`). ``decode_backlog`` tells how many decodes wait for a worker."""

    def __init__(
        self,
        settings: OverloadSettings,
        decode_backlog: Callable[[], int],
        *,
        period_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        cores: float | None = None,
        calls: Callable[[], int] = lambda: 0,
        calls_in_turn: Callable[[], int] | None = None,
        model_cpu_time: Callable[[], float | None] = lambda: None,
        cores_busy_time: Callable[[], float | None] = lambda: None,
        others_share_the_limit: bool = False,
        synthesis_backlog: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.period_s = period_s
        self._decode_backlog = decode_backlog
        self._synthesis_backlog = synthesis_backlog
        self._calls = calls
        self._calls_in_turn = calls_in_turn or calls
        self._model_cpu_time = model_cpu_time
        self.call_cost = settings.assumed_call_cpu_percent / 100
        """A live call's CPU, as a share of one core (measured; assumed until then)."""
        self._costed_at: float | None = None
        self._clock = clock
        self._cpu_time = cpu_time
        self._cores_busy_time = cores_busy_time
        self.cores = cores or cpu_limit().cores
        """The CPU the process may use, in cores: its control group's quota, else its affinity
        mask's cores (:func:`.cgroup.cpu_limit`; None given: read now)."""
        self.others_share_the_limit = others_share_the_limit
        """Whether the CPU that others take (:meth:`others_load`) comes out of :attr:`cores`:
        other processes of the same control group under its quota. Elsewhere a neighbour on
        the same machine refuses calls only through the calls' own symptoms (loop lag, decode
        backlog), not by its mere CPU."""
        self.samples: deque[LoadSample] = deque()
        self._overloaded_since: float | None = None

    async def run(self) -> None:
        """Sample until cancelled."""
        expected = self._clock() + self.period_s
        while True:
            await asyncio.sleep(max(0.0, expected - self._clock()))
            now = self._clock()
            self.record(max(0.0, now - expected))
            expected = now + self.period_s

    def record(self, loop_lag_s: float) -> None:
        """Add a sample taken now; samples older than the window (but the last) are dropped."""
        now = self._clock()
        self.samples.append(
            LoadSample(
                now,
                loop_lag_s,
                self._decode_backlog(),
                self._cpu_time(),
                self._calls(),
                self._cores_busy_time(),
                self._synthesis_backlog(),
                self._calls_in_turn(),
                self._model_cpu_time(),
            )
        )
        while len(self.samples) > 2 and now - self.samples[1].at >= self.settings.window_s:
            self.samples.popleft()
        self._learn_call_cost(now)

    def _learn_call_cost(self, now: float) -> None:
        """Once a window, if the same calls were live throughout it and at least half of them
        were in turns on average (:data:`IN_TURN_SHARE`): their CPU each. Calls sitting in
        silence between turns cost little, and a cost learned from them would let in more
        calls than fit once they all talk."""
        if self._costed_at is not None and now - self._costed_at < self.settings.window_s:
            return
        window = self._full_window()
        if window is None:
            return
        calls = {sample.calls for sample in self.samples}
        if len(calls) != 1 or not (count := calls.pop()):
            return
        in_turn = sum(sample.calls_in_turn for sample in self.samples) / len(self.samples)
        if in_turn < count * IN_TURN_SHARE:
            return
        first, last = window
        cpu = last.cpu_s - first.cpu_s - self._model_seconds(first, last)
        cost = cpu / (last.at - first.at) / count
        self.call_cost += COST_SMOOTHING * (cost - self.call_cost)
        self._costed_at = now

    def _full_window(self) -> tuple[LoadSample, LoadSample] | None:
        """The window's first and last samples, once they span (nearly) all of it."""
        samples = self.samples
        if len(samples) < 2 or samples[-1].at - samples[0].at < self.settings.window_s * 0.9:
            return None
        return samples[0], samples[-1]

    @staticmethod
    def _model_seconds(first: LoadSample, last: LoadSample) -> float:
        if first.model_cpu_s is None or last.model_cpu_s is None:
            return 0.0
        return max(0.0, last.model_cpu_s - first.model_cpu_s)

    def model_load(self) -> float:
        """The CPU the LLM run in the process took over the window, as a share of one core
        (0 without one, or until the window is full): counted apart from the calls' cost, and
        taken out of their room."""
        window = self._full_window()
        if window is None:
            return 0.0
        first, last = window
        return self._model_seconds(first, last) / (last.at - first.at)

    def others_load(self) -> float:
        """The CPU that other processes took over the window (on this process's cores, or in
        its control group), as a share of one core; 0 until the window is full or where it
        cannot be measured."""
        window = self._full_window()
        if window is None:
            return 0.0
        first, last = window
        if first.cores_busy_s is None or last.cores_busy_s is None:
            return 0.0
        busy = last.cores_busy_s - first.cores_busy_s
        own = last.cpu_s - first.cpu_s
        return max(0.0, (busy - own) / (last.at - first.at))

    def capacity(self) -> int | None:
        """How many calls fit, at their measured cost, in ``capacity_cpu_percent`` of the
        usable CPU, less what other processes sharing the limit take of it (at least one);
        None when that is not checked."""
        share = self.settings.capacity_cpu_percent
        if not share or self.call_cost <= 0:
            return None
        room = self.cores * share / 100 - self.model_load()
        if self.others_share_the_limit:
            room -= self.others_load()
        return max(1, math.floor(room / self.call_cost + 1e-9))

    def full(self, live_calls: int) -> Overload | None:
        """Why one more call than ``live_calls`` would not fit (:meth:`capacity`); None: it
        would."""
        capacity = self.capacity()
        if capacity is None or live_calls < capacity:
            return None
        others = self.others_load() if self.others_share_the_limit else 0.0
        model = self.model_load()
        reason = (
            f"{live_calls} calls fill it (about {capacity} fit, at "
            f"{self.call_cost * 100:.0f} % of a core each"
            + (f", the LLM taking {model * 100:.0f} % of one" if model >= 0.01 else "")
            + (f", other processes taking {others * 100:.0f} % of one" if others >= 0.01 else "")
            + ")"
        )
        return Overload(reason, max(RETRY_MIN_S, math.ceil(self.settings.window_s)))

    def measured(self) -> dict[str, float]:
        """The window's median loop lag (ms), smallest decode backlog, and the CPU of this
        process and of the others on its cores (% of the usable cores); empty until the window
        is full."""
        window = self._full_window()
        if window is None:
            return {}
        first, last = window
        samples = list(self.samples)
        lags = sorted(sample.loop_lag_s for sample in samples)
        cpu = (last.cpu_s - first.cpu_s) / (last.at - first.at) / self.cores * 100
        return {
            "loop_lag_ms": lags[len(lags) // 2] * 1000,
            "decode_backlog": min(sample.decode_backlog for sample in samples),
            "synthesis_backlog": min(sample.synthesis_backlog for sample in samples),
            "cpu_percent": cpu,
            "others_cpu_percent": self.others_load() / self.cores * 100,
        }

    def overload(self) -> Overload | None:
        """Why a new call would be refused now, and when to retry; None: admit it."""
        measured = self.measured()
        reason = self._reason(measured) if measured else None
        now = self._clock()
        if reason is None:
            self._overloaded_since = None
            return None
        if self._overloaded_since is None:
            self._overloaded_since = now
        lasted = now - self._overloaded_since
        retry = math.ceil(self.settings.window_s + lasted)
        return Overload(reason, min(RETRY_MAX_S, max(RETRY_MIN_S, retry)))

    def _reason(self, measured: dict[str, float]) -> str | None:
        limits = self.settings
        lag, backlog, cpu = (
            measured["loop_lag_ms"],
            measured["decode_backlog"],
            measured["cpu_percent"],
        )
        if limits.max_loop_lag_ms and lag > limits.max_loop_lag_ms:
            return f"event loop {lag:.0f} ms late (limit {limits.max_loop_lag_ms:.0f} ms)"
        if limits.max_decode_backlog and backlog > limits.max_decode_backlog:
            return f"{backlog:.0f} decodes waiting (limit {limits.max_decode_backlog})"
        waiting = measured["synthesis_backlog"]
        if limits.max_synthesis_backlog and waiting > limits.max_synthesis_backlog:
            return (
                f"{waiting:.0f} answers waiting for speech (limit {limits.max_synthesis_backlog})"
            )
        if limits.max_cpu_percent and cpu > limits.max_cpu_percent:
            return f"CPU at {cpu:.0f} % (limit {limits.max_cpu_percent:.0f} %)"
        return None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoadGauge]:
        """Sample while the block runs."""
        task = asyncio.create_task(self.run(), name="load-gauge")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
