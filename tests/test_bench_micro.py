"""The component microbenchmarks on the real models, shrunk: the result has the documented shape
and every number in it is finite and positive."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from benchmarks.micro import MicroSettings, p90, run_micro
from tests.support import speech

SMALL = MicroSettings(
    repeats=1,
    stt_lengths_s=(1.0,),
    vad_frames=200,
    chunker_repeats=5,
    tts_sentences=("Hello there.",),
)


def numbers(value: object) -> list[float]:
    """Every number in a JSON-like value, depth first."""
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers(item)]
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    assert not isinstance(value, bool), value
    assert isinstance(value, int | float), value
    return [float(value)]


@pytest.mark.slow
def test_run_micro_reports_every_component_with_finite_positive_numbers() -> None:
    messages: list[str] = []
    results: dict[str, Any] = run_micro(
        SMALL, speech.transcriber(), speech.synthesizer(), progress=messages.append
    )

    assert set(results) == {"stt", "tts", "vad", "chunker"}
    assert len(results["stt"]) == 1
    assert set(results["stt"][0]) == {"audio_s", "median_ms", "p90_ms", "min_ms"}
    assert results["stt"][0]["audio_s"] == pytest.approx(1.0)
    assert len(results["tts"]) == 1
    assert set(results["tts"][0]) == {
        "chars",
        "audio_s",
        "first_audio_ms_median",
        "total_ms_median",
        "rtf_median",
    }
    assert results["tts"][0]["chars"] == len("Hello there.")
    assert 0.4 < results["tts"][0]["audio_s"] < 3.0  # the audio's length, not the pieces' count
    assert set(results["vad"]) == {"frames", "us_per_frame_median"}
    assert results["vad"]["frames"] == 200
    assert set(results["chunker"]) == {"chars", "chars_per_s", "us_per_delta"}

    values = numbers(results)
    assert len(values) == 4 + 5 + 2 + 3
    assert all(math.isfinite(n) and n > 0 for n in values), results
    # with one repetition the median, p90 and minimum are that one time
    stt = results["stt"][0]
    assert stt["min_ms"] <= stt["median_ms"] <= stt["p90_ms"]
    tts = results["tts"][0]
    assert tts["first_audio_ms_median"] <= tts["total_ms_median"]
    json.dumps(results, allow_nan=False)
    assert len(messages) == 5  # speech, STT, TTS, VAD, chunker


def test_p90_is_the_nearest_rank() -> None:
    assert p90([5.0]) == 5.0
    assert p90([float(n) for n in range(1, 11)]) == 9.0
    assert p90([float(n) for n in range(1, 12)]) == 10.0
    assert p90([3.0, 1.0, 2.0]) == 3.0
    with pytest.raises(ValueError, match="no values"):
        p90([])
