"""Component microbenchmarks on the real models: Whisper STT per utterance length, Piper TTS first
audio and real-time factor, webrtcvad segmentation per 20 ms frame, sentence chunker throughput.

Every measurement runs once untimed (warm-up), then ``repeats`` timed times with
:func:`time.perf_counter` (VAD: :func:`time.perf_counter_ns`). All speech is real: Piper speech of
a fixed passage, resampled to 16 kHz with the server's :class:`~media.audio.Resampler`.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from media import FRAME_BYTES, FRAME_MS, SAMPLE_RATE, Resampler, SentenceChunker, VadSegmenter
from media.audio import silence
from media.stt import Transcriber
from media.tts import Synthesizer

__all__ = ["CHUNKER_ANSWER", "STT_PASSAGE", "MicroSettings", "p90", "run_micro"]

STT_PASSAGE = (
    "Thanks for calling the harbour restaurant.",
    "We are open every day from noon until eleven in the evening, and the kitchen takes its last "
    "orders at ten.",
    "I can book a table for you, tell you about tonight's specials, or help with a booking you "
    "already have.",
    "If you are coming with a large group, please let me know how many people and what time suits "
    "you best.",
    "Parking is free behind the building after six.",
)
"""Spoken by Piper one sentence at a time, until the longest STT length is covered (~24 s)."""

CHUNKER_ANSWER = (
    "Sure! Here's what I found for your trip to St. Ives on Sat. the 14th.\n\n"
    "1. **The harbour walk** starts at 9:30 a.m. and takes about 2.5 hours, e.g. with a stop "
    "at the lighthouse; it costs £12 per adult, and children under 5 go free.\n"
    "2. The Tate gallery opens at 10 and closes at 5:20 p.m. - tickets are cheaper online at "
    "https://www.tate.org.uk/visit, so book ahead if you can.\n"
    "3. For dinner, Dr. Porthminster's beach café (see the [menu](https://example.com/menu)) "
    "has a set menu at 6:45, which Mr. Jones at the front desk can reserve for you.\n\n"
    "The forecast says 18 °C with light wind, so bring a jacket for the evening. Would you like "
    "me to book the walk, the café, or both? I can also check train times from London "
    "Paddington, which take roughly five and a half hours with one change at St. Erth."
)
"""A realistic streamed LLM answer: markdown, a list, abbreviations, times, decimals, a URL."""

_STT_GAP_MS = 700
"""Silence between repeats of the passage in the VAD stream (longer than the end silence)."""


@dataclass(frozen=True)
class MicroSettings:
    """What to measure and how often. Lengths in seconds."""

    repeats: int = 5
    """Timed repetitions per STT, TTS and VAD measurement (after one untimed warm-up)."""
    stt_lengths_s: tuple[float, ...] = (1.0, 3.0, 6.0, 10.0)
    """Utterance lengths (s) of real speech fed to Whisper."""
    tts_sentences: tuple[str, ...] = (
        "Sure, I can help.",
        "Your table for two is booked at seven thirty tonight, by the window.",
        "The museum is open from nine in the morning until six in the evening on weekdays, and "
        "on weekends it closes at four, so arrive early to avoid the queues.",
    )
    """Sentences Piper speaks: short (~4 words), medium (~12), long (~30)."""
    vad_frames: int = 5000
    """20 ms frames pushed through the VAD segmenter per repetition."""
    chunker_repeats: int = 200
    """Timed passes of :data:`CHUNKER_ANSWER` through a fresh chunker."""

    def __post_init__(self) -> None:
        for name in ("repeats", "vad_frames", "chunker_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if any(not length > 0 for length in self.stt_lengths_s):
            raise ValueError("stt_lengths_s must be positive")
        if any(not text.strip() for text in self.tts_sentences):
            raise ValueError("tts_sentences must not be blank")


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value with >= 90 % of values at or
    below it."""
    if not values:
        raise ValueError("p90 of no values")
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def run_micro(
    settings: MicroSettings,
    transcriber: Transcriber,
    synthesizer: Synthesizer,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run every microbenchmark on loaded, warm models; ``progress`` gets a message before each
    measurement group. Returns JSON-able results (times in ms or µs, audio in s)::

        {"stt": [{"audio_s", "median_ms", "p90_ms", "min_ms"}, ...],
         "tts": [{"chars", "audio_s", "first_audio_ms_median", "total_ms_median",
                  "rtf_median"}, ...],
         "vad": {"frames", "us_per_frame_median"},
         "chunker": {"chars", "chars_per_s", "us_per_delta"}}
    """
    progress("preparing real speech (Piper, resampled to 16 kHz)")
    speech = _passage_speech(synthesizer, max(settings.stt_lengths_s, default=0.0))
    stt = [
        _bench_stt(transcriber, speech, length, settings.repeats, progress)
        for length in settings.stt_lengths_s
    ]
    tts = [
        _bench_tts(synthesizer, text, settings.repeats, progress) for text in settings.tts_sentences
    ]
    progress(f"VAD: {settings.vad_frames} frames of 20 ms")
    vad = _bench_vad(speech, settings.vad_frames, settings.repeats)
    progress(f"chunker: {settings.chunker_repeats} passes of a {len(CHUNKER_ANSWER)}-char answer")
    chunker = _bench_chunker(settings.chunker_repeats)
    results: dict[str, Any] = {"stt": stt, "tts": tts, "vad": vad, "chunker": chunker}
    _check_positive(results)
    return results


def _passage_speech(synthesizer: Synthesizer, min_s: float) -> bytes:
    """:data:`STT_PASSAGE` spoken sentence by sentence until at least ``min_s`` seconds (or the
    passage ends; at least one sentence): 16 kHz PCM16 cut to whole 20 ms frames."""
    resampler = Resampler(synthesizer.sample_rate, SAMPLE_RATE)
    pcm = bytearray()
    for sentence in STT_PASSAGE:
        pcm += resampler.resample(synthesizer.synthesize_all(sentence))
        if len(pcm) / 2 / SAMPLE_RATE >= min_s:
            break
    pcm += resampler.flush()
    return bytes(pcm[: len(pcm) // FRAME_BYTES * FRAME_BYTES])


def _utterance(speech: bytes, seconds: float) -> bytes:
    """The first ``seconds`` of ``speech``, padded with trailing silence if it is shorter."""
    size = round(seconds * SAMPLE_RATE) * 2
    return speech[:size] + bytes(max(0, size - len(speech)))


def _bench_stt(
    transcriber: Transcriber,
    speech: bytes,
    seconds: float,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Whisper decode of ``seconds`` of real speech on the server's path (``_decode``, the body
    of ``transcribe`` that runs in the worker thread), in ms."""
    progress(f"STT: {seconds:g} s of speech")
    pcm = _utterance(speech, seconds)
    transcriber._decode(pcm)
    times_ms: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        transcriber._decode(pcm)
        times_ms.append((time.perf_counter() - started) * 1000)
    return {
        "audio_s": len(pcm) / 2 / SAMPLE_RATE,
        "median_ms": statistics.median(times_ms),
        "p90_ms": p90(times_ms),
        "min_ms": min(times_ms),
    }


def _synthesize_timed(synthesizer: Synthesizer, text: str) -> tuple[float, float, int]:
    """One synthesis through ``_chunks`` (what the server's worker steps through for an answer's
    first words: its first sentence streamed where the voice allows): (s to the first chunk, s
    to the last, bytes of PCM16)."""
    started = time.perf_counter()
    first: float | None = None
    size = 0
    for chunk, _last in synthesizer._chunks(text, stream_first=True):
        if first is None:
            first = time.perf_counter() - started
        size += len(chunk)
    total = time.perf_counter() - started
    if first is None or size == 0:
        raise RuntimeError(f"Piper produced no audio for {text!r}")
    return first, total, size


def _bench_tts(
    synthesizer: Synthesizer, text: str, repeats: int, progress: Callable[[str], None]
) -> dict[str, float]:
    """Piper time to first audio and to all audio (ms), and real-time factor (synthesis time /
    audio duration, both medians over the runs)."""
    progress(f"TTS: {len(text.split())} words, {len(text)} chars")
    _synthesize_timed(synthesizer, text)
    firsts: list[float] = []
    totals: list[float] = []
    durations: list[float] = []
    rtfs: list[float] = []
    for _ in range(repeats):
        first, total, size = _synthesize_timed(synthesizer, text)
        audio_s = size / 2 / synthesizer.sample_rate
        firsts.append(first)
        totals.append(total)
        durations.append(audio_s)
        rtfs.append(total / audio_s)
    return {
        "chars": len(text),
        "audio_s": statistics.median(durations),
        "first_audio_ms_median": statistics.median(firsts) * 1000,
        "total_ms_median": statistics.median(totals) * 1000,
        "rtf_median": statistics.median(rtfs),
    }


def _bench_vad(speech: bytes, frames: int, repeats: int) -> dict[str, float]:
    """:meth:`VadSegmenter.push` over ``frames`` real frames (the passage with pauses, looped, so
    utterances start and end as on a call): median over runs of the mean µs per frame."""
    stream = speech + silence(_STT_GAP_MS)
    stream = stream[: len(stream) // FRAME_BYTES * FRAME_BYTES]
    count = len(stream) // FRAME_BYTES
    pool = [stream[i * FRAME_BYTES : (i + 1) * FRAME_BYTES] for i in range(count)]
    feed = [pool[k % count] for k in range(frames)]
    frame_s = FRAME_MS / 1000

    def run() -> int:
        segmenter = VadSegmenter()
        started = time.perf_counter_ns()
        for k, frame in enumerate(feed):
            segmenter.push(frame, k * frame_s)
        return time.perf_counter_ns() - started

    run()
    per_frame_us = [run() / frames / 1000 for _ in range(repeats)]
    return {"frames": frames, "us_per_frame_median": statistics.median(per_frame_us)}


def _bench_chunker(repeats: int) -> dict[str, float]:
    """:class:`SentenceChunker` over :data:`CHUNKER_ANSWER` streamed as word-sized deltas (each
    word with its leading whitespace, as LLM tokens come), ``flush`` included."""
    deltas = re.findall(r"\s*\S+", CHUNKER_ANSWER)

    def run() -> float:
        chunker = SentenceChunker()
        chunks = 0
        started = time.perf_counter()
        for delta in deltas:
            chunks += len(chunker.push(delta))
        chunks += len(chunker.flush())
        elapsed = time.perf_counter() - started
        if chunks < 2:
            raise RuntimeError("the chunker did not split the answer into sentences")
        return elapsed

    run()
    median_s = statistics.median(run() for _ in range(repeats))
    return {
        "chars": len(CHUNKER_ANSWER),
        "chars_per_s": len(CHUNKER_ANSWER) / median_s,
        "us_per_delta": median_s / len(deltas) * 1e6,
    }


def _check_positive(value: object, where: str = "results") -> None:
    """Every number in ``value`` is finite and positive (a zero or NaN means a broken timer)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_positive(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_positive(item, f"{where}[{index}]")
    elif isinstance(value, int | float) and not (math.isfinite(value) and value > 0):
        raise RuntimeError(f"{where} is {value!r}, not a finite positive number")
