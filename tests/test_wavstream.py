"""The streamed-audio decoder of remote synthesis: bytes cut anywhere, WAV headers as servers
write them (extra chunks, unknown sizes), resampling to the promised rate."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from media.wavstream import StreamDecoder
from tests.support.speech import tone


def _chunk(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("<I", len(body)) + body + b"\0" * (len(body) % 2)


def _wav(pcm: bytes, rate: int, channels: int = 1, data_size: int | None = None) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    size = len(pcm) if data_size is None else data_size
    data = b"data" + struct.pack("<I", size) + pcm
    body = b"WAVE" + _chunk(b"fmt ", fmt) + _chunk(b"LIST", b"INFOodd") + data
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + body


def _feed(decoder: StreamDecoder, data: bytes, step: int) -> bytes:
    out = b"".join(decoder.feed(data[i : i + step]) for i in range(0, len(data), step))
    return out + decoder.finish()


@pytest.mark.parametrize("step", [1, 3, 4097])
def test_pcm_and_wav_cut_anywhere_give_the_same_samples(step: int) -> None:
    pcm = tone(24_000, 300)
    assert _feed(StreamDecoder("pcm", 24_000), pcm, step) == pcm
    assert _feed(StreamDecoder("wav", 24_000), _wav(pcm, 24_000), step) == pcm


def test_a_declared_data_size_ends_the_audio_and_unknown_sizes_read_to_the_end() -> None:
    pcm = tone(24_000, 100)
    trailer = _chunk(b"LIST", b"INFOtail")
    assert _feed(StreamDecoder("wav", 24_000), _wav(pcm, 24_000) + trailer, 500) == pcm
    for unknown in (0, 0xFFFFFFFF):
        streamed = _wav(pcm, 24_000, data_size=unknown)
        assert _feed(StreamDecoder("wav", 24_000), streamed, 500) == pcm


def test_other_rates_and_stereo_are_resampled_to_mono_at_the_promised_rate() -> None:
    stereo = tone(22_050, 500, channels=2)
    out = _feed(StreamDecoder("wav", 24_000), _wav(stereo, 22_050, channels=2), 777)
    assert len(out) / 2 / 24_000 == pytest.approx(0.5, abs=0.01)
    samples = np.frombuffer(out, dtype=np.int16).astype(np.float64)
    assert np.sqrt(np.mean(samples**2)) / 32768 == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"ID3\x04" + bytes(40), "not a WAV stream"),
        (
            b"RIFF"
            + bytes(4)
            + b"WAVE"
            + _chunk(b"fmt ", struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8))
            + b"data"
            + bytes(4),
            "8 bits",
        ),
    ],
)
def test_what_is_not_pcm16_wav_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamDecoder("wav", 24_000).feed(data)
    truncated = StreamDecoder("wav", 24_000)
    truncated.feed(b"RIFF")
    with pytest.raises(ValueError, match="ended before"):
        truncated.finish()
