"""A Piper run gives way to more urgent synthesis (``media/yielding.py``), on the real voice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from media.tts import Synthesizer, SynthesizerSettings
from media.yielding import _Run, _worth_stopping

pytestmark = pytest.mark.timeout(120)

LONG_SENTENCE = (
    "Your order left our warehouse yesterday, and it should arrive on Friday morning, unless "
    "the weather turns bad again and the roads along the coast are closed for the day."
)


@pytest.fixture(scope="module")
def synthesizer() -> Iterator[Synthesizer]:
    synth = Synthesizer.load(SynthesizerSettings(deterministic=True, workers=1))
    yield synth
    synth.close()


async def _first_words_during_a_later_sentence(synthesizer: Synthesizer) -> tuple[list[str], bytes]:
    """Start synthesizing ``LONG_SENTENCE``; once its Piper run is under way, ask for urgent
    first words. Which was heard first, and the sentence's whole audio."""
    heard: list[str] = []

    async def later_sentence() -> bytes:
        pieces: list[bytes] = []
        async for piece in synthesizer.synthesize(LONG_SENTENCE):
            if not pieces:
                heard.append("later sentence")
            pieces.append(piece)
        return b"".join(pieces)

    task = asyncio.create_task(later_sentence())
    deadline = time.monotonic() + 10
    while not synthesizer.give_way._runs:  # its run has started
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    async for _piece in synthesizer.synthesize("Sure.", urgent=True):
        heard.append("first words")
        break
    return heard, await task


async def test_an_answers_first_words_do_not_wait_for_another_calls_later_sentence(
    synthesizer: Synthesizer,
) -> None:
    expected = synthesizer.synthesize_all(LONG_SENTENCE)
    stops = synthesizer.give_way.stops
    heard, audio = await _first_words_during_a_later_sentence(synthesizer)
    assert heard == ["first words", "later sentence"]
    assert audio == expected  # stopped, run again from its start: the same audio
    assert synthesizer.give_way.stops == stops + 1


def test_a_run_is_stopped_only_while_less_is_done_than_is_left() -> None:
    run = _Run(priority=1, options=None, started=10.0, expected_s=0.4)
    assert _worth_stopping(run, now=10.1)
    assert not _worth_stopping(run, now=10.25)
    assert _worth_stopping(_Run(1, None, 10.0, expected_s=None), now=99.0)  # not learned yet


async def test_no_run_is_stopped_while_the_cpu_it_would_waste_is_needed(
    synthesizer: Synthesizer,
) -> None:
    synthesizer.give_way.affordable = lambda: False  # e.g. decodes wait for Whisper
    try:
        stops = synthesizer.give_way.stops
        heard, _audio = await _first_words_during_a_later_sentence(synthesizer)
        assert heard == ["later sentence", "first words"]  # it waited for the run in progress
        assert synthesizer.give_way.stops == stops
    finally:
        synthesizer.give_way.affordable = lambda: True
