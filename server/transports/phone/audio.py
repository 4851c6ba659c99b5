"""Pieces shared by the telephone transports: inbound audio to 16 kHz frames, a paced sender.

Phone audio arrives as G.711 (8 kHz) or signed linear PCM at 8 or 16 kHz; :class:`CallerAudio`
turns it into the pipeline's 20 ms 16 kHz frames with a real resampler. :class:`FramePacer` pulls
the speaker on a steady 20 ms clock for transports that do not pull by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from media import FRAME_BYTES, FRAME_MS, FrameSplitter, Resampler, Speaker
from media.audio import SAMPLE_RATE
from media.g711 import alaw_to_pcm, pcm_to_alaw, pcm_to_ulaw, ulaw_to_pcm

__all__ = ["CallerAudio", "CallerGap", "Encoding", "FramePacer", "encode"]

log = logging.getLogger(__name__)

Encoding = Literal["ulaw", "alaw", "slin"]


class CallerGap:
    """Silence for the session while the caller's audio does not arrive.

    Phones and gateways may stop sending while the caller is quiet (silence suppression, comfort
    noise, a stream that ended); the session hears time pass only through frames, so without them
    it would never see the end of a turn. Call :meth:`heard` on each arrival of caller audio and
    :meth:`tick` every 20 ms (``FramePacer(on_tick=...)``): after ``gap_s`` without audio, each
    tick feeds one silent frame. ``gap_s`` stays well above the stalls of a busy event loop, so
    late audio is not taken for a gap (silence would then split the caller's words).
    """

    def __init__(self, feed: Callable[[bytes, float], None], gap_s: float = 0.5) -> None:
        self.feed = feed
        self.gap_s = gap_s
        self.last_heard_at = time.monotonic()
        self._silence = bytes(FRAME_BYTES)

    def heard(self) -> None:
        self.last_heard_at = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_heard_at > self.gap_s:
            self.feed(self._silence, now)


class CallerAudio:
    """Caller audio in ``encoding`` at ``sample_rate`` -> 20 ms frames of 16 kHz PCM16."""

    def __init__(self, encoding: Encoding, sample_rate: int) -> None:
        self.encoding = encoding
        self._resampler = Resampler(sample_rate, SAMPLE_RATE, aligned=True)
        self._splitter = FrameSplitter(FRAME_BYTES)

    def frames(self, payload: bytes) -> list[bytes]:
        match self.encoding:
            case "ulaw":
                pcm = ulaw_to_pcm(payload)
            case "alaw":
                pcm = alaw_to_pcm(payload)
            case "slin":
                pcm = payload[: len(payload) // 2 * 2]
        return self._splitter.push(self._resampler.resample(pcm))


def encode(pcm: bytes, encoding: Encoding) -> bytes:
    """PCM16 -> the wire encoding."""
    match encoding:
        case "ulaw":
            return pcm_to_ulaw(pcm)
        case "alaw":
            return pcm_to_alaw(pcm)
        case "slin":
            return pcm


class FramePacer:
    """Every ``frame_ms``, hand the speaker's next frame to ``send``.

    With ``when_idle="skip"`` nothing is sent while the agent is quiet (media WebSocket,
    AudioSocket); with ``"silence"`` silence frames keep the stream steady (RTP). The clock does not
    drift: it sleeps to absolute deadlines, and skips ahead rather than bursting after a stall.
    """

    def __init__(
        self,
        speaker: Speaker,
        send: Callable[[bytes], Awaitable[None]],
        when_idle: Literal["skip", "silence"] = "skip",
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.speaker = speaker
        self.send = send
        self.when_idle = when_idle
        self.on_tick = on_tick
        """Also run every tick (a :class:`CallerGap`)."""
        self.frames_sent = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        period = FRAME_MS / 1000
        deadline = loop.time()
        while True:
            if self.speaker.busy or self.when_idle == "silence":
                await self.send(self.speaker.pull())
                self.frames_sent += 1
            if self.on_tick is not None:
                self.on_tick()
            deadline += period
            delay = deadline - loop.time()
            if delay < -5 * period:  # a long stall: resynchronise instead of bursting
                deadline = loop.time()
                delay = 0
            await asyncio.sleep(max(0.0, delay))
