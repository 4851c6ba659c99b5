"""One spoken turn: transcript -> PlaybookOrchestrator -> sentence chunks -> Piper -> speaker.

Phase 1 never reaches the speaker. The first sentence is synthesized while the LLM still streams
the rest, and sentence n+1 is synthesized while n plays. The turn returns when its audio has left
the speaker. Cancelling it (barge-in) abandons the LLM stream and TTS; the orchestrator then keeps
only the sentences that finished playing, marked interrupted.

Each sentence is spoken in the voice in effect when its text arrived (the stage's, layered with
the language's; see :meth:`PlaybookEngine.voice`): a transition or ``set_language`` switches the
voice from the next sentence on, so a new stage's greeting is already in its voice.

When a stage delegates to workers, its ``say`` line is queued as soon as they start (they run
on meanwhile) and the answer with their results follows it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from media import (
    SentenceChunker,
    Speaker,
    SpeechEnded,
    SpeechToText,
    TextToSpeech,
    Transcript,
    joins_next,
    speakable,
)
from media.audio import KEEP_AFTER_SOUND_MS, sounding_length, trim_leading_silence
from media.speaker import Playback, PlaybackResult
from media.tts import VoiceSettings, VoiceVariants
from playbooks import BargeInPolicy, OrchestratorEvent, PlaybookOrchestrator, Retraction, Turn
from playbooks.models import Voice

from .events import (
    EmitVoiceEvent,
    VoiceEvent,
    VoiceEventHandler,
    VoiceEventType,
    voice_event_of,
)
from .timeline import TurnTimeline

__all__ = ["SpokenVoice", "VoicePlaybookOrchestrator"]

log = logging.getLogger(__name__)

FIRST_PHRASE_MIN_WORDS = 3
"""An answer's first chunk may end before a phrase-opening word once it holds this many words
(``SentenceChunker.first_phrase_min_words``): "It should arrive" is synthesized while "on Friday
morning." still streams, and the two are joined without the silence Piper puts around each."""


@dataclass(frozen=True)
class SpokenVoice:
    """A playbook voice bound to a speech engine; ``id`` names it in events."""

    tts: TextToSpeech
    id: str | None


class VoicePlaybookOrchestrator:
    """Speaks a playbook conversation for one call. One turn at a time (the session ensures it)."""

    def __init__(
        self,
        orchestrator: PlaybookOrchestrator,
        transcriber: SpeechToText,
        synthesizer: TextToSpeech,
        speaker: Speaker,
        emit: VoiceEventHandler,
        *,
        clock: Callable[[], float] = time.monotonic,
        notice: str = "",
    ) -> None:
        self.orchestrator = orchestrator
        self.transcriber = transcriber
        self.synthesizer = synthesizer
        self.speaker = speaker
        self._emit_event = emit
        self.clock = clock
        self.emit: EmitVoiceEvent = self._emit_kind
        """Emit a voice event: its kind, then its payload as keywords (checked by mypy against
        the kind's payload type)."""
        self.heard = ""
        """What the caller has heard of the current answer (whole sentences)."""
        self.turn_started = False
        """Whether the current turn has reached the LLM (so history holds its user message)."""
        self._voices: dict[Voice | None, SpokenVoice] = {}
        self._speech: _Speech | None = None
        self.notice = notice
        """Said before anything else when the call starts (a recording notice), by the first
        :meth:`greet`."""
        orchestrator.on(self._forward)

    def barge_in(self, default: BargeInPolicy) -> BargeInPolicy:
        """The current stage's barge-in policy (``default`` when it sets none)."""
        stage = self.orchestrator.engine.stage
        if not stage.interruptible:
            return "disabled"
        return stage.barge_in or default

    def voice(self) -> SpokenVoice:
        """The voice in effect now. Another voice needs a synthesizer with variants (local
        Piper: voice files; remote: voice names; both: speaking rates); with any other, the
        server's voice is kept (logged)."""
        spec = self.orchestrator.engine.voice()
        found = self._voices.get(spec)
        if found is not None:
            return found
        synthesizer = self.synthesizer
        base_id = synthesizer.voice_id if isinstance(synthesizer, VoiceVariants) else None
        if spec is None:
            found = SpokenVoice(synthesizer, base_id)
        else:
            voice_id = spec.id or (Path(spec.model).stem if spec.model else spec.name or base_id)
            settings = VoiceSettings(spec.model, spec.speaking_rate, spec.speaker, spec.name)
            if isinstance(synthesizer, VoiceVariants):
                found = SpokenVoice(synthesizer.variant(settings), voice_id)
            else:
                log.warning("this speech engine has no voice variants; voice %s ignored", voice_id)
                found = SpokenVoice(synthesizer, voice_id)
        self._voices[spec] = found
        return found

    def _emit_kind(self, type: VoiceEventType, /, **data: Any) -> None:
        self._emit_event(VoiceEvent(type, data, self.clock()))

    def emit_transcript(self, heard: Transcript, *, speculative: bool) -> None:
        """The ``transcript`` event of what Whisper heard."""
        self.emit(
            "transcript",
            text=heard.text,
            dropped=heard.dropped,
            audio_ms=round(heard.audio_ms),
            stt_ms=round(heard.compute_ms),
            speculative=speculative,
        )

    async def greet(self, *, stage_greeting: bool = True) -> None:
        """Speak the :attr:`notice` (once; outside the conversation), then the current stage's
        greeting if it has one and ``stage_greeting``; history keeps what was heard of it."""
        notice, self.notice = self.notice, ""
        if notice:
            await self._speak(_once(notice), None, TurnTimeline())
        greeting = self.orchestrator.engine.stage.greeting if stage_greeting else None
        if greeting:
            await self.say(greeting)

    async def say(self, text: str) -> None:
        """Speak ``text`` outside a turn (the greeting, an idle prompt); the conversation keeps
        what the caller heard of it (a barge-in cuts it)."""
        self.heard = ""
        try:
            await self._speak(_once(text), None, TurnTimeline())
        finally:
            heard = self.heard
            self.orchestrator.record_said(heard, interrupted=heard != speakable(text))

    async def answer_utterance(
        self,
        utterance: SpeechEnded,
        transcript: Awaitable[Transcript] | None = None,
        *,
        speculative: bool = False,
    ) -> None:
        """Transcribe the caller's utterance (or take ``transcript``, a decode of the same words
        already under way; ``speculative`` when it began before the end of the turn) and answer
        it; noise makes no LLM call."""
        timeline = TurnTimeline(
            last_voiced_at=utterance.last_voiced_at, end_detected_at=utterance.detected_at
        )
        self.turn_started = False
        try:
            heard = await (transcript or self.transcriber.transcribe(utterance.audio))
        except Exception as exc:
            log.exception("transcription failed")
            self.emit("error", source="stt", message=f"{type(exc).__name__}: {exc}")
            await self._say_fallback()
            return
        timeline.stt_done_at = self.clock()
        self.emit_transcript(heard, speculative=speculative)
        if not heard.text:
            return
        await self.answer_text(heard.text, timeline)

    async def answer_text(
        self,
        text: str,
        timeline: TurnTimeline | None = None,
        confirmed: asyncio.Event | None = None,
    ) -> None:
        """Answer a user message (spoken and transcribed, or typed) in voice. ``confirmed``: a
        preemptive turn, whose tools with side effects wait for it (the caller of this method
        holds the audio until then)."""
        timeline = timeline or TurnTimeline(stt_done_at=self.clock())
        self.heard = ""
        self.turn_started = True
        async with self.orchestrator.turn(text, confirmed) as turn:
            await self._speak(aiter(turn), turn, timeline)

    async def _say_fallback(self) -> None:
        line = self.orchestrator.fallback_answer
        await self._speak(_once(line), None, TurnTimeline())

    async def _speak(
        self,
        deltas: AsyncIterator[str | Retraction],
        turn: Turn | None,
        timeline: TurnTimeline,
    ) -> None:
        """Chunk, synthesize and play ``deltas``; return once the audio has left the speaker."""
        speech = self._speech = _Speech(self, turn, timeline, self.voice())
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(speech.chunk(deltas))
                tasks.create_task(speech.synthesize())
            for playback in speech.playbacks:
                await playback.finished()
        finally:
            if self._speech is speech:
                self._speech = None
            if speech.started:
                self.emit("tts_end", heard=self.heard)
        if turn is not None and timeline.first_frame_at is None:
            self._emit_metrics(timeline)

    def _sentence_finished(self, sentence: str, turn: Turn | None) -> None:
        part = f" {sentence}" if self.heard else sentence
        self.heard += part
        if turn is not None:
            turn.mark_delivered(part)

    def _emit_metrics(self, timeline: TurnTimeline) -> None:
        self.emit("turn_metrics", **timeline.metrics_ms())

    def _forward(self, event: OrchestratorEvent) -> None:
        """The engine's events clients care about, as voice events (:func:`voice_event_of`);
        a stage or language change switches the voice first, a delegation speaks its line."""
        voice = None
        if event.type in ("stage_entered", "language_changed"):
            voice = self._switch_voice().id
        elif event.type == "delegation_start" and event.data.get("say") and self._speech:
            self._speech.interject(event.data["say"])  # the workers run on meanwhile
        translated = voice_event_of(event, self.clock(), voice=voice)
        if translated is not None:
            self._emit_event(translated)

    def _switch_voice(self) -> SpokenVoice:
        """The voice after a stage or language change; the answer being spoken goes on in it
        from its next sentence."""
        voice = self.voice()
        if self._speech is not None:
            self._speech.switch(voice)
        return voice


class _Speech:
    """The text-to-audio pipeline of one answer: a chunking task feeding a synthesis task."""

    def __init__(
        self,
        voice: VoicePlaybookOrchestrator,
        turn: Turn | None,
        timeline: TurnTimeline,
        spoken: SpokenVoice,
    ) -> None:
        self.voice = voice
        self.turn = turn
        self.timeline = timeline
        self.spoken = spoken
        """The voice of the sentences queued from now on."""
        self.chunker = SentenceChunker(first_phrase_min_words=FIRST_PHRASE_MIN_WORDS)
        self.sentences: asyncio.Queue[tuple[int, str, SpokenVoice, bool] | None] = asyncio.Queue()
        self.playbacks: list[Playback] = []
        self.generation = 0
        """Bumped by a retraction: text and audio of older generations are void."""
        self.started = False
        self.apologized = False
        """Whether a sentence failed to synthesize and the fallback line took its place."""
        self.interjected: set[str] = set()
        self.onset_pending = True
        """Whether no audio of this answer is queued yet: the first is queued without the
        synthesizer's leading silence (Piper opens each sentence with ~40 ms of it), so the
        caller hears the answer that much sooner."""
        self.joining = False
        """Whether the last chunk played ends mid-phrase: the next one is queued without its
        leading silence, as the last was without its trailing silence."""

    def switch(self, spoken: SpokenVoice) -> None:
        """Speak the text received so far in the old voice (its unfinished sentence is
        released now), the rest in ``spoken``."""
        if spoken is self.spoken:
            return
        for sentence in self.chunker.flush():
            self._queue(sentence)
        self.spoken = spoken

    def interject(self, line: str) -> None:
        """Say ``line`` next (ahead of answer text not yet received), once per answer, outside
        the answer: it is not part of what the turn delivered nor of the turn's latency."""
        if line not in self.interjected:
            self.interjected.add(line)
            self.sentences.put_nowait((self.generation, line, self.spoken, True))

    async def chunk(self, deltas: AsyncIterator[str | Retraction]) -> None:
        chunker = self.chunker
        timeline = self.timeline
        try:
            async for delta in deltas:
                if isinstance(delta, Retraction):
                    chunker.reset()
                    self.generation += 1
                    _drain(self.sentences)
                    # only this answer's audio: a hold (preemptive answer) or a pause (the
                    # caller talking over it) stays, so what it says next waits the same way
                    self.voice.speaker.drop()
                    self.onset_pending = True
                    self.joining = False
                    timeline.first_token_at = timeline.first_sentence_at = None
                    continue
                if timeline.first_token_at is None and delta.strip():
                    timeline.first_token_at = self.voice.clock()
                for sentence in chunker.push(delta):
                    self._queue(sentence)
            for sentence in chunker.flush():
                self._queue(sentence)
        finally:
            self.sentences.put_nowait(None)

    def _queue(self, sentence: str) -> None:
        if self.timeline.first_sentence_at is None:
            self.timeline.first_sentence_at = self.voice.clock()
        self.sentences.put_nowait((self.generation, sentence, self.spoken, False))

    async def synthesize(self) -> None:
        """Synthesize queued sentences in order. A sentence that fails is reported (an ``error``
        event) and the fallback line is said in its place, once per answer."""
        voice = self.voice
        while (item := await self.sentences.get()) is not None:
            generation, sentence, spoken, interim = item
            if generation != self.generation:
                continue
            try:
                await self._play(generation, sentence, spoken, interim=interim)
            except Exception as exc:
                log.exception("speech synthesis failed")
                voice.emit("error", source="tts", message=f"{type(exc).__name__}: {exc}")
                await self._apologize(generation, sentence)

    async def _play(
        self, generation: int, sentence: str, spoken: SpokenVoice, *, interim: bool = False
    ) -> None:
        voice = self.voice
        rate = spoken.tts.sample_rate
        pieces: list[Playback] = []
        trim_onset = self.onset_pending or (self.joining and not interim)
        joins = joins_next(sentence) and not interim
        held = bytearray()  # a joining chunk's audio since its last sound
        # urgent: nothing of the answer left to play, the caller hears silence until it comes
        urgent = self.onset_pending or not voice.speaker.busy
        slack_s = voice.speaker.queued_ms / 1000
        started = functools.partial(self._started, sentence, spoken.id, interim=interim)

        def push(pcm: bytes) -> None:
            piece = voice.speaker.push(pcm, rate)
            if not pieces:  # tts_start as the first piece plays, not once all are made
                piece.add_start_callback(started)
            pieces.append(piece)

        async for pcm in spoken.tts.synthesize(sentence, urgent=urgent, slack_s=slack_s):
            if generation != self.generation:
                held.clear()
                break
            if self.timeline.first_audio_at is None and not interim:
                self.timeline.first_audio_at = voice.clock()
            if trim_onset:
                trim_onset = self.onset_pending = False
                pcm = trim_leading_silence(pcm, rate)
            if not joins:
                push(pcm)
                continue
            held += pcm  # until its end, only what may be the chunk's trailing silence
            sounding = sounding_length(bytes(held), rate)
            if sounding:
                push(bytes(held[:sounding]))
                del held[:sounding]
        if held:  # after sound, the join keeps the silence's fading edge; without, all of it
            keep = round(rate * KEEP_AFTER_SOUND_MS / 1000) * 2 if pieces else len(held)
            push(bytes(held[:keep]))
        if not interim:
            self.joining = joins
        if not pieces:
            return
        self.playbacks.extend(pieces)
        if not interim:
            pieces[-1].add_done_callback(functools.partial(self._finished, sentence))

    async def _apologize(self, generation: int, failed: str) -> None:
        line = self.voice.orchestrator.fallback_answer
        if self.apologized or failed == line:
            return
        self.apologized = True
        try:
            await self._play(generation, line, SpokenVoice(self.voice.synthesizer, None))
        except Exception:  # the same fault, already reported
            log.exception("the fallback line could not be synthesized either")
            self.voice.emit("voice_lost", message="speech synthesis failed, even the fallback")

    def _finished(self, sentence: str, result: PlaybackResult) -> None:
        if result.completed:
            self.voice._sentence_finished(sentence, self.turn)

    def _started(
        self, sentence: str, voice_id: str | None, at: float | None, *, interim: bool = False
    ) -> None:
        if at is None:
            return  # cleared before it played
        voice = self.voice
        if not self.started:
            self.started = True
            voice.emit("tts_start", voice=voice_id)
        if not interim and self.turn is not None and self.timeline.first_frame_at is None:
            self.timeline.first_frame_at = at
            voice._emit_metrics(self.timeline)
        voice.emit("agent_sentence", text=sentence, voice=voice_id)


async def _once(text: str) -> AsyncIterator[str | Retraction]:
    yield text


def _drain(queue: asyncio.Queue[Any]) -> None:
    while not queue.empty():
        queue.get_nowait()
