"""WebRTC media for one call: the caller's track into the session, the speaker out as a track.

The caller's audio arrives as decoded frames (s16 mono 48 kHz for Opus, decoded on the event loop:
:mod:`server.transports.webrtc.inbound`; other codecs at their own rate) and is resampled to the
pipeline's 16 kHz mono 20 ms frames. :class:`SpeakerTrack` is a pull-based
track: aiortc calls ``recv()``, which paces itself to 20 ms and returns the speaker's next frame,
silence when the agent is quiet.
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import av
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from aiortc.sdp import SessionDescription
from av.audio.codeccontext import AudioCodecContext

from media import FRAME_BYTES, FRAME_MS, SAMPLE_RATE, FrameSplitter, Resampler, Speaker
from media.speaker import SILENT_DBFS

__all__ = [
    "OPUS_APPLICATION",
    "OPUS_BITRATE",
    "OUTPUT_RATE",
    "SILENCE_TAIL_FRAMES",
    "OpusPackets",
    "SpeakerTrack",
    "caller_frames",
    "negotiated_opus",
]

log = logging.getLogger(__name__)

OUTPUT_RATE = 48_000
"""The speaker's rate for WebRTC calls: Opus's native rate, so aiortc does not resample."""


OPUS_BITRATE = 32_000
"""Bits per second of the agent's voice when the server encodes it (:class:`OpusPackets`):
mono speech, where aiortc's own encoder spends 96 kbit/s on stereo."""

OPUS_APPLICATION = "lowdelay"
"""libopus's mode for the agent's voice: CELT alone ("restricted low delay"). Synthesized speech
at 32 kbit/s needs none of SILK's speech modelling, which costs two and a half times the CPU:
on an AVX-512 core a 20 ms frame encodes in ~86 us against ~217 us in the "voip" mode, at
PESQ-wb 4.36 against 4.52 on the default voice (STOI 0.995 both) and ~39 kbit/s on the wire
(CELT's VBR), with 4 ms less look-ahead (2.5 against 6.5 ms). Any Opus decoder plays it."""

SILENCE_TAIL_FRAMES = 3
"""Silent frames encoded as they come after sound (the encoder's state fades out) before the
cached silence packet takes over."""


class OpusPackets:
    """The speaker's 20 ms frames (48 kHz mono PCM16) as Opus packets, encoded on the event loop.

    aiortc encodes each outgoing audio frame in its thread pool: a hand-over to a thread and back
    per frame and call (50 a second each), plus a resampler to stereo and a 96 kbit/s stereo
    encode, for a voice that is mono and, half the call, silent. Handed ready packets, aiortc
    only packetizes them. Silence, which costs libopus more to encode than speech, is one packet
    encoded once and sent again and again (after a short encoded tail, so sound fades out).
    """

    def __init__(self, bitrate: int = OPUS_BITRATE, application: str = OPUS_APPLICATION) -> None:
        """``application``: libopus's mode (``lowdelay``, ``voip`` or ``audio``)."""
        self._codec = _opus_encoder(bitrate, application)
        self._silence = _silence_packet(bitrate, application)
        self._silent_run = 0
        self._time_base = fractions.Fraction(1, OUTPUT_RATE)
        self._samples = OUTPUT_RATE * FRAME_MS // 1000

    def packet(self, pcm: bytes, pts: int, *, silent: bool) -> av.Packet[Any]:
        """The packet for one frame at ``pts`` (in samples); ``silent`` when ``pcm`` is
        digital silence."""
        self._silent_run = self._silent_run + 1 if silent else 0
        data = self._silence
        if self._silent_run <= SILENCE_TAIL_FRAMES:
            frame = av.AudioFrame(format="s16", layout="mono", samples=self._samples)
            frame.planes[0].update(pcm)
            frame.sample_rate = OUTPUT_RATE
            frame.pts = pts
            frame.time_base = self._time_base
            encoded = self._codec.encode(frame)
            if encoded:
                data = bytes(encoded[0])
        return self._as_packet(data, pts)

    def _as_packet(self, data: bytes, pts: int) -> av.Packet[Any]:
        """``data`` as the packet of the frame at ``pts``."""
        packet = av.Packet(data)
        packet.pts = pts
        packet.time_base = self._time_base
        return packet


def _opus_encoder(bitrate: int, application: str) -> AudioCodecContext:
    codec = av.CodecContext.create("libopus", "w")
    codec.bit_rate = bitrate
    codec.format = "s16"
    codec.layout = "mono"
    codec.sample_rate = OUTPUT_RATE
    codec.time_base = fractions.Fraction(1, OUTPUT_RATE)
    codec.options = {"application": application}
    return codec


@functools.cache
def _silence_packet(bitrate: int, application: str) -> bytes:
    """One 20 ms Opus packet of silence, from an encoder that has heard nothing else (made
    once per setting: a fresh encoder and four encodes, ~2 ms of every call's set-up)."""
    codec = _opus_encoder(bitrate, application)
    samples = OUTPUT_RATE * FRAME_MS // 1000
    packets: list[bytes] = []
    for n in range(SILENCE_TAIL_FRAMES + 1):
        frame = av.AudioFrame(format="s16", layout="mono", samples=samples)
        frame.planes[0].update(bytes(samples * 2))
        frame.sample_rate = OUTPUT_RATE
        frame.pts = n * samples
        packets += [bytes(p) for p in codec.encode(frame)]
    return packets[-1]


def negotiated_opus(sdp: str) -> bool:
    """Whether the first audio codec of ``sdp`` (the one aiortc sends with) is Opus."""
    for media in SessionDescription.parse(sdp).media:
        if media.kind == "audio" and media.fmt:
            first = str(media.fmt[0])
            return any(
                str(codec.payloadType) == first and codec.mimeType.lower() == "audio/opus"
                for codec in media.rtp.codecs
            )
    return False


class SpeakerTrack(MediaStreamTrack):
    """An audio track that plays a :class:`Speaker`, one 20 ms frame per ``recv()``: frames for
    aiortc to encode, or, once :attr:`opus` is set (the call sends Opus), ready packets."""

    kind = "audio"

    def __init__(self, speaker: Speaker) -> None:
        super().__init__()
        if speaker.sample_rate != OUTPUT_RATE or speaker.frame_ms != FRAME_MS:
            raise ValueError(f"the speaker must produce {FRAME_MS} ms frames at {OUTPUT_RATE} Hz")
        self.speaker = speaker
        self.opus: OpusPackets | None = None
        self._samples = OUTPUT_RATE * FRAME_MS // 1000
        self._time_base = fractions.Fraction(1, OUTPUT_RATE)
        self._start: float | None = None
        self._pts = 0

    async def recv(self) -> av.AudioFrame | av.Packet[Any]:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        else:
            self._pts += self._samples
            wait = self._start + self._pts / OUTPUT_RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        pcm = self.speaker.pull()
        if self.opus is not None:
            silent = self.speaker.levels[-1] == SILENT_DBFS
            return self.opus.packet(pcm, self._pts, silent=silent)
        frame = av.AudioFrame(format="s16", layout="mono", samples=self._samples)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = OUTPUT_RATE
        frame.time_base = self._time_base
        return frame


async def caller_frames(track: MediaStreamTrack) -> AsyncIterator[bytes]:
    """The caller's audio as 20 ms frames of 16 kHz mono PCM16, until the track ends."""
    splitter = FrameSplitter(FRAME_BYTES)
    resampler: Resampler | None = None
    layout: tuple[int, int] | None = None
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if not isinstance(frame, av.AudioFrame):
            continue
        channels = len(frame.layout.channels)
        if layout != (frame.sample_rate, channels):
            layout = (frame.sample_rate, channels)
            resampler = Resampler(
                frame.sample_rate, SAMPLE_RATE, in_channels=min(channels, 2), aligned=True
            )
        assert resampler is not None
        pcm = _interleaved_s16(frame)
        for out in splitter.push(resampler.resample(pcm)):
            yield out


def _interleaved_s16(frame: av.AudioFrame) -> bytes:
    if frame.format.name != "s16":  # aiortc's Opus, G.711 and G.722 decoders all give s16
        raise ValueError(f"unexpected decoded audio format {frame.format.name!r}")
    return bytes(frame.planes[0])[: frame.samples * 2 * len(frame.layout.channels)]
