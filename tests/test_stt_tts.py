"""Real Whisper and real Piper: speech round trips (Piper and a second voice, espeak-ng), noise is
dropped, decoding and synthesis stay off the event loop, synthesis streams in short pieces and
stops promptly when its consumer is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import wave
from collections.abc import Awaitable
from pathlib import Path

import numpy as np
import pytest

from media import Synthesizer, SynthesizerSettings, Transcriber, Transcript
from media.audio import duration_ms, silence
from media.priority_pool import URGENT
from media.stt import loops, repeats
from media.tts import PIECE_MS, LoadAwareSession
from tests.support import speech
from tests.support.speech import espeak_wav, to_16k, white_noise, word_error_rate, words

pytestmark = pytest.mark.slow

SENTENCES = [
    f"This is sentence number {n} of a long answer about the opening hours." for n in range(12)
]
LONG_TEXT = " ".join(SENTENCES)


@pytest.fixture(scope="module")
def transcriber() -> Transcriber:
    return speech.transcriber()


@pytest.fixture(scope="module")
def synth() -> Synthesizer:
    return speech.synthesizer()


async def max_tick_gap(work: Awaitable[object]) -> tuple[float, int]:
    """Run ``work`` while a task ticks every 10 ms: (largest gap between ticks in s, ticks)."""
    gaps: list[float] = []
    running = True

    async def tick() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.03)  # the ticker is running before the work starts
    gaps.clear()
    try:
        await work
    finally:
        running = False
        await ticker
    return max(gaps), len(gaps)


# --- speech to text ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Please book a table for four people at seven o'clock tomorrow evening.",
        "I would like to change my delivery address to the new office.",
    ],
)
async def test_piper_speech_transcribes_back_to_the_same_words(
    transcriber: Transcriber, text: str
) -> None:
    audio = silence(300) + speech.piper_speech(text) + silence(300)
    transcript = await transcriber.transcribe(audio)
    assert transcript.dropped is None
    assert word_error_rate(transcript.text, text) <= 0.1, transcript.text
    assert transcript.audio_ms == duration_ms(audio)
    assert transcript.compute_ms > 0
    assert transcript.avg_logprob is not None
    assert transcript.no_speech_prob is not None
    assert transcript.no_speech_prob < 0.5


async def test_the_short_context_hears_what_the_full_window_hears(
    transcriber: Transcriber,
) -> None:
    """Short utterances are where a trimmed encoder context makes Whisper loop; the margin and
    the length cap must keep (nearly all) the words of the 30 s window."""
    full = transcriber.variant(context_margin_s=None)
    try:
        for text in ("Yes.", "No thanks.", "Can I still cancel it?", "Tell me all about it."):
            audio = silence(200) + speech.piper_speech(text) + silence(400)
            short, reference = await transcriber.transcribe(audio), await full.transcribe(audio)
            assert word_error_rate(short.text, reference.text) <= 0.2, (short.text, reference.text)
            assert word_error_rate(short.text, text) <= 0.25, short.text
    finally:
        full.close()


async def test_a_decode_that_repeats_itself_is_heard_again_with_more_silence(
    transcriber: Transcriber, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller who says the same thing twice reads, at the short margin, like Whisper looping:
    the decode is done again with more silence, then with the full window, whose words are the
    transcript (a real repeat is kept)."""
    question = speech.piper_speech("Where is my order?")
    audio = silence(200) + question + silence(300) + question + silence(400)
    settings = transcriber.settings
    assert settings.context_margin_s is not None
    assert settings.recheck_margin_s > settings.context_margin_s
    full = transcriber.variant(context_margin_s=None)
    try:
        with caplog.at_level("DEBUG", logger="media.stt"):
            transcript = await transcriber.transcribe(audio)
        assert caplog.text.count("repeats itself") == 2
        assert transcript.text == (await full.transcribe(audio)).text
        assert words(transcript.text).count("order") == 2, transcript.text
    finally:
        full.close()


def test_words_placed_after_the_audio_ends_are_not_heard(transcriber: Transcriber) -> None:
    """The short context decodes with timestamps: a segment that starts after the audio's end
    is the decoder describing the padding (tiny.en saying the words again), not the caller."""
    short = transcriber._short
    assert short is not None
    tokenizer = short.tokenizer

    def at(seconds: float) -> int:
        return int(tokenizer.timestamp_begin + round(seconds / short.SECONDS_PER_TIMESTAMP))

    question = tokenizer.encode(" Where is my order?")
    tokens = [at(0.0), *question, at(1.2), at(1.4), *question, at(2.0)]
    assert short._heard_text(tokens, seconds=1.32) == "Where is my order?"
    twice = short._heard_text(tokens, seconds=2.4)  # said twice within the audio: both kept
    assert twice == "Where is my order? Where is my order?"
    assert short._heard_text([at(0.0), *question], seconds=1.0) == "Where is my order?"
    assert short._heard_text([at(1.5), *question, at(2.0)], seconds=1.0) == ""


def test_repeats_finds_a_text_that_says_its_beginning_again() -> None:
    assert repeats("Where's my order? Where's my order? Where")
    assert repeats("Can I still cancel it? Can I still cancel")
    assert repeats("Thank you, thank you.")
    assert repeats("Hello? Hello?")
    assert not repeats("Where is my order?")
    assert not repeats("I said yes, yes.")  # not its beginning
    assert not repeats("Hello.")
    assert not repeats("")
    assert loops("No, no, no, no, no, no, no, no, no, no,")  # Whisper at its token cap
    assert not loops("Where is my order? Where is my order?")  # a caller who says it twice
    assert not loops("No, no, no, no, no, no.")
    assert not loops("")


async def test_a_decode_that_loops_in_every_window_is_heard_without_the_loop(
    transcriber: Transcriber, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's "No, sorry, we are closed on Mondays." as a caller heard it (with the holes
    a stalled playout leaves): Whisper says "No, no, no, ..." at both short margins and in its
    full window. Decoded once more without repeated 3-grams, the words come back."""
    with wave.open(str(Path(__file__).parent / "audio" / "whisper_loops.wav")) as recording:
        pcm = recording.readframes(recording.getnframes())
    with caplog.at_level("DEBUG", logger="media.stt"):
        transcript = await transcriber.transcribe(pcm)
    assert "the full window loops too" in caplog.text
    assert not loops(transcript.text), transcript.text
    assert "sorry" in words(transcript.text), transcript.text


@pytest.mark.parametrize(
    "text", ["Please call me back tomorrow morning.", "I want to cancel my subscription today."]
)
async def test_a_second_voice_espeak_ng_is_transcribed(
    transcriber: Transcriber, tmp_path: Path, text: str
) -> None:
    pcm, rate = espeak_wav(text, tmp_path / "espeak.wav", "-v", "en-us", "-s", "140")
    assert rate == 22_050
    audio = to_16k(pcm, rate)
    assert duration_ms(audio) == pytest.approx(len(pcm) / 2 / rate * 1000, abs=5)
    transcript = await transcriber.transcribe(audio)
    assert transcript.dropped is None
    assert word_error_rate(transcript.text, text) <= 0.2, transcript.text


@pytest.mark.parametrize(
    "audio",
    [
        pytest.param(silence(2000), id="silence"),
        pytest.param(white_noise(2000, -20, seed=1), id="loud-white-noise"),
        pytest.param(white_noise(2000, -45, seed=2), id="faint-white-noise"),
    ],
)
async def test_silence_and_noise_give_no_text(transcriber: Transcriber, audio: bytes) -> None:
    transcript = await transcriber.transcribe(audio)
    assert transcript.text == ""
    assert transcript.dropped


async def test_transcription_runs_off_the_event_loop(transcriber: Transcriber) -> None:
    # many words, so that even a fast CPU decodes for a while: a stalled loop would show
    text = (
        "Please book a table for four people at seven o'clock tomorrow evening. We would like "
        "a quiet table by the window, and one of us needs a high chair for a small child."
    )
    audio = silence(300) + speech.piper_speech(text) + silence(300)
    result: list[Transcript] = []

    async def decode() -> None:
        result.append(await transcriber.transcribe(audio))

    gap, ticks = await max_tick_gap(decode())
    decode_s = result[0].compute_ms / 1000
    assert word_error_rate(result[0].text, text) <= 0.15
    assert decode_s > 0.1
    # the loop kept ticking all along: no pause anywhere near the decode time
    assert gap < max(0.05, decode_s / 3), (gap, decode_s)
    assert ticks >= decode_s / 0.01 / 4


def _cpu_ticks_by_thread() -> dict[str, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


async def test_a_decode_keeps_one_core_busy_not_two(transcriber: Transcriber) -> None:
    """Whisper's decode computes on one thread and nothing spins beside it (numpy's BLAS pool
    spun a second thread ~0.1 s after each mel spectrogram, ~2/3 of the decode's own CPU:
    media.blas). Compared with the decode's own thread, whatever the CPU's speed."""
    audio = speech.piper_speech("Please book a table for four people at seven o'clock.")
    await transcriber.transcribe(audio)
    before = _cpu_ticks_by_thread()
    for _ in range(5):
        await transcriber.transcribe(audio)
    await asyncio.sleep(0.2)  # a spinning pool would spin on after the last decode
    gained = sorted(n - before.get(tid, 0) for tid, n in _cpu_ticks_by_thread().items())
    busiest, runner_up = gained[-1], gained[-2]
    assert busiest >= 5, f"the decodes took {busiest} ticks of one thread"
    assert runner_up <= max(2, busiest // 5), f"CPU ticks by thread: {gained[-4:]}"


async def test_concurrent_transcriptions_each_get_their_own_text(transcriber: Transcriber) -> None:
    first = "Please book a table for four people at seven o'clock tomorrow evening."
    second = "I would like to change my delivery address to the new office."
    heard = await asyncio.gather(
        transcriber.transcribe(speech.piper_speech(first)),
        transcriber.transcribe(speech.piper_speech(second)),
    )
    assert word_error_rate(heard[0].text, first) <= 0.1
    assert word_error_rate(heard[1].text, second) <= 0.1


async def test_the_decodes_needed_soonest_run_first(transcriber: Transcriber) -> None:
    """A turn that has ended is decoded before a speculative decode that came earlier and can
    wait (its answer could not start yet); equal needs go in order."""
    audio = speech.piper_speech("Please book a table for four people at seven o'clock.")
    finished: list[str] = []
    release = threading.Event()
    blocker = transcriber._pool.submit(release.wait, 10, priority=0)  # the worker is busy

    async def decode(name: str, slack_s: float) -> None:
        await transcriber.transcribe(audio, slack_s=slack_s)
        finished.append(name)

    tasks = []
    try:
        for name, slack_s in [("speculative", 5.0), ("ended", 0.0), ("next", 0.0)]:
            tasks.append(asyncio.create_task(decode(name, slack_s)))
            await asyncio.sleep(0.005)  # submitted in this order
    finally:
        release.set()
    await asyncio.wrap_future(blocker)
    await asyncio.gather(*tasks)
    assert finished == ["ended", "next", "speculative"]


async def test_a_cancelled_transcription_leaves_the_transcriber_working(
    transcriber: Transcriber,
) -> None:
    text = "I would like to change my delivery address to the new office."
    audio = speech.piper_speech(text)
    task = asyncio.create_task(transcriber.transcribe(audio))
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - started < 0.2  # the caller is not held by the decode
    transcript = await transcriber.transcribe(audio)
    assert word_error_rate(transcript.text, text) <= 0.1


# --- text to speech ---------------------------------------------------------------------------


async def test_synthesis_streams_pieces_of_at_most_piece_ms(synth: Synthesizer) -> None:
    text = "Hello there. Your table for four is booked for seven o'clock tomorrow evening."
    assert synth.sample_rate == 22_050
    max_piece = synth.sample_rate * PIECE_MS // 1000 * 2
    pieces = [piece async for piece in synth.synthesize(text)]
    assert len(pieces) > 5
    assert all(0 < len(piece) <= max_piece and len(piece) % 2 == 0 for piece in pieces)
    total = b"".join(pieces)
    reference = synth.synthesize_all(text)
    # Piper varies its timing slightly from run to run: the same text, about the same length
    assert len(total) == pytest.approx(len(reference), rel=0.1)
    heard = await speech.transcriber().transcribe(to_16k(total, synth.sample_rate))
    assert word_error_rate(heard.text, text) <= 0.15, heard.text


def test_each_sentence_says_whether_it_is_the_last(synth: Synthesizer) -> None:
    assert [last for _pcm, last in synth._chunks("Hello there.")] == [True]
    flags = [last for _pcm, last in synth._chunks("One thing. Another thing. The end.")]
    assert flags == [False, False, True]


async def test_a_stream_ends_with_its_last_sentence_without_waiting_for_the_pool(
    synth: Synthesizer,
) -> None:
    """Once the last sentence's audio is out, the stream ends: it does not queue one more step
    (behind other calls' syntheses) only to learn that there is nothing more."""
    pool = synth._later  # (first words may take two steps: see test_first_words_...)
    release = threading.Event()
    pieces: list[bytes] = []

    async def listen() -> None:
        async for piece in synth.synthesize("Hello there."):
            pieces.append(piece)

    listening = asyncio.create_task(listen())
    await asyncio.sleep(0)  # its first step is submitted
    deadline = time.monotonic() + 5
    while pool.waiting:  # until the worker took it
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    # the worker is busy after that step: this work goes before any step submitted later
    blocker = pool.submit(release.wait, 10, priority=URGENT)
    try:
        await asyncio.wait_for(listening, 5)
        assert pieces
    finally:
        release.set()
        await asyncio.wrap_future(blocker)


async def test_nothing_to_say_yields_nothing(synth: Synthesizer) -> None:
    assert [piece async for piece in synth.synthesize("")] == []
    assert [piece async for piece in synth.synthesize("   ")] == []


async def test_synthesis_runs_off_the_event_loop(synth: Synthesizer) -> None:
    pieces: list[bytes] = []

    async def consume() -> None:
        pieces.extend([piece async for piece in synth.synthesize(" ".join(SENTENCES[:5]))])

    started = time.perf_counter()
    gap, _ = await max_tick_gap(consume())
    elapsed = time.perf_counter() - started
    assert duration_ms(b"".join(pieces), synth.sample_rate) > 12_000
    assert gap < max(0.05, elapsed / 10), (gap, elapsed)


async def test_cancelling_the_consumer_stops_synthesis_promptly(synth: Synthesizer) -> None:
    pieces: list[bytes] = []
    first_piece = asyncio.Event()

    async def consume() -> None:
        async for piece in synth.synthesize(LONG_TEXT):
            pieces.append(piece)
            first_piece.set()

    started = time.perf_counter()
    task = asyncio.create_task(consume())
    await first_piece.wait()
    sentence_s = time.perf_counter() - started  # Piper synthesizes one sentence per step
    cancelled_at = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - cancelled_at < 0.2
    assert duration_ms(b"".join(pieces), synth.sample_rate) < 10_000  # far from the whole text

    # the worker is free again at once: at most the step in flight finishes, not the 11
    # sentences left of the abandoned text
    started = time.perf_counter()
    agen = synth.synthesize("Are you still there?")
    async with contextlib.aclosing(agen):
        first = await anext(agen)
        first_piece_s = time.perf_counter() - started
        rest = [piece async for piece in agen]
    assert first
    assert first_piece_s < 4 * sentence_s, (first_piece_s, sentence_s)
    heard = await speech.transcriber().transcribe(to_16k(first + b"".join(rest), synth.sample_rate))
    assert words(heard.text) == ["are", "you", "still", "there"], heard.text


async def test_a_consumer_cancelled_between_pieces_closes_the_stream(synth: Synthesizer) -> None:
    """The consumer is cancelled while it holds a piece (e.g. waiting for the speaker)."""
    pieces: list[bytes] = []
    holding = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(synth.synthesize(LONG_TEXT)) as stream:
            async for piece in stream:
                pieces.append(piece)
                holding.set()
                await asyncio.sleep(10)  # playing it

    task = asyncio.create_task(consume())
    await holding.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(pieces) == 1
    again = [piece async for piece in synth.synthesize("Hello again.")]
    assert duration_ms(b"".join(again), synth.sample_rate) > 300


def test_a_missing_voice_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Piper voice"):
        Synthesizer.load(SynthesizerSettings(voice=str(tmp_path / "nobody.onnx")))


async def test_deterministic_synthesis_says_a_text_the_same_way_every_time(
    synth: Synthesizer,
) -> None:
    assert synth.settings.deterministic  # the tests' voice
    text = "Stop, stop, that is enough."
    later = [  # needed in a minute: never made again in the urgent pool (see LATE_GRACE_S)
        b"".join([piece async for piece in synth.synthesize(text, slack_s=60)]) for _ in range(2)
    ]
    first_words = [
        b"".join([piece async for piece in synth.synthesize(text, urgent=True)]) for _ in range(2)
    ]
    whole = synth.synthesize_all(text)  # every core, the graph as exported (split in two)
    assert later[0] == later[1]  # a later sentence: one thread, the rewritten graph
    assert first_words[0] == first_words[1]  # in windows, at the voice's gain
    assert len(later[0]) == len(first_words[0]) == len(whole) > 0
    # the two graphs do the same arithmetic, to the rounding of the last bit
    apart = np.frombuffer(later[0], np.int16).astype(np.int32) - np.frombuffer(whole, np.int16)
    assert int(np.abs(apart).max()) <= 2


async def test_a_synthesizer_on_one_thread_says_the_same_as_on_every_core(
    synth: Synthesizer,
) -> None:
    lean = Synthesizer.load(SynthesizerSettings(threads=1, deterministic=True))
    try:
        options = lean._voice.session.get_session_options()
        assert options.intra_op_num_threads == 1
        text = "Your order left our warehouse yesterday."
        heard = await asyncio.to_thread(lean.synthesize_all, text)
        expected = len(synth.synthesize_all(text))
        assert abs(len(heard) - expected) <= expected // 100  # the same durations, give or take
    finally:
        lean.close()


async def test_the_default_synthesizer_runs_lean_while_other_work_waits() -> None:
    synth = Synthesizer.load(SynthesizerSettings(deterministic=True))
    try:
        session = synth._voice.session
        assert isinstance(session, LoadAwareSession)
        assert session.lean.get_session_options().intra_op_num_threads == 1
        ran: list[str] = []
        for name in ("full", "lean"):
            inner = getattr(session, name)
            setattr(session, name, _Recording(inner, name, ran))
        text = "Your order left our warehouse yesterday."
        alone = await asyncio.to_thread(synth.synthesize_all, text)
        synth.also_contended = lambda: True  # e.g. a Whisper decode under way
        crowded = await asyncio.to_thread(synth.synthesize_all, text)
        assert ran == ["full", "lean"]
        assert abs(len(alone) - len(crowded)) <= len(alone) // 100
    finally:
        synth.close()


class _Recording:
    """An ONNX session that notes its name each time it runs."""

    def __init__(self, inner: object, name: str, ran: list[str]) -> None:
        self.inner, self.name, self.ran = inner, name, ran

    def run(self, *args: object, **kwargs: object) -> object:
        self.ran.append(self.name)
        return self.inner.run(*args, **kwargs)  # type: ignore[attr-defined]
