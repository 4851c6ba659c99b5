"""libopus itself, through ctypes: Opus encoded and decoded at the rate the pipeline wants.

libopus decodes to 8, 12, 16, 24 or 48 kHz natively (it leaves out the bands above the rate's)
and encodes from those rates, so a 16 kHz pipeline needs no 48 kHz step either way. The
library is the system's ``libopus`` or, failing that, the copy PyAV's wheel carries
(:func:`load_libopus`; None when neither loads).

An Opus stream's RTP clock is 48 kHz whatever the rate of its audio (RFC 7587).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import weakref
from pathlib import Path

import av

__all__ = ["OPUS_CLOCK_RATE", "OpusDecoder", "OpusEncoder", "OpusError", "load_libopus"]

log = logging.getLogger(__name__)

OPUS_CLOCK_RATE = 48000
"""RTP's clock for Opus, at any audio rate."""
_MAX_FRAME_MS = 120
"""The longest Opus packet."""
_MAX_PACKET = 1500
_APPLICATION_VOIP = 2048
_SET_BITRATE = 4002


class OpusError(ValueError):
    """libopus refused: a malformed packet, or a rate it does not take; the text says which."""


@functools.cache
def load_libopus() -> ctypes.CDLL | None:
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
    log.warning("no libopus to load")
    return None


def _require() -> ctypes.CDLL:
    library = load_libopus()
    if library is None:
        raise OpusError("no libopus to load")
    return library


class OpusEncoder:
    """Mono PCM16 at ``rate`` (8, 12, 16, 24 or 48 kHz) to Opus packets of ``frame_ms``, tuned
    for speech (``OPUS_APPLICATION_VOIP``) at ``bitrate`` bits/s. One stream, one thread."""

    def __init__(self, rate: int, frame_ms: int = 20, bitrate: int = 32000) -> None:
        library = _require()
        error = ctypes.c_int(0)
        state = library.opus_encoder_create(rate, 1, _APPLICATION_VOIP, ctypes.byref(error))
        if error.value != 0 or not state:
            raise OpusError(f"libopus cannot encode at {rate} Hz: {error_text(error.value)}")
        # variadic: every argument typed here (an untyped pointer would be cut to an int)
        library.opus_encoder_ctl(
            ctypes.c_void_p(state), ctypes.c_int(_SET_BITRATE), ctypes.c_int32(bitrate)
        )
        self.rate = rate
        self.samples_per_frame = rate * frame_ms // 1000
        self._library = library
        self._state = state
        self._out = ctypes.create_string_buffer(_MAX_PACKET)
        weakref.finalize(self, library.opus_encoder_destroy, state)

    def encode(self, pcm: bytes) -> bytes:
        """One frame (``samples_per_frame`` samples) as one packet."""
        samples = (ctypes.c_int16 * self.samples_per_frame).from_buffer_copy(
            pcm[: self.samples_per_frame * 2].ljust(self.samples_per_frame * 2, b"\0")
        )
        size = self._library.opus_encode(
            self._state, samples, self.samples_per_frame, self._out, _MAX_PACKET
        )
        if size < 0:
            raise OpusError(error_text(size))
        return self._out.raw[:size]


class OpusDecoder:
    """Opus packets to mono PCM16 at ``rate`` (8, 12, 16, 24 or 48 kHz). One stream, one
    thread."""

    def __init__(self, rate: int) -> None:
        library = _require()
        error = ctypes.c_int(0)
        state = library.opus_decoder_create(rate, 1, ctypes.byref(error))
        if error.value != 0 or not state:
            raise OpusError(f"libopus cannot decode at {rate} Hz: {error_text(error.value)}")
        self.rate = rate
        self._library = library
        self._state = state
        self._max_samples = rate * _MAX_FRAME_MS // 1000
        self._pcm = (ctypes.c_int16 * self._max_samples)()
        weakref.finalize(self, library.opus_decoder_destroy, state)

    def decode(self, packet: bytes) -> bytes:
        """One packet's audio; raises :class:`OpusError` for a malformed one."""
        return ctypes.string_at(self._pcm, self._decode(packet, self._max_samples) * 2)

    def conceal(self, samples: int) -> bytes:
        """libopus's own concealment of ``samples`` lost samples (whole frames)."""
        return ctypes.string_at(self._pcm, self._decode(None, samples) * 2)

    def decode_into(self, packet: bytes) -> tuple[ctypes.Array[ctypes.c_int16], int]:
        """One packet decoded into this decoder's own buffer: (the buffer, samples), valid
        until the next call (no copy)."""
        return self._pcm, self._decode(packet, self._max_samples)

    def _decode(self, packet: bytes | None, samples: int) -> int:
        """Samples decoded into the buffer (None: concealed); raises :class:`OpusError`."""
        size = 0 if packet is None else len(packet)
        samples = min(samples, self._max_samples)
        decoded = self._library.opus_decode(self._state, packet, size, self._pcm, samples, 0)
        if decoded < 0:
            raise OpusError(error_text(decoded))
        return int(decoded)


def error_text(code: int) -> str:
    library = load_libopus()
    text: bytes | None = library.opus_strerror(code) if library is not None else None
    return text.decode() if text else f"error {code}"


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
    library.opus_encoder_create.argtypes = [
        ctypes.c_int32,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    library.opus_encoder_create.restype = ctypes.c_void_p
    library.opus_encode.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int16),
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    library.opus_encode.restype = ctypes.c_int32
    library.opus_encoder_ctl.restype = ctypes.c_int  # variadic: arguments typed at the call
    library.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    library.opus_encoder_destroy.restype = None
    library.opus_strerror.argtypes = [ctypes.c_int]
    library.opus_strerror.restype = ctypes.c_char_p
