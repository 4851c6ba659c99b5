"""One call's recording: a stereo WAV (caller left, agent right) and a JSON Lines transcript.

The event loop only hands chunks over (:meth:`CallRecorder.caller`, :meth:`CallRecorder.agent`,
:meth:`CallRecorder.event`: a non-blocking put on a bounded queue); a writer thread of the call
places the audio on one timeline and writes both files. Each chunk is placed at the time it was
handed over, in samples since the recording started, so both channels stay aligned and silence
fills the gaps (a transport may pull nothing while the agent is quiet, the caller's frames may
stop). What the agent channel holds is what left the speaker for the transport: a paused or cut
answer shows as silence from that frame on.

A write that fails (full disk, removed directory, any ``OSError``) ends the recording, not the
call: the files keep what was written, and ``on_failure`` is called once on the event loop. So
does a writer that falls ``MAX_BACKLOG`` chunks behind: memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal, TextIO

import numpy as np

from media import Resampler

from .events import VoiceEvent

__all__ = ["MAX_BACKLOG", "RECORDING_RATE", "CallRecorder", "FailureReason", "StereoTimeline"]

log = logging.getLogger(__name__)

RECORDING_RATE = 16_000
"""Samples per second of each channel of the WAV (the caller's own rate)."""
MAX_BACKLOG = 1000
"""Chunks (20 ms each, either direction, or events) the writer may fall behind, about 10 s of a
call: past it the recording stops (a few MB at most are ever held)."""
RESYNC_S = 0.2
"""A chunk handed over this much later than its channel's audio so far reaches starts after
silence (nothing was sent meanwhile); less is jitter, or a burst after the event loop stalled,
and the audio stays contiguous. A silent chunk handed over this much earlier is dropped: the
channel catches up with the clock after a stall longer than this."""
SLACK_S = 0.5
"""A channel that hands nothing over while the other goes on is filled with silence up to this
far behind it, so the WAV is written as the call goes rather than at its end."""

FailureReason = Literal["write", "behind"]
_END = object()
_MODE = 0o600


class StereoTimeline:
    """Two mono PCM16 channels at RECORDING_RATE placed by sample position; :meth:`take` gives
    the interleaved stereo both channels have reached."""

    def __init__(self) -> None:
        self.written = 0
        """Samples (per channel) handed out by :meth:`take`."""
        self._pending = [bytearray(), bytearray()]
        self._latest = 0

    def end(self, channel: int) -> int:
        return self.written + len(self._pending[channel]) // 2

    def place(self, channel: int, at_sample: int, pcm: bytes) -> None:
        """Add ``pcm`` to ``channel``, handed over at ``at_sample``."""
        end = self.end(channel)
        resync = RESYNC_S * RECORDING_RATE
        if at_sample > end + resync:
            self._pending[channel] += bytes((at_sample - end) * 2)
        elif at_sample < end - resync and pcm.count(0) == len(pcm):
            return
        self._pending[channel] += pcm
        self._latest = max(self._latest, at_sample + len(pcm) // 2)
        floor = self._latest - int(SLACK_S * RECORDING_RATE)
        for other in (0, 1):
            gap = floor - self.end(other)
            if gap > 0:
                self._pending[other] += bytes(gap * 2)

    def take(self, *, everything: bool = False) -> bytes:
        """Interleaved stereo up to where both channels reach (``everything``: the longer one
        is reached with silence first)."""
        if everything:
            longest = max(self.end(0), self.end(1))
            for channel in (0, 1):
                self._pending[channel] += bytes((longest - self.end(channel)) * 2)
        count = min(self.end(0), self.end(1)) - self.written
        if count <= 0:
            return b""
        stereo = np.empty((count, 2), dtype=np.int16)
        for channel in (0, 1):
            stereo[:, channel] = np.frombuffer(self._pending[channel], np.int16, count)
            del self._pending[channel][: count * 2]
        self.written += count
        return stereo.tobytes()


class CallRecorder:
    """Records one call into ``wav_path`` and ``jsonl_path`` (created 0600; they must not
    exist). ``header`` opens the transcript. Hand-over methods run on the event loop and never
    block; ``on_failure(reason, message)`` runs there too, at most once."""

    def __init__(
        self,
        wav_path: Path,
        jsonl_path: Path,
        header: dict[str, Any],
        on_failure: Callable[[FailureReason, str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_backlog: int = MAX_BACKLOG,
    ) -> None:
        self.wav_path = wav_path
        self.jsonl_path = jsonl_path
        self.clock = clock
        self.started_at = clock()
        self.failed: FailureReason | None = None
        self._header = header
        self._on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        self._queue: queue.Queue[Any] = queue.Queue(max_backlog)
        self._open = True
        self._ending = threading.Event()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._write_all, name=f"recorder:{wav_path.stem}", daemon=True
        )
        self._thread.start()

    # -- on the event loop ---------------------------------------------------------------------

    def caller(self, pcm: bytes) -> None:
        """A caller frame (16 kHz PCM16 mono) as it arrives."""
        self._put(("audio", 0, self.clock(), pcm, RECORDING_RATE))

    def agent(self, pcm: bytes, sample_rate: int) -> None:
        """An agent frame (PCM16 mono at ``sample_rate``) as it leaves for the transport."""
        self._put(("audio", 1, self.clock(), pcm, sample_rate))

    def event(self, event: VoiceEvent) -> None:
        self._put(("event", event))

    def close(self) -> None:
        """Stop recording; the writer finishes the files in the background (:meth:`wait`).
        Idempotent."""
        if not self._open:
            return
        self._open = False
        self._ending.set()
        with contextlib.suppress(queue.Full):  # then it sees ``_ending`` once drained
            self._queue.put_nowait(_END)

    @property
    def done(self) -> bool:
        """Whether the writer has finished."""
        return self._done.done()

    async def wait(self) -> None:
        """Until the writer has finished (the files are complete, or the recording failed)."""
        await asyncio.shield(self._done)

    def _put(self, item: tuple[Any, ...]) -> None:
        if not self._open:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._fail("behind", "the recorder fell behind the call")

    def _fail(self, reason: FailureReason, message: str) -> None:
        if self.failed is not None:
            return
        self.failed = reason
        self.close()
        self._on_failure(reason, message)

    # -- on the writer thread --------------------------------------------------------------------

    def _write_all(self) -> None:
        try:
            with _WavFile(self.wav_path) as wav, _open_text(self.jsonl_path) as lines:
                self._drain(wav, lines)
        except OSError as exc:
            log.error("recording %s failed: %s", self.wav_path, exc)
            self._loop.call_soon_threadsafe(
                self._fail, "write", "the recording could not be written"
            )
        finally:
            self._loop.call_soon_threadsafe(_resolve, self._done)

    def _drain(self, wav: _WavFile, lines: TextIO) -> None:
        timeline = StereoTimeline()
        resamplers: dict[int, Resampler] = {}
        lines.write(json.dumps({"type": "recording_started", "call_ms": 0, **self._header}) + "\n")
        while True:
            item = self._queue.get()
            if item is _END:
                break
            if item[0] == "audio":
                _, channel, at, pcm, rate = item
                if rate != RECORDING_RATE:
                    resampler = resamplers.get(rate)
                    if resampler is None:
                        resampler = resamplers[rate] = Resampler(rate, RECORDING_RATE)
                    pcm = resampler.resample(pcm)
                timeline.place(channel, round((at - self.started_at) * RECORDING_RATE), pcm)
                wav.write(timeline.take())
            else:
                event: VoiceEvent = item[1]
                call_ms = round((event.t - self.started_at) * 1000, 1)
                lines.write(json.dumps({**event.to_dict(), "call_ms": call_ms}) + "\n")
                lines.flush()
            if self._ending.is_set() and self._queue.empty():
                break
        wav.write(timeline.take(everything=True))
        duration_ms = round(timeline.written / RECORDING_RATE * 1000)
        lines.write(json.dumps({"type": "recording_ended", "duration_ms": duration_ms}) + "\n")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _create(path: Path) -> int:
    """A new file readable by its owner only (refuses an existing one)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _MODE)


def _open_text(path: Path) -> TextIO:
    return open(_create(path), "w", encoding="utf-8")


class _WavFile:
    """A PCM16 stereo WAV at RECORDING_RATE whose header is brought up to date about once a
    second, so a recording cut short by a crash still plays up to then."""

    def __init__(self, path: Path) -> None:
        self._file: BinaryIO = open(_create(path), "wb")  # noqa: SIM115  # closed by __exit__
        self._data_bytes = 0
        self._unpatched = 0
        self._file.write(self._header())

    def _header(self) -> bytes:
        channels, width = 2, 2
        return b"".join(
            [
                b"RIFF",
                struct.pack("<I", 36 + self._data_bytes),
                b"WAVEfmt ",
                struct.pack(
                    "<IHHIIHH",
                    16,
                    1,
                    channels,
                    RECORDING_RATE,
                    RECORDING_RATE * channels * width,
                    channels * width,
                    8 * width,
                ),
                b"data",
                struct.pack("<I", self._data_bytes),
            ]
        )

    def write(self, stereo: bytes) -> None:
        if not stereo:
            return
        self._file.write(stereo)
        self._data_bytes += len(stereo)
        self._unpatched += len(stereo)
        if self._unpatched >= RECORDING_RATE * 4:
            self._patch()

    def _patch(self) -> None:
        self._unpatched = 0
        self._file.seek(0)
        self._file.write(self._header())
        self._file.seek(0, os.SEEK_END)
        self._file.flush()

    def __enter__(self) -> _WavFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._patch()
        finally:
            self._file.close()
