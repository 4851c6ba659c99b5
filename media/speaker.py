"""The outbound audio queue of one call, pulled by its transport one frame at a time.

``push()`` queues PCM (resampled to the speaker's rate) and returns a :class:`Playback` handle that
resolves when its last frame has left, or when ``clear()`` drops it (then it says how much was
played). Transports call ``pull()`` on their own 20 ms clock and get silence when nothing is queued.
All methods run on the event loop thread.

Two things keep queued audio waiting, and they are kept apart: a *hold* (``hold()``/``release()``)
for an answer prepared before it may play, and a *pause* (``pause()``/``resume()``) of an answer
the caller talked over. They differ in what goes downstream: a pause tells the transport to drop
what it buffered of our audio, a hold does not (that audio belongs to an earlier answer).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .audio import FRAME_MS, Resampler, frame_bytes, pcm_rms_dbfs

__all__ = ["LEVEL_HISTORY_MS", "SILENT_DBFS", "Playback", "PlaybackResult", "Speaker"]

LEVEL_HISTORY_MS = 1000
SILENT_DBFS = -120.0


@dataclass(frozen=True)
class PlaybackResult:
    completed: bool
    """False when ``clear()`` cut it short (or dropped it before it started)."""
    played_ms: float
    total_ms: float


class Playback:
    """One pushed piece of audio on its way out."""

    def __init__(self, pcm: bytes, sample_rate: int, clock: Callable[[], float]) -> None:
        self.pcm = pcm
        self.sample_rate = sample_rate
        self.sent_bytes = 0
        self.started_at: float | None = None
        """Clock time the first frame carrying this audio left (None until then)."""
        self._clock = clock
        loop = asyncio.get_running_loop()
        self._started: asyncio.Future[float | None] = loop.create_future()
        self._done: asyncio.Future[PlaybackResult] = loop.create_future()

    @property
    def total_ms(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate * 1000

    @property
    def played_ms(self) -> float:
        return self.sent_bytes / 2 / self.sample_rate * 1000

    @property
    def done(self) -> bool:
        return self._done.done()

    async def started(self) -> float | None:
        """Wait until the first frame left; its clock time, or None if cleared before that."""
        return await asyncio.shield(self._started)

    async def finished(self) -> PlaybackResult:
        return await asyncio.shield(self._done)

    def add_start_callback(self, callback: Callable[[float | None], None]) -> None:
        """Call ``callback(started_at)`` when the first frame leaves (None: cleared before)."""
        self._started.add_done_callback(lambda future: callback(future.result()))

    def add_done_callback(self, callback: Callable[[PlaybackResult], None]) -> None:
        self._done.add_done_callback(lambda future: callback(future.result()))

    def _mark_started(self) -> None:
        if self.started_at is None:
            self.started_at = self._clock()
            self._started.set_result(self.started_at)

    def _finish(self, completed: bool) -> None:
        if not self._started.done():
            self._started.set_result(None)
        if not self._done.done():
            self._done.set_result(PlaybackResult(completed, self.played_ms, self.total_ms))


class Speaker:
    """Frames of ``frame_ms`` PCM16 mono at ``sample_rate`` for a transport to send."""

    def __init__(
        self,
        sample_rate: int,
        frame_ms: int = FRAME_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sample_rate = sample_rate
        self.frame_ms = frame_ms
        self.frame_bytes = frame_bytes(sample_rate, frame_ms)
        self.clock = clock
        self._queue: deque[Playback] = deque()
        self._resamplers: dict[int, Resampler] = {}
        self._silence = bytes(self.frame_bytes)
        self.frames_out = 0
        self.paused = False
        """Paused by :meth:`pause` (the caller talked over the answer): ``pull()`` gives silence
        and queued audio waits where it stopped."""
        self.held = False
        """Held by :meth:`hold` (an answer prepared before it may play): ``pull()`` gives silence
        and queued audio waits until :meth:`release`."""
        self.levels: deque[float] = deque(maxlen=max(1, LEVEL_HISTORY_MS // frame_ms))
        """dBFS of the most recent frames sent (newest last), for echo suppression."""
        self.on_clear: list[Callable[[], None]] = []
        """Transport hooks run by ``clear()``, ``drop()`` and ``pause()`` when audio went out
        since they last ran, e.g. a media WebSocket's ``clear`` message."""
        self.taps: list[Callable[[bytes], None]] = []
        """Observers of each frame ``pull()`` hands out, silence included (e.g. a call
        recorder): what the transport sends, after pauses and clears. They run on the event
        loop: quick."""
        self._sent_since_flush = False

    @property
    def busy(self) -> bool:
        """Whether audio is queued or playing."""
        return bool(self._queue)

    @property
    def queued_ms(self) -> float:
        """Audio queued and not yet sent, in ms (a pause or hold aside)."""
        unsent = sum(len(playback.pcm) - playback.sent_bytes for playback in self._queue)
        return unsent / self.frame_bytes * self.frame_ms

    def push(self, pcm: bytes, sample_rate: int) -> Playback:
        """Queue PCM16 mono at ``sample_rate``; returns its handle."""
        if sample_rate != self.sample_rate:
            resampler = self._resamplers.get(sample_rate)
            if resampler is None:
                resampler = self._resamplers[sample_rate] = Resampler(sample_rate, self.sample_rate)
            pcm = resampler.resample(pcm)
        playback = Playback(pcm, self.sample_rate, self.clock)
        if pcm:
            self._queue.append(playback)
        else:
            playback._finish(completed=True)
        return playback

    def pause(self) -> None:
        """Stop mid-answer: silence goes out until :meth:`resume` (or ``clear()``), and queued
        audio waits where it stopped. The ``on_clear`` hooks run if audio went out since they
        last ran, so transports drop what they buffered downstream (and say nothing when there
        is nothing to drop)."""
        if self.paused:
            return
        self.paused = True
        self._flush_downstream()

    def resume(self) -> None:
        """Play on from the sample where :meth:`pause` stopped (a hold stays)."""
        self.paused = False

    def hold(self) -> None:
        """Keep audio still to come (an answer prepared before it may play) until
        :meth:`release` (or ``clear()``). Unlike :meth:`pause`, nothing downstream is dropped,
        since what went out before belongs to an earlier answer, and a later ``clear()`` leaves
        it alone too."""
        self.held = True
        self._sent_since_flush = False

    def release(self) -> None:
        """Let held audio play (a pause stays)."""
        self.held = False

    def pull(self) -> bytes:
        """The next frame: queued audio, padded with silence at the end, or silence (also while
        paused or held)."""
        if not self._queue or self.paused or self.held:
            self.levels.append(SILENT_DBFS)
            for tap in self.taps:
                tap(self._silence)
            return self._silence
        frame = bytearray()
        while self._queue and len(frame) < self.frame_bytes:
            head = self._queue[0]
            head._mark_started()
            take = min(self.frame_bytes - len(frame), len(head.pcm) - head.sent_bytes)
            frame += head.pcm[head.sent_bytes : head.sent_bytes + take]
            head.sent_bytes += take
            if head.sent_bytes >= len(head.pcm):
                self._queue.popleft()
                head._finish(completed=True)
        self.frames_out += 1
        self._sent_since_flush = True
        out = bytes(frame.ljust(self.frame_bytes, b"\0"))
        self.levels.append(pcm_rms_dbfs(out))
        for tap in self.taps:
            tap(out)
        return out

    def clear(self) -> list[PlaybackResult]:
        """Drop everything queued at once and lift any hold or pause: the speaker is idle. Every
        pending handle resolves as not completed with how much of it was played, and the
        ``on_clear`` hooks run if audio went out since they last ran. Returns those results in
        queue order."""
        self.paused = self.held = False
        return self.drop()

    def drop(self) -> list[PlaybackResult]:
        """Drop everything queued, like :meth:`clear`, but leave a hold or a pause in place: the
        answer goes on, and what it queues next waits as its audio did."""
        dropped = list(self._queue)
        self._queue.clear()
        self._resamplers.clear()  # their filter tails belong to the dropped audio
        for playback in dropped:
            playback._finish(completed=False)
        self._flush_downstream()
        return [PlaybackResult(False, p.played_ms, p.total_ms) for p in dropped]

    def _flush_downstream(self) -> None:
        """Run the ``on_clear`` hooks, unless no audio went out since they last ran."""
        if not self._sent_since_flush:
            return
        self._sent_since_flush = False
        for hook in self.on_clear:
            hook()

    def close(self) -> None:
        """The call is over: free the resamplers now. Each holds an ffmpeg filter graph with
        its own worker threads (two on two cores), which would otherwise live until the garbage
        collector reaches the ended call. Pulling still gives silence; a later push resamples
        afresh."""
        self._resamplers.clear()
