"""Decoding audio as it streams in over the network: raw PCM16 or a WAV file, cut anywhere."""

from __future__ import annotations

import struct
from typing import Literal

from .audio import Resampler

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Streamed ``pcm`` (headerless PCM16 mono at ``rate``) or PCM16 ``wav`` bytes -> PCM16 mono
    at ``rate``, whole samples only: the bytes may be cut anywhere (mid-sample, mid-header)."""

    def __init__(self, response_format: Literal["pcm", "wav"], rate: int) -> None:
        self.rate = rate
        self._header_pending = response_format == "wav"
        self._buffer = bytearray()
        self._align = 2
        self._left: int | None = None
        """Data bytes the WAV header announced and not yet seen (None: until the end)."""
        self._resampler: Resampler | None = None

    def feed(self, data: bytes) -> bytes:
        """The whole samples of ``data`` (with what was held back before), converted; raises
        ValueError when a ``wav`` stream is not PCM16 WAV."""
        self._buffer += data
        if self._header_pending and not self._read_header():
            return b""
        usable = len(self._buffer) - len(self._buffer) % self._align
        if self._left is not None:
            usable = min(usable, self._left)
            self._left -= usable
        pcm = bytes(self._buffer[:usable])
        del self._buffer[:usable]
        if self._left == 0:
            self._buffer.clear()  # chunks after the audio (LIST...) are not sound
        return self._resampler.resample(pcm) if self._resampler else pcm

    def finish(self) -> bytes:
        """The resampler's tail at the end of the stream; raises ValueError when no WAV
        header came."""
        if self._header_pending:
            raise ValueError("the answer ended before its WAV header did")
        return self._resampler.flush() if self._resampler else b""

    def _read_header(self) -> bool:
        """Consume the RIFF header through the ``data`` chunk's; False while it is incomplete."""
        buf = self._buffer
        if len(buf) < 12:
            return False
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise ValueError("the answer is not a WAV stream")
        position, fmt = 12, None
        while True:
            if len(buf) < position + 8:
                return False
            kind = bytes(buf[position : position + 4])
            (size,) = struct.unpack_from("<I", buf, position + 4)
            if kind == b"data":
                break
            if len(buf) < position + 8 + size:
                return False
            if kind == b"fmt ":
                fmt = struct.unpack_from("<HHIIHH", buf, position + 8)
            position += 8 + size + size % 2
        if fmt is None:
            raise ValueError("the WAV stream has no fmt chunk")
        tag, channels, rate, _byte_rate, _block_align, bits = fmt
        if tag not in (1, 0xFFFE) or bits != 16 or channels not in (1, 2):
            raise ValueError(f"unsupported WAV audio: format {tag}, {bits} bits, {channels} ch")
        del buf[: position + 8]
        self._header_pending = False
        self._align = 2 * channels
        self._left = size if 0 < size < 0xFFFFFFFF else None  # streams often say 0 or 2^32-1
        if rate != self.rate or channels != 1:
            self._resampler = Resampler(rate, self.rate, channels)
        return True
