"""An answer's later sentences are synthesized apart from its first words (``media.tts``): on a
worker of their own, ``LATER_NICENESS`` nicer, on one thread, the one needed soonest first. On
the real voice."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import pytest

from media.priority import BACKGROUND_NICENESS
from media.tts import LATER_NICENESS, Synthesizer, SynthesizerSettings

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def synth() -> Iterator[Synthesizer]:
    synthesizer = Synthesizer.load(SynthesizerSettings(deterministic=True))
    yield synthesizer
    synthesizer.close()


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def _first_piece(synth: Synthesizer, text: str, heard: list[str], **kwargs: Any) -> None:
    async for _piece in synth.synthesize(text, **kwargs):
        heard.append(text)
        return


def _assert_same_speech(heard: bytes, whole: bytes) -> None:
    """The same speech, but for rounding (the voice's sessions, whole or a window at a time,
    compute apart): the same length, the difference 30 dB below the speech."""
    assert len(heard) == len(whole)
    said = np.frombuffer(whole, np.int16).astype(float)
    difference = np.frombuffer(heard, np.int16) - said
    assert np.sqrt(np.mean(difference**2)) < 0.03 * np.sqrt(np.mean(said**2))


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` (a pool's state, which its threads change) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_an_answers_first_words_do_not_wait_for_a_later_sentence(
    synth: Synthesizer,
) -> None:
    release = threading.Event()
    busy = synth._later.submit(release.wait, 10, priority=0)  # a long later sentence, say
    heard: list[str] = []
    try:
        later = asyncio.create_task(_first_piece(synth, "It arrives on Friday.", heard, slack_s=60))
        await _until(lambda: synth._later.waiting == 1)
        await asyncio.wait_for(_first_piece(synth, "Sure.", heard, urgent=True), 30)
        assert heard == ["Sure."]  # while the later worker was still busy
    finally:
        release.set()
    await asyncio.wait_for(later, 30)
    assert heard == ["Sure.", "It arrives on Friday."]
    assert busy.result(timeout=5) is True


def test_later_sentences_run_nicer_than_first_words_and_on_one_thread(
    synth: Synthesizer,
) -> None:
    first = synth._executor.submit(_niceness).result(timeout=5)
    later = synth._later.submit(_niceness).result(timeout=5)
    assert first == min(_niceness() + BACKGROUND_NICENESS, 19)
    assert later == min(first + LATER_NICENESS, 19)
    # a session on every core would run its threads at the engines' niceness, not the lane's
    assert synth._later.submit(synth._runs_lean).result(timeout=5) is True


async def test_the_later_sentence_needed_soonest_is_synthesized_first(
    synth: Synthesizer,
) -> None:
    release = threading.Event()
    synth._later.submit(release.wait, 10, priority=0)
    heard: list[str] = []
    try:
        tasks = [
            asyncio.create_task(_first_piece(synth, "Needed in a minute.", heard, slack_s=60)),
            asyncio.create_task(
                _first_piece(synth, "Needed in twenty seconds.", heard, slack_s=20)
            ),
            asyncio.create_task(_first_piece(synth, "Needed in half a minute.", heard, slack_s=30)),
        ]
        await _until(lambda: synth._later.waiting == 3)
    finally:
        release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert heard == ["Needed in twenty seconds.", "Needed in half a minute.", "Needed in a minute."]


async def test_a_later_sentence_not_ready_when_due_is_synthesized_urgently(
    synth: Synthesizer,
) -> None:
    release = threading.Event()
    busy = synth._later.submit(release.wait, 10, priority=0)  # the later worker starved, say
    text = "It left today. It arrives on Friday."
    try:
        pieces = [p async for p in synth.synthesize(text, slack_s=0.05)]
        assert not busy.done()  # heard while the later worker was still busy
    finally:
        release.set()
    _assert_same_speech(b"".join(pieces), synth.synthesize_all(text))  # each sentence once
    assert busy.result(timeout=5) is True
    await _until(lambda: synth._later.idle_workers == 1)
    assert synth._later.waiting == 0  # the late step, cancelled before it started, is gone


class _StalledLater(Synthesizer):
    """The same voice, whose later worker stalls at each step until ``release`` (a worker the
    CPU is not given to)."""

    def __init__(self, shared: Synthesizer) -> None:
        super().__init__(shared._voice, shared.settings)
        self.release = threading.Event()
        self.stalls_over = 0

    def _chunks(
        self, text: str, *, first_sentence: int = 0, stream_first: bool = False
    ) -> Generator[tuple[bytes, bool], None, None]:
        if self._later.runs_here():
            self.release.wait(10)
            self.stalls_over += 1
        yield from super()._chunks(text, first_sentence=first_sentence, stream_first=stream_first)


async def test_a_later_sentence_still_running_when_due_is_raced_in_the_urgent_worker(
    synth: Synthesizer,
) -> None:
    stalled = _StalledLater(synth)
    text = "It left today. It arrives on Friday."
    try:
        pieces = [p async for p in stalled.synthesize(text, slack_s=0.05)]
        assert stalled.stalls_over == 0  # heard while the later step was still stalled
    finally:
        stalled.release.set()
        stalled.close()
    _assert_same_speech(b"".join(pieces), synth.synthesize_all(text))


async def test_a_later_sentence_due_later_never_takes_the_urgent_worker(
    synth: Synthesizer,
) -> None:
    release = threading.Event()
    busy = synth._executor.submit(release.wait, 10, priority=0)  # first words running
    try:
        text = "It arrives on Friday."
        pieces = [p async for p in synth.synthesize(text, slack_s=30)]
        _assert_same_speech(b"".join(pieces), synth.synthesize_all(text))
        assert synth._executor.waiting == 0
    finally:
        release.set()
    assert busy.result(timeout=5) is True
