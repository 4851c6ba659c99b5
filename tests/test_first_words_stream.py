"""An answer's first words are decoded a window at a time (``media.piper_stream``): the voice's
graph split at its decoder says what the whole graph says, the windows what the whole decode
says, and the first window is heard while the rest is still to be decoded, on a call too. On
the real voice."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from media import joins_next
from media.piper_graph import noiseless_inputs
from media.piper_stream import FIRST_FRAMES, SplitVoiceSession, stream_sentence, window_ends
from media.priority_pool import URGENT
from media.tts import (
    LoadAwareSession,
    Synthesizer,
    SynthesizerSettings,
    default_piper_voice,
    onnx_session,
)
from playbooks import load_playbook
from server.call.session import SessionSettings
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.conftest import EXAMPLES
from tests.support.calls import VoiceCall, start_call, transcriber, word_error_rate
from tests.support.speech import piper_speech

pytestmark = pytest.mark.timeout(120)

TEXT = "Your order left our warehouse yesterday morning."


@pytest.fixture(scope="module")
def synth() -> Iterator[Synthesizer]:
    synthesizer = Synthesizer.load(SynthesizerSettings(deterministic=True))
    yield synthesizer
    synthesizer.close()


def _split(synth: Synthesizer) -> SplitVoiceSession:
    session = synth._voice.session
    assert isinstance(session, LoadAwareSession)
    assert isinstance(session.full, SplitVoiceSession)
    return session.full


def test_the_split_graph_says_what_the_whole_graph_says(synth: Synthesizer) -> None:
    model, _config = default_piper_voice()
    feed = noiseless_inputs(synth._voice, TEXT)
    whole = onnx_session(model, 0).run(None, feed)[0].reshape(-1)
    split = np.asarray(_split(synth).run(None, feed)[0]).reshape(-1)
    assert split.shape == whole.shape
    assert float(np.max(np.abs(split - whole))) < 1e-5


def test_windows_decode_what_the_whole_decode_does(synth: Synthesizer) -> None:
    split = _split(synth)
    assert split.context_frames is not None  # calibrated when the voice loaded
    hop = synth._voice.config.hop_length
    assert hop == 256
    latent = split.latent(noiseless_inputs(synth._voice, TEXT))
    frames = latent.shape[2]
    whole = split.decode(latent, 0, frames, 0)
    assert whole.size == frames * hop
    windows = [
        split.decode(latent, start, min(frames, start + 20)) for start in range(0, frames, 20)
    ]
    assert float(np.max(np.abs(np.concatenate(windows) - whole))) < 1e-4
    # without context a window's edge sounds different: the context is what makes it equal
    cut = split.decode(latent, 0, FIRST_FRAMES, 0)
    assert float(np.max(np.abs(cut - whole[: cut.size]))) > 1e-3


def test_a_streamed_sentence_is_piper_audio_at_the_voice_gain(synth: Synthesizer) -> None:
    split = _split(synth)
    feed = noiseless_inputs(synth._voice, TEXT)
    hop = synth._voice.config.hop_length
    pieces = list(stream_sentence(split, feed, synth.sample_rate))
    ends = window_ends(split.latent(feed).shape[2])
    assert ends[:3] == [FIRST_FRAMES, 3 * FIRST_FRAMES, 7 * FIRST_FRAMES]  # each twice the last
    assert [last for _audio, last in pieces] == [end == ends[-1] for end in ends]
    assert [audio.size for audio, _last in pieces] == [
        (end - start) * hop for start, end in zip([0, *ends], ends, strict=False)
    ]
    streamed = np.concatenate([audio for audio, _last in pieces])
    raw = split.decode(split.latent(feed), 0, streamed.size // hop, 0)
    peak = float(np.max(np.abs(raw)))
    gain = min(split.voice_gain, 1 / peak)  # no clipping, and one gain throughout
    assert float(np.max(np.abs(streamed))) <= 1.0 + 1e-6
    assert float(np.max(np.abs(streamed - raw * gain))) < 1e-3
    # within a few dB of the level Piper chooses (the peak at full scale)
    assert 10 ** (-6 / 20) < gain * peak <= 1.0


async def test_first_words_are_heard_before_the_rest_of_their_sentence_is_decoded(
    synth: Synthesizer,
) -> None:
    """After the first window, the pool's worker is held: the first piece is out all the same,
    and the rest of the sentence comes once the worker is free."""
    release = threading.Event()
    pieces: list[bytes] = []
    first_piece = asyncio.Event()

    async def listen() -> None:
        async for piece in synth.synthesize(TEXT, urgent=True):
            pieces.append(piece)
            if len(pieces) == 1:
                synth._executor.submit(release.wait, 10, priority=URGENT)
                first_piece.set()

    listening = asyncio.create_task(listen())
    try:
        await asyncio.wait_for(first_piece.wait(), 30)
        await asyncio.sleep(0.3)  # the rest would be decoded by now, were the worker free
        assert len(pieces) == 1
        heard_ms = len(pieces[0]) / 2 / synth.sample_rate * 1000
        assert heard_ms == pytest.approx(FIRST_FRAMES * 256 / synth.sample_rate * 1000)
    finally:
        release.set()
    await asyncio.wait_for(listening, 30)
    total = b"".join(pieces)
    assert len(total) == len(synth.synthesize_all(TEXT))


async def test_first_words_are_decoded_whole_while_other_work_competes(
    synth: Synthesizer,
) -> None:
    synth.also_contended = lambda: True  # e.g. a Whisper decode under way: one thread, whole
    try:
        started = time.monotonic()
        pieces = [piece async for piece in synth.synthesize(TEXT, urgent=True)]
        assert time.monotonic() - started < 30
    finally:
        synth.also_contended = lambda: False
    assert b"".join(pieces) != b"".join(
        [piece async for piece in synth.synthesize(TEXT, urgent=True)]
    )  # (the lean graph at Piper's gain, against windows at the voice's)


class _Counting:
    """An onnxruntime session that counts its runs."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.runs = inner, 0

    def run(self, *args: Any) -> Any:
        self.runs += 1
        return self.inner.run(*args)


def _joined(pieces: list[tuple[np.ndarray, bool]]) -> np.ndarray:
    return np.concatenate([audio for audio, _last in pieces])


def test_the_rest_is_decoded_on_one_thread_when_other_work_competes_by_then(
    synth: Synthesizer,
) -> None:
    split = _split(synth)
    lean = split.lean_decoder
    assert lean is not None
    assert lean.get_session_options().intra_op_num_threads == 1
    feed = noiseless_inputs(synth._voice, TEXT)
    calm = list(stream_sentence(split, feed, synth.sample_rate))
    counting = split.lean_decoder = _Counting(lean)
    try:
        crowded = list(stream_sentence(split, feed, synth.sample_rate, lambda: True))
    finally:
        split.lean_decoder = lean
    assert counting.runs == len(calm) - 1  # the windows after the first
    assert np.array_equal(crowded[0][0], calm[0][0])
    assert float(np.max(np.abs(_joined(crowded) - _joined(calm)))) < 1e-4


class _HeldAfterFirstPiece:
    """The real synthesizer, each synthesis held after its first piece until :attr:`go` is
    set: what a caller hears before then was played before its chunk was synthesized whole."""

    def __init__(self, inner: Synthesizer) -> None:
        self.inner = inner
        self.go = asyncio.Event()

    @property
    def sample_rate(self) -> int:
        return self.inner.sample_rate

    async def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncIterator[bytes]:
        pieces = 0
        async for pcm in self.inner.synthesize(text, urgent=urgent, slack_s=slack_s):
            yield pcm
            pieces += 1
            if pieces == 1:
                await self.go.wait()

    @property
    def backlog(self) -> int:
        return self.inner.backlog

    async def aclose(self) -> None:
        """The inner synthesizer is the module's."""


ANSWER = "It should arrive on Friday, before noon."


async def test_a_joining_first_chunk_is_heard_before_its_synthesis_ends(
    synth: Synthesizer, llm: ScriptedLLM, calls: list[VoiceCall]
) -> None:
    """The answer's first chunk ("It should arrive") goes on into the next one, so the silence
    Piper ends it with is cut; its sound is played (and ``tts_start`` sent) as it comes, not
    once it is whole."""
    llm.script(answers_by_words({}, ANSWER))
    held = _HeldAfterFirstPiece(synth)
    playbook = load_playbook(EXAMPLES / "support.yaml")
    call = start_call(playbook, llm.base_url, settings=SessionSettings(greet=False), tts=held)
    calls.append(call)
    await call.say(piper_speech("When will my parcel arrive?"), 200)
    await call.line.wait_until(lambda: _peak(call.line.recording) > 3000, 60)  # its voice
    assert not held.go.is_set()
    assert call.of_type("tts_start"), "clients hear of it as it plays, not once it is made"
    held.go.set()
    first = await call.wait_event("agent_sentence", timeout_s=30)
    assert joins_next(first.data["text"]), first.data  # the case under test
    await call.wait_idle(60)
    heard = await transcriber().transcribe(bytes(call.line.recording))
    assert word_error_rate(heard.text, ANSWER) <= 0.15  # nothing lost or played twice


def _peak(pcm: bytearray) -> int:
    return int(np.max(np.abs(np.frombuffer(bytes(pcm), np.int16)))) if pcm else 0
