"""G.711 mu-law and A-law <-> PCM16, by 256-entry and 65536-entry NumPy tables (ITU-T G.711).

Telephony speaks these at 8 kHz; resample with :class:`media.audio.Resampler` at the edges.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["alaw_to_pcm", "pcm_to_alaw", "pcm_to_ulaw", "ulaw_to_pcm"]


def _ulaw_decode_table() -> NDArray[np.int16]:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> NDArray[np.int16]:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


def _ulaw_encode(samples: NDArray[np.int32]) -> NDArray[np.uint8]:
    """The reference (Sun/CCITT) encoder on 14-bit magnitudes, as telephony stacks use it."""
    value = samples >> 2
    mask = np.where(value < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(value), 8159) + 33
    segment_ends = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
    segment = np.searchsorted(segment_ends, magnitude, side="left")
    code = (np.minimum(segment, 7) << 4) | ((magnitude >> (np.minimum(segment, 7) + 1)) & 0x0F)
    encoded: NDArray[np.uint8] = (np.where(segment >= 8, 0x7F, code) ^ mask).astype(np.uint8)
    return encoded


def _alaw_encode(samples: NDArray[np.int32]) -> NDArray[np.uint8]:
    sign = np.where(samples >= 0, 0x80, 0)
    magnitude = np.minimum(np.where(samples >= 0, samples, -samples - 1), 32767) >> 3
    exponent = np.where(magnitude < 32, 0, np.floor(np.log2(np.maximum(magnitude, 1))) - 4)
    exponent = np.clip(exponent, 0, 7).astype(np.int32)
    mantissa = np.where(exponent == 0, magnitude >> 1, magnitude >> exponent) & 0x0F
    encoded: NDArray[np.uint8] = ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)
    return encoded


_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()
_ALL_PCM = np.arange(-32768, 32768, dtype=np.int32)
_ULAW_ENCODE = _ulaw_encode(_ALL_PCM)
_ALAW_ENCODE = _alaw_encode(_ALL_PCM)


def ulaw_to_pcm(data: bytes) -> bytes:
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)].astype("<i2").tobytes()


def alaw_to_pcm(data: bytes) -> bytes:
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)].astype("<i2").tobytes()


def pcm_to_ulaw(pcm: bytes) -> bytes:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int32) + 32768
    return _ULAW_ENCODE[samples].tobytes()


def pcm_to_alaw(pcm: bytes) -> bytes:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int32) + 32768
    return _ALAW_ENCODE[samples].tobytes()
