"""The caller's Opus decoded by libopus itself, straight to the pipeline's rate.

aiortc decodes Opus through FFmpeg's libopus wrapper, which always asks libopus for 48 kHz; the
pipeline then resamples every caller frame to 16 kHz. Asked for 16 kHz mono
(:class:`media.opus.OpusDecoder`), libopus gives the pipeline its frames as they are: one C
call a frame instead of a 48 kHz decode and a resampler, the event loop's second largest cost
per call after the agent's own encode. With no libopus to load, :func:`narrow_opus_decoder`
returns None and the caller keeps aiortc's decoder.
"""

from __future__ import annotations

import ctypes
import fractions

import av
from aiortc.jitterbuffer import JitterFrame

from media.opus import OPUS_CLOCK_RATE, OpusDecoder, OpusError, load_libopus

__all__ = ["NarrowOpusDecoder", "OpusDecodeError", "narrow_opus_decoder"]

OpusDecodeError = OpusError
"""libopus could not decode a packet (it is malformed)."""


class NarrowOpusDecoder:
    """One caller's Opus stream decoded to mono PCM16 at ``rate`` (8, 12, 16, 24 or 48 kHz).

    aiortc's decoder contract: :meth:`decode` takes one encoded frame and returns its audio
    frames (here one, of ``rate`` Hz, pts in ``1/rate``; none for an empty payload); a
    malformed packet raises :class:`OpusDecodeError`. Not thread-safe (one stream, one thread).
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._decoder = OpusDecoder(rate)
        self._time_base = fractions.Fraction(1, rate)
        self._ticks_per_sample = OPUS_CLOCK_RATE // rate

    def decode(self, encoded: JitterFrame) -> list[av.AudioFrame]:
        data = encoded.data
        if not data:  # libopus would conceal a lost packet, as long as the longest one
            return []
        pcm, samples = self._decoder.decode_into(data)
        frame = av.AudioFrame(format="s16", layout="mono", samples=samples)
        frame.planes[0].update(ctypes.string_at(pcm, samples * 2))
        frame.sample_rate = self.rate
        frame.pts = encoded.timestamp // self._ticks_per_sample
        frame.time_base = self._time_base
        return [frame]


def narrow_opus_decoder(rate: int) -> NarrowOpusDecoder | None:
    """A :class:`NarrowOpusDecoder` at ``rate``, or None when no libopus could be loaded."""
    return NarrowOpusDecoder(rate) if load_libopus() is not None else None
