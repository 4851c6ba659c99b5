"""Opus on SIP calls (RFC 7587): aiortp's codec interface over libopus at the pipeline's rate.

aiortp's own Opus codec needs the ``opuslib`` package and works at 48 kHz. This one runs
libopus (:mod:`media.opus`) at 16 kHz both ways, so the caller's audio reaches the pipeline and
the agent's leaves it with no resampling; the RTP clock stays 48 kHz (the call's SDP says so,
and aiortp keeps the two apart). A peer offers Opus on a dynamic payload type:
:func:`use_opus_at` registers this codec at that number with aiortp before the call's RTP
session is made.
"""

from __future__ import annotations

from aiortp.codecs import Codec, register_codec

from media.opus import OpusDecoder, OpusEncoder, OpusError, load_libopus

__all__ = ["OPUS_RATE", "SipOpus", "opus_available", "use_opus_at"]

OPUS_RATE = 16000
"""The rate of the PCM an Opus call hears and sends (the pipeline's)."""


class SipOpus(Codec):
    """Mono Opus at :data:`OPUS_RATE`, 20 ms a packet, libopus's concealment for lost ones."""

    def __init__(self) -> None:
        self._encoder = OpusEncoder(OPUS_RATE)
        self._decoder = OpusDecoder(OPUS_RATE)

    @property
    def name(self) -> str:
        return "opus"

    @property
    def sample_rate(self) -> int:
        return OPUS_RATE

    @property
    def samples_per_frame(self) -> int:
        return self._encoder.samples_per_frame

    def encode(self, pcm: bytes) -> bytes:
        return self._encoder.encode(pcm)

    def decode(self, payload: bytes) -> bytes:
        try:
            return self._decoder.decode(payload)
        except OpusError:  # a malformed packet: heard as the silence of one frame
            return bytes(self.samples_per_frame * 2)

    def conceal(self, num_samples: int) -> bytes | None:
        return self._decoder.conceal(num_samples)


def opus_available() -> bool:
    """Whether libopus loads (and so Opus can be offered or answered)."""
    return load_libopus() is not None


def use_opus_at(payload_type: int) -> None:
    """Let aiortp make :class:`SipOpus` for ``payload_type`` (a dynamic one, 96-127)."""
    if not 96 <= payload_type <= 127:
        raise ValueError(f"Opus on payload type {payload_type}: not a dynamic one")
    register_codec(payload_type, SipOpus)
