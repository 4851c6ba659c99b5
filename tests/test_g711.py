"""G.711 tables against the reference codec (digests of CPython's audioop output, taken once)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from media.g711 import alaw_to_pcm, pcm_to_alaw, pcm_to_ulaw, ulaw_to_pcm

Codec = Callable[[bytes], bytes]
ALL_PCM = np.arange(-32768, 32768, dtype="<i2").tobytes()
ALL_CODES = bytes(range(256))
SAMPLES = np.array([0, 1, -1, 1000, -1000, 32767, -32768], dtype="<i2").tobytes()


@pytest.mark.parametrize(
    ("convert", "data", "digest"),
    [
        (pcm_to_ulaw, ALL_PCM, "81d633c9e6972a18c74a58720b96cb8ca0bdd096d4060b646dd708c3b846019a"),
        (pcm_to_alaw, ALL_PCM, "38488f6fd710f4686360edc4d38639f96c491595ef93f8eb8d62d5e07ca6ce7b"),
        (
            ulaw_to_pcm,
            ALL_CODES,
            "3dab54339e520bb2c924826e3b72a917a2b612e9fd12fc867500f1d983a75827",
        ),
        (
            alaw_to_pcm,
            ALL_CODES,
            "e04788d110e58ff8c70c93b8480190d973e3b67876b6119abbaec766cc75c174",
        ),
    ],
)
def test_every_value_matches_the_reference_codec(convert: object, data: bytes, digest: str) -> None:
    assert callable(convert)
    assert hashlib.sha256(convert(data)).hexdigest() == digest


def test_known_codes() -> None:
    assert list(pcm_to_ulaw(SAMPLES)) == [255, 255, 126, 206, 78, 128, 0]
    assert list(pcm_to_alaw(SAMPLES)) == [213, 213, 85, 250, 122, 170, 42]


@pytest.mark.parametrize(
    ("encode", "decode"), [(pcm_to_ulaw, ulaw_to_pcm), (pcm_to_alaw, alaw_to_pcm)]
)
def test_a_round_trip_keeps_a_tone_within_g711_precision(encode: Codec, decode: Codec) -> None:
    t = np.arange(8000) / 8000
    tone = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2")
    back = np.frombuffer(decode(encode(tone.tobytes())), dtype="<i2").astype(np.float64)
    error = back - tone
    snr_db = 10 * np.log10(np.mean(tone.astype(np.float64) ** 2) / np.mean(error**2))
    assert snr_db > 30  # G.711 gives about 38 dB on a loud tone
    assert len(back) == len(tone)
