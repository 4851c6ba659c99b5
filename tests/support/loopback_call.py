"""An in-memory transport: plays caller audio into a session and records what the agent says.

It keeps one 20 ms clock for both directions, like a real transport: every tick feeds one caller
frame (silence when the script is empty) and pulls one agent frame from the speaker. ``speed``
above 1 runs faster than real time. ``echo=(gain_db, delay_ms)`` simulates a phone line that
returns the agent's own voice into the caller's audio. The tests' own transport.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

import numpy as np

from media import FRAME_BYTES, FRAME_MS, FrameSplitter
from media.audio import SAMPLE_RATE
from server.call.session import Session

__all__ = ["LoopbackCall"]


class LoopbackCall:
    """Drive ``session`` from a script of caller audio (16 kHz PCM16)."""

    def __init__(
        self, session: Session, speed: float = 1.0, echo: tuple[float, int] | None = None
    ) -> None:
        self.session = session
        self.speed = speed
        self._echo_gain = 0.0
        self._echo: deque[bytes] = deque()
        if echo is not None:
            if session.voice.speaker.sample_rate != SAMPLE_RATE:
                raise ValueError("echo needs a 16 kHz speaker")
            gain_db, delay_ms = echo
            self._echo_gain = 10 ** (gain_db / 20)
            self._echo.extend(bytes(FRAME_BYTES) for _ in range(delay_ms // FRAME_MS))
        self.recording = bytearray()
        """Everything the speaker sent, at its sample rate."""
        self.ticks = 0
        self._caller: deque[bytes] = deque()
        self._splitter = FrameSplitter(FRAME_BYTES)
        self._silence = bytes(FRAME_BYTES)
        self._task: asyncio.Task[None] | None = None
        self._tick_waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    @property
    def caller_idle(self) -> bool:
        """Whether all scripted caller audio has been sent."""
        return not self._caller

    def say(self, pcm: bytes) -> None:
        """Queue caller audio (16 kHz PCM16) after what is already queued."""
        self._caller.extend(self._splitter.push(pcm))
        rest = self._splitter.flush()
        if rest is not None:
            self._caller.append(rest)

    def start(self) -> None:
        self.session.start()
        self._task = asyncio.create_task(self._clock(), name=f"loopback:{self.session.id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.session.close()

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``condition()`` holds at a tick; raises TimeoutError after ``timeout_s``."""
        if condition():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (condition, future)
        self._tick_waiters.append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        finally:
            if entry in self._tick_waiters:
                self._tick_waiters.remove(entry)

    async def run_for(self, seconds: float) -> None:
        """Let ``seconds`` of call time pass."""
        target = self.ticks + round(seconds * 1000 / FRAME_MS)
        await self.wait_until(lambda: self.ticks >= target, seconds / self.speed * 4 + 5)

    async def _clock(self) -> None:
        loop = asyncio.get_running_loop()
        period = FRAME_MS / 1000 / self.speed
        next_tick = loop.time()
        while True:
            frame = self._caller.popleft() if self._caller else self._silence
            if self._echo_gain:
                frame = _mix(frame, self._echo.popleft(), self._echo_gain)
            self.session.feed(frame)
            played = self.session.voice.speaker.pull()
            self.recording += played
            if self._echo_gain:
                self._echo.append(played)
            self.ticks += 1
            for condition, future in list(self._tick_waiters):
                if not future.done() and condition():
                    future.set_result(None)
            next_tick += period
            await asyncio.sleep(max(0.0, next_tick - loop.time()))


def _mix(frame: bytes, echo: bytes, gain: float) -> bytes:
    mixed = np.frombuffer(frame, np.int16).astype(np.float32)
    mixed += np.frombuffer(echo, np.int16).astype(np.float32) * gain
    return np.clip(mixed, -32768, 32767).astype(np.int16).tobytes()
