"""What a quiet server gives back: the synthesizer's onnxruntime arenas, which keep the most
that sentences synthesized at once ever took, shrink to their first region on request (the
registry asks once no call is live, ``server/runtime/registry.py``). On the real voice."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.llm import LONG_ANSWER
from media.piper_graph import noiseless_inputs
from media.tts import LoadAwareSession
from tests.support.speech import synthesizer

pytestmark = pytest.mark.timeout(120)


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_the_synthesizers_arenas_shrink_once_sentences_synthesized_at_once_are_done() -> None:
    synth = synthesizer()
    session = synth._voice.session
    assert isinstance(session, LoadAwareSession)
    feeds = [noiseless_inputs(synth._voice, s) for s in LONG_ANSWER.split(". ")[:4]]
    with ThreadPoolExecutor(len(feeds)) as pool:  # as later sentences of four calls at once
        list(pool.map(lambda feed: session.lean.run(None, feed), feeds))
    grown = _rss_mb()
    assert synth.return_arena_memory() == 1  # the one-thread session (first words: no arena)
    assert grown - _rss_mb() > 50
    # and it synthesizes as before
    assert len(synth.synthesize_all("It should arrive on Friday.")) > synth.sample_rate
