"""The audio end-of-turn model (Smart Turn v3.2, bundled): a voice that goes on scores below a
voice that has finished, on real Piper speech; a missing or damaged file is one clear error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from media.audio import silence
from media.turn_model import (
    BUNDLED_TURN_MODEL,
    TurnModel,
    TurnModelError,
    check_turn_model,
)
from server.testkit.scenarios.speech import hesitant_piper
from tests.support.speech import transcriber

pytestmark = pytest.mark.timeout(120)

EVALUATED_AT_MS = 200
"""The silence after the last word when the session asks the model (``model_silence_ms``)."""


@pytest.fixture(scope="module")
def model() -> Iterator[TurnModel]:
    loaded = TurnModel.load()
    yield loaded
    loaded.close()


def _voiced(pcm: bytes) -> bytes:
    """``pcm`` up to its last loud sample."""
    samples = np.frombuffer(pcm, dtype="<i2")
    loud = np.flatnonzero(np.abs(samples) > 300)
    return samples[: loud[-1] + 1].tobytes()


def _before_pause(pcm: bytes, pause_ms: int) -> bytes:
    """The speech before the first silence of ``pause_ms`` (the inserted hesitation)."""
    samples = np.frombuffer(pcm, dtype="<i2")
    frames = np.abs(samples[: len(samples) // 320 * 320].reshape(-1, 320)).max(axis=1)
    quiet = frames < 100
    run = pause_ms // 20 - 5
    for start in range(len(quiet) - run):
        if quiet[start : start + run].all():
            return _voiced(samples[: start * 320].tobytes())
    raise AssertionError("no pause found")


@pytest.mark.parametrize(
    "parts",
    [("I'd like, um,", "the vegetarian option."), ("I want to move my booking to", "next Friday.")],
)
async def test_a_voice_that_goes_on_scores_below_one_that_has_finished(
    model: TurnModel, parts: tuple[str, str]
) -> None:
    hesitant = hesitant_piper(parts, 1.0, 2000)  # said whole, a pause cut in after part one
    whole = hesitant_piper((" ".join(parts),), 1.0, 300)
    going_on = await model.completion(_before_pause(hesitant, 2000) + silence(EVALUATED_AT_MS))
    finished = await model.completion(_voiced(whole) + silence(EVALUATED_AT_MS))
    assert going_on < 0.5 <= finished, (going_on, finished)
    assert model.evaluations >= 2
    assert model.mean_cost_ms > 0


async def test_a_hesitant_lines_pause_holds_nothing_of_the_next_word() -> None:
    """The pause starts where Piper's word break begins: cut in the break's middle, the faint
    lead-in of "two" was heard as "... for two" (a finished line, on AVX2 kernels)."""
    hesitant = np.frombuffer(
        hesitant_piper(("Friday at eight, for", "two people."), 1.0, 1000), "<i2"
    )
    # everything before the inserted silence, to its last sample, faint ones included
    pause = np.flatnonzero(np.convolve(hesitant != 0, np.ones(900 * 16), "valid") == 0)[0]
    heard = await transcriber().transcribe(hesitant[:pause].tobytes() + silence(300))
    assert heard.text.lower().rstrip(".").endswith("for"), heard.text


def test_a_missing_or_damaged_model_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TurnModelError, match=r"^turn model .*missing\.onnx: no such file$"):
        check_turn_model(tmp_path / "missing.onnx")
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(BUNDLED_TURN_MODEL.read_bytes()[:100_000])  # cut short
    with pytest.raises(TurnModelError) as refused:
        check_turn_model(damaged)
    assert "not a loadable ONNX model" in str(refused.value)
    assert "\n" not in str(refused.value)
