"""PCM helpers: streaming resampling (frequency, level, length, no aliasing, no seams), frame
splitting, loudness."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy.typing import NDArray

from media import FRAME_BYTES, FRAME_MS, SAMPLE_RATE, FrameSplitter, Resampler
from media.audio import (
    duration_ms,
    frame_bytes,
    pcm_rms_dbfs,
    pcm_to_float32,
    silence,
    trim_leading_silence,
    trim_trailing_silence,
)
from tests.support.speech import peak_frequency, tone, white_noise

TONE_DBFS = 20 * math.log10(0.5 / math.sqrt(2))  # a sine at half of full scale


def samples(pcm: bytes) -> NDArray[np.float64]:
    return np.frombuffer(pcm, dtype=np.int16).astype(np.float64)


def stream(resampler: Resampler, pcm: bytes, piece_bytes: int) -> tuple[bytes, bytes]:
    """Feed ``pcm`` in pieces: (output before flush, all output)."""
    out = b"".join(
        resampler.resample(pcm[i : i + piece_bytes]) for i in range(0, len(pcm), piece_bytes)
    )
    return out, out + resampler.flush()


@pytest.mark.parametrize(
    ("in_rate", "channels", "out_rate"),
    [(48_000, 2, 16_000), (22_050, 1, 16_000), (16_000, 1, 8_000), (8_000, 1, 16_000)],
)
def test_streamed_resampling_keeps_a_tones_frequency_level_and_length(
    in_rate: int, channels: int, out_rate: int
) -> None:
    pcm = tone(in_rate, 1000, channels=channels)
    piece = frame_bytes(in_rate, 20, channels)  # 20 ms pieces, as a transport delivers them
    before_flush, out = stream(Resampler(in_rate, out_rate, channels), pcm, piece)

    assert abs(len(out) // 2 - out_rate) <= 4  # one second in, one second out
    assert len(before_flush) < len(out)  # the filter delay is released by flush()
    body = out[len(out) // 10 : -len(out) // 10]  # skip the filter's start and end
    assert peak_frequency(body, out_rate) == pytest.approx(440.0, abs=1.0)
    assert pcm_rms_dbfs(body) == pytest.approx(TONE_DBFS, abs=0.2)
    # pieces join without seams: no step larger than the sine's own steepest slope
    steepest = 2 * math.pi * 440 / out_rate * 0.5 * 32767
    assert np.max(np.abs(np.diff(samples(body)))) <= steepest * 1.05


def test_streaming_in_pieces_equals_resampling_at_once() -> None:
    pcm = tone(48_000, 500, frequency=1000, channels=2)
    whole = Resampler(48_000, 16_000, 2)
    at_once = whole.resample(pcm) + whole.flush()
    _, streamed = stream(Resampler(48_000, 16_000, 2), pcm, 3840)
    assert streamed == at_once


@pytest.mark.parametrize(
    ("in_rate", "channels", "out_rate", "frequency"),
    [(48_000, 2, 16_000, 10_000), (22_050, 1, 16_000, 9_500), (16_000, 1, 8_000, 5_000)],
)
def test_tones_above_the_new_nyquist_frequency_are_filtered_not_aliased(
    in_rate: int, channels: int, out_rate: int, frequency: float
) -> None:
    pcm = tone(in_rate, 1000, frequency=frequency, channels=channels)
    _, out = stream(Resampler(in_rate, out_rate, channels), pcm, frame_bytes(in_rate, 20, channels))
    assert pcm_rms_dbfs(out) < TONE_DBFS - 30  # naive decimation would keep it at full level


def test_stereo_is_mixed_down_by_averaging_the_channels() -> None:
    left = np.frombuffer(tone(48_000, 1000), dtype=np.int16)
    pcm = np.stack([left, np.zeros_like(left)], axis=1).reshape(-1).tobytes()
    _, out = stream(Resampler(48_000, 16_000, 2), pcm, 3840)
    body = out[1600:-1600]
    assert pcm_rms_dbfs(body) == pytest.approx(TONE_DBFS - 20 * math.log10(2), abs=0.2)


def test_same_rate_mono_passes_through_untouched() -> None:
    resampler = Resampler(SAMPLE_RATE, SAMPLE_RATE)
    pcm = white_noise(100, -20)
    assert resampler.resample(pcm) == pcm
    assert resampler.flush() == b""


def test_same_rate_stereo_is_mixed_down() -> None:
    resampler = Resampler(SAMPLE_RATE, SAMPLE_RATE, 2)
    pcm = tone(SAMPLE_RATE, 200, channels=2)
    out = resampler.resample(pcm) + resampler.flush()
    assert len(out) == len(pcm) // 2
    assert pcm_rms_dbfs(out[320:-320]) == pytest.approx(TONE_DBFS, abs=0.2)


def test_empty_input_gives_empty_output() -> None:
    assert Resampler(48_000, 16_000, 2).resample(b"") == b""


@pytest.mark.parametrize("channels", [0, 3, 6])
def test_only_mono_and_stereo_input_is_accepted(channels: int) -> None:
    with pytest.raises(ValueError, match="mono or stereo"):
        Resampler(48_000, 16_000, channels)


# --- frames -----------------------------------------------------------------------------------


def test_frame_constants() -> None:
    assert (SAMPLE_RATE, FRAME_MS, FRAME_BYTES) == (16_000, 20, 640)
    assert frame_bytes(48_000, 20, 2) == 3840
    assert frame_bytes(8_000, 10) == 160


def test_frame_splitter_cuts_exact_frames_and_keeps_the_remainder() -> None:
    splitter = FrameSplitter()
    data = bytes(range(256)) * 20  # 5120 bytes: 8 frames exactly
    pieces = [data[:100], data[100:700], data[700:701], data[701:3000], data[3000:]]
    frames: list[bytes] = []
    sizes: list[int] = []
    for piece in pieces:
        out = splitter.push(piece)
        sizes.append(len(out))
        frames += out
    assert sizes == [0, 1, 0, 3, 4]
    assert all(len(frame) == FRAME_BYTES for frame in frames)
    assert b"".join(frames) == data
    assert splitter.flush() is None


def test_frame_splitter_flush_pads_the_tail_with_silence() -> None:
    splitter = FrameSplitter(size=8)
    assert splitter.push(b"abcdefghij") == [b"abcdefgh"]
    assert splitter.flush() == b"ij" + bytes(6)
    assert splitter.flush() is None
    splitter.push(b"xyz")
    assert splitter.flush(pad=False) == b"xyz"
    assert splitter.push(b"12345678") == [b"12345678"]  # nothing left over from before


def test_frame_splitter_takes_many_frames_at_once() -> None:
    splitter = FrameSplitter()
    data = white_noise(1000, -20)
    frames = splitter.push(data + b"\x01")
    assert len(frames) == 50
    assert b"".join(frames) == data
    assert splitter.flush() == b"\x01" + bytes(FRAME_BYTES - 1)


# --- loudness and conversions ---------------------------------------------------------------


def test_rms_dbfs_of_known_signals() -> None:
    assert pcm_rms_dbfs(tone(SAMPLE_RATE, 1000)) == pytest.approx(TONE_DBFS, abs=0.01)
    full_scale_square = np.tile(np.array([32767, -32768], dtype=np.int16), 800).tobytes()
    assert pcm_rms_dbfs(full_scale_square) == pytest.approx(0.0, abs=0.001)
    assert pcm_rms_dbfs(white_noise(1000, -60)) == pytest.approx(-60.0, abs=0.1)
    assert pcm_rms_dbfs(np.full(320, 1, dtype=np.int16).tobytes()) == pytest.approx(
        20 * math.log10(1 / 32768)
    )


def test_rms_dbfs_of_silence_and_nothing_is_minus_infinity() -> None:
    assert pcm_rms_dbfs(silence(20)) == -math.inf
    assert pcm_rms_dbfs(b"") == -math.inf


def test_silence_duration_and_float_conversion() -> None:
    assert silence(20) == bytes(FRAME_BYTES)
    assert len(silence(10, 8_000)) == 160
    assert duration_ms(silence(1500)) == 1500
    assert duration_ms(bytes(960), 48_000) == 10
    floats = pcm_to_float32(np.array([0, 16384, -32768, 32767], dtype=np.int16).tobytes())
    assert floats.dtype == np.float32
    assert floats.tolist() == pytest.approx([0.0, 0.5, -1.0, 32767 / 32768])


def test_leading_silence_is_trimmed_to_a_short_lead_in() -> None:
    hiss = np.full(160, 20, dtype=np.int16).tobytes()  # 10 ms at -64 dBFS: not sound
    lead = silence(60) + hiss
    voice = tone(SAMPLE_RATE, 200)
    trimmed = trim_leading_silence(lead + voice, SAMPLE_RATE, keep_ms=10)
    assert trimmed == (lead + voice)[(len(lead) // 2 - 160) * 2 :]  # 10 ms before the tone
    assert duration_ms(trimmed) == pytest.approx(210, abs=0.1)


def test_trailing_silence_is_trimmed_to_a_short_tail_by_loudness_not_stray_peaks() -> None:
    # a fading tail: quiet on average, with the odd sample as loud as speech
    tail = np.zeros(1600, dtype=np.int16)
    tail[::400] = 600  # -35 dBFS peaks, -54 dBFS over 5 ms
    voice = tone(SAMPLE_RATE, 200)
    trimmed = trim_trailing_silence(voice + tail.tobytes(), SAMPLE_RATE, keep_ms=10)
    assert trimmed == (voice + tail.tobytes())[: len(voice) + 160 * 2]  # 10 ms after the tone
    assert trim_trailing_silence(tail.tobytes(), SAMPLE_RATE) == tail.tobytes()


def test_audio_without_a_loud_sample_is_not_trimmed() -> None:
    hiss = np.full(1600, 20, dtype=np.int16).tobytes()
    assert trim_leading_silence(hiss, SAMPLE_RATE) == hiss
    assert trim_leading_silence(b"", SAMPLE_RATE) == b""


@pytest.mark.parametrize(
    ("in_rate", "channels", "out_rate"), [(48_000, 2, 16_000), (8_000, 1, 16_000)]
)
def test_an_aligned_resampler_gives_each_frame_whole_when_its_input_arrives(
    in_rate: int, channels: int, out_rate: int
) -> None:
    pcm = tone(in_rate, 200, channels=channels)
    piece = frame_bytes(in_rate, 20, channels)
    frame = frame_bytes(out_rate, 20)
    plain = [
        out
        for resampler in [Resampler(in_rate, out_rate, channels)]
        for out in (resampler.resample(pcm[i : i + piece]) for i in range(0, len(pcm), piece))
    ]
    held = frame - len(plain[0])
    assert held > 0  # the filter holds some back: without alignment a frame completes 20 ms late
    aligned = Resampler(in_rate, out_rate, channels, aligned=True)
    outputs = [aligned.resample(pcm[i : i + piece]) for i in range(0, len(pcm), piece)]
    assert [len(out) for out in outputs] == [frame] * len(outputs)
    # the same sound, behind the filter's delay as silence
    assert b"".join(outputs) == bytes(held) + b"".join(plain)
