"""The caller's audio from aiortc's receiver to the call's track without delay or thread hops.

aiortc's audio receiver holds each packet in its jitter buffer until four more have arrived
(80 ms), then hands it to a decoder thread of its own, which decodes Opus to 48 kHz stereo and
posts each frame back to the event loop. A playout device needs that; the server's listener is
the VAD, which needs the audio in order and at once. :func:`hear_promptly` gives a receiver a
buffer that releases each packet as it arrives (:class:`PromptAudioBuffer`) and decodes it on
the event loop, to mono at the pipeline's 16 kHz (:class:`LoopDecoder`): one libopus call a
frame instead of a decode, two cross-thread hand-overs, a stereo frame and a resampling per
call, 50 times a second each. With 16 calls the receivers' threads took the GIL from the event
loop 800 times a second.

Both replace private members of ``RTCRtpReceiver`` (aiortc 1.16; pyproject.toml pins the minor
release), before media flows; when a member is not where it was, :func:`hear_promptly` leaves
aiortc's own in place and says so.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

import av
from aiortc import RTCRtpReceiver
from aiortc.codecs import get_decoder
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.utils import uint16_add

from media.audio import SAMPLE_RATE

from .libopus import OpusDecodeError, narrow_opus_decoder

__all__ = ["LoopDecoder", "PromptAudioBuffer", "decode_on_loop", "hear_promptly"]

log = logging.getLogger(__name__)

_JITTER_BUFFER = "_RTCRtpReceiver__jitter_buffer"
_DECODER_QUEUE = "_RTCRtpReceiver__decoder_queue"
_STARTED = "_RTCRtpReceiver__started"


class PromptAudioBuffer(JitterBuffer):
    """An audio jitter buffer that holds nothing: each packet is released as it arrives.

    aiortc's audio buffer holds every packet until four more have arrived (80 ms), and even
    with no prefetch until the next one does (20 ms), since a video frame spans packets. The
    server's listener is the VAD, which needs order and promptness, not smooth playout: every
    20 ms held delays the end of the caller's turn and a barge-in by as much.

    Contract (the one aiortc's receiver relies on): ``add(packet)`` returns at most one frame,
    here the packet just added when it is newer than every packet released so far. A packet
    that arrives after a newer one (reordered, or duplicated) is dropped, and a lost one is
    never waited for: either costs 20 ms of the caller's audio and never any delay.
    """

    def __init__(self, capacity: int = 16) -> None:
        super().__init__(capacity=capacity)

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        origin = self._origin
        assert origin is not None  # add() set it
        self.remove(uint16_add(sequence_number, -origin))  # the hole before it, if any
        packet = self._packets[sequence_number % self._capacity]
        self.remove(1)
        if packet is None:  # pragma: no cover - add() stored it just now
            return None
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]


class LoopDecoder:
    """Stands in for a receiver's decoder queue: each frame put is decoded there and then, on
    the event loop, and its audio goes straight to the track's queue.

    aiortc's receiver still starts its decoder thread with this object as its queue; the thread
    waits in :meth:`get` until the receiver stops (``put(None)``), then ends the track as it
    always did. Opus is decoded to mono (the pipeline's channel count; libopus mixes a stereo
    stream down itself), at ``opus_rate`` by libopus itself where it loads
    (:mod:`.libopus`), else at 48 kHz by aiortc's decoder; other codecs by aiortc's decoders.
    A frame that fails to decode is skipped (20 ms of the caller's audio), as aiortc skips it.
    """

    def __init__(self, track_queue: asyncio.Queue[Any], *, opus_rate: int | None = None) -> None:
        self._frames = track_queue
        self._opus_rate = opus_rate
        self._codec: str | None = None
        self._decoder: Any = None
        self._stopped = threading.Event()
        self._failures = 0

    def put(self, task: tuple[RTCRtpCodecParameters, JitterFrame] | None) -> None:
        """Decode one encoded frame (the receiver calls this on the event loop); None: the
        receiver stops."""
        if task is None:
            self._stopped.set()
            return
        codec, encoded = task
        if codec.name != self._codec:
            self._decoder = self._decoder_for(codec)
            self._codec = codec.name
        try:
            frames = self._decoder.decode(encoded)
        except (av.FFmpegError, OpusDecodeError) as exc:
            self._failures += 1
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            log.log(level, "a caller's %s frame did not decode (%d so far): %s", codec.name,
                    self._failures, exc)  # fmt: skip
            return
        for frame in frames:
            self._frames.put_nowait(frame)

    def _decoder_for(self, codec: RTCRtpCodecParameters) -> Any:
        if codec.name.lower() != "opus":
            return get_decoder(codec)
        narrow = narrow_opus_decoder(self._opus_rate) if self._opus_rate else None
        return narrow or _MonoOpusDecoder()

    def get(self, block: bool = True, timeout: float | None = None) -> None:
        """Where aiortc's decoder thread waits (``queue.Queue.get``'s contract): until the
        receiver stops, then None, which makes the thread end the track; ``queue.Empty`` if
        ``timeout`` passes first."""
        if not self._stopped.wait(timeout if block else 0):
            raise queue.Empty


class _MonoOpusDecoder(OpusDecoder):
    """aiortc's Opus decoder, to one channel instead of two (libopus opens at the first frame,
    with the layout set here)."""

    def __init__(self) -> None:
        super().__init__()
        self.codec.layout = "mono"


def hear_promptly(receiver: RTCRtpReceiver) -> bool:
    """Give an audio receiver a :class:`PromptAudioBuffer` and a :class:`LoopDecoder` in place
    of aiortc's buffer and decoder thread. Call before media flows (after the remote
    description, before the local one). False, with a warning, if either could not be replaced
    (this aiortc keeps it elsewhere, or the receiver already runs): that part stays aiortc's."""
    current = getattr(receiver, _JITTER_BUFFER, None)
    prompt = isinstance(current, JitterBuffer) and current.capacity == 16  # aiortc's audio one
    if prompt:
        setattr(receiver, _JITTER_BUFFER, PromptAudioBuffer(capacity=16))
    else:
        log.warning("cannot shorten the inbound jitter buffer of this aiortc version")
    return decode_on_loop(receiver, opus_rate=SAMPLE_RATE) and prompt


def decode_on_loop(receiver: RTCRtpReceiver, *, opus_rate: int | None = None) -> bool:
    """Give a receiver a :class:`LoopDecoder` (decoding Opus at ``opus_rate``, default 48 kHz)
    in place of aiortc's decoder thread (its jitter buffer stays). Call before media flows;
    False, with a warning, if it could not be done."""
    track_queue = getattr(receiver.track, "_queue", None)
    if (
        getattr(receiver, _STARTED, True)
        or not hasattr(receiver, _DECODER_QUEUE)
        or not isinstance(track_queue, asyncio.Queue)
    ):
        log.warning("cannot decode the caller's audio on the event loop with this aiortc")
        return False
    setattr(receiver, _DECODER_QUEUE, LoopDecoder(track_queue, opus_rate=opus_rate))
    return True
