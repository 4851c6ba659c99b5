"""The caller's Opus decoded by libopus itself, straight to the pipeline's rate.

aiortc decodes Opus through FFmpeg's libopus wrapper, which always asks libopus for 48 kHz; the
pipeline then resamples every caller frame to 16 kHz. libopus decodes to 8, 12, 16, 24 or
48 kHz natively (it leaves out the bands above the rate's), so asked for 16 kHz mono it gives
the pipeline its frames as they are: one C call a frame instead of a 48 kHz decode and a
resampler, the event loop's second largest cost per call after the agent's own encode.

The library is the system's ``libopus`` or, failing that, the copy PyAV's wheel carries; with
neither, :func:`narrow_opus_decoder` returns None and the caller keeps aiortc's decoder.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fractions
import functools
import logging
import weakref
from pathlib import Path

import av
from aiortc.codecs.opus import SAMPLE_RATE as OPUS_CLOCK_RATE  # RTP's clock, at any decode rate
from aiortc.jitterbuffer import JitterFrame

__all__ = ["NarrowOpusDecoder", "OpusDecodeError", "narrow_opus_decoder"]

log = logging.getLogger(__name__)

_MAX_FRAME_MS = 120
"""The longest Opus packet."""


class OpusDecodeError(ValueError):
    """libopus could not decode a packet (it is malformed)."""


class NarrowOpusDecoder:
    """One caller's Opus stream decoded to mono PCM16 at ``rate`` (8, 12, 16, 24 or 48 kHz).

    aiortc's decoder contract: :meth:`decode` takes one encoded frame and returns its audio
    frames (here one, of ``rate`` Hz, pts in ``1/rate``; none for an empty payload); a
    malformed packet raises :class:`OpusDecodeError`. Not thread-safe (one stream, one thread).
    """

    def __init__(self, library: ctypes.CDLL, rate: int) -> None:
        error = ctypes.c_int(0)
        state = library.opus_decoder_create(rate, 1, ctypes.byref(error))
        if error.value != 0 or not state:
            raise ValueError(
                f"libopus cannot decode at {rate} Hz: {_error_text(library, error.value)}"
            )
        self.rate = rate
        self._library = library
        self._state = state
        self._max_samples = rate * _MAX_FRAME_MS // 1000
        self._pcm = (ctypes.c_int16 * self._max_samples)()
        self._time_base = fractions.Fraction(1, rate)
        self._ticks_per_sample = OPUS_CLOCK_RATE // rate
        weakref.finalize(self, library.opus_decoder_destroy, state)

    def decode(self, encoded: JitterFrame) -> list[av.AudioFrame]:
        data = encoded.data
        if not data:  # libopus would conceal a lost packet, as long as the longest one
            return []
        samples = self._library.opus_decode(
            self._state, data, len(data), self._pcm, self._max_samples, 0
        )
        if samples < 0:
            raise OpusDecodeError(_error_text(self._library, samples))
        frame = av.AudioFrame(format="s16", layout="mono", samples=samples)
        frame.planes[0].update(ctypes.string_at(self._pcm, samples * 2))
        frame.sample_rate = self.rate
        frame.pts = encoded.timestamp // self._ticks_per_sample
        frame.time_base = self._time_base
        return [frame]


def narrow_opus_decoder(rate: int) -> NarrowOpusDecoder | None:
    """A :class:`NarrowOpusDecoder` at ``rate``, or None when no libopus could be loaded."""
    library = _libopus()
    return NarrowOpusDecoder(library, rate) if library is not None else None


@functools.cache
def _libopus() -> ctypes.CDLL | None:
    """The system's libopus, else PyAV's copy; None (said once) when neither loads."""
    wheel_copies = sorted((Path(av.__file__).parent.parent / "av.libs").glob("libopus-*.so*"))
    for candidate in [ctypes.util.find_library("opus"), *map(str, wheel_copies)]:
        if not candidate:
            continue
        try:
            library = ctypes.CDLL(candidate)
        except OSError:
            continue
        _declare(library)
        return library
    log.warning("no libopus to load: callers' Opus is decoded at 48 kHz and resampled")
    return None


def _declare(library: ctypes.CDLL) -> None:
    library.opus_decoder_create.argtypes = [
        ctypes.c_int32,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    library.opus_decoder_create.restype = ctypes.c_void_p
    library.opus_decode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int16),
        ctypes.c_int,
        ctypes.c_int,
    ]
    library.opus_decode.restype = ctypes.c_int
    library.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    library.opus_decoder_destroy.restype = None
    library.opus_strerror.argtypes = [ctypes.c_int]
    library.opus_strerror.restype = ctypes.c_char_p


def _error_text(library: ctypes.CDLL, code: int) -> str:
    text: bytes | None = library.opus_strerror(code)
    return text.decode() if text else f"error {code}"
