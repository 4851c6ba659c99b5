"""When the caller's turn is over: speculative transcription at a pause, and an end-of-turn
silence that depends on what was said (text and timing only, no model).

At ``pause_ms`` of silence the session transcribes the utterance so far. If the caller stays
silent, that transcript is the turn's (no second decode), and the turn ends as soon as the silence
reaches the length the words call for: short after a complete-sounding sentence, longer after a
trailing "and", "um" or an unfinished clause, the configured ``end_silence_ms`` while the
transcript failed or heard nothing. While the decode runs the turn does not end (up to the longest
silence): the answer needs the words anyway. If the caller speaks again, the speculation is
discarded (counted as wasted).

A preemptive answer (the LLM started while the end of the turn is still awaited) is a bet that
the caller is done, and a lost bet costs an LLM request. It is placed by the silence and the
words, never by how fast the decode came back, so a call behaves the same on a slow and a fast
CPU: only ``preempt_lead_ms`` before the turn would end (260 ms of silence after a complete
sentence, 760 ms after a trailing "and"), past the comma pauses of ordinary speech, and never on
a single word ("Hello?", "Wait."), which opens a turn more often than it ends one. A question
hands the turn over: after one the lead is ``question_lead_ms`` (an answer at 160 ms of
silence), until the call's caller goes on after a preemptive answer (they add to their
questions), from then on the ordinary lead. A decode that comes back later than that starts
the answer when it arrives.

The pause itself adapts to load, not to speed: ``quick_pause_ms`` (60 ms) while no other call's
decode keeps Whisper busy, the configured ``pause_ms`` (160 ms) while one does, since each
speculative decode at a pause the caller talks through is then a wait for someone; with
``skip_backlog`` decodes waiting, the speculative decode waits until fewer do (if the caller is
still silent then), instead of queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

from media import SpeechEnded, SpeechPaused, Transcript

__all__ = [
    "EndpointSettings",
    "Speculation",
    "is_backchannel",
    "is_listener_noise",
    "sounds_complete",
]

_CONTINUATION_WORDS = """
and or but because if when while then that which whose the a an to of with at by as than
my your our their his her its in on for from into about like um uh er erm hmm ah eh mm
"""
_CONTINUATIONS = frozenset(_CONTINUATION_WORDS.split())
_WORD = re.compile(r"[a-z0-9']+")
_STOP_WORDS = frozenset(
    {"stop", "wait", "hold", "hang", "no", "sorry", "excuse", "pardon", "what", "hey", "hello"}
)
_BACKCHANNELS = frozenset(
    {
        "mhm", "mm", "mmm", "hmm", "mm hmm", "uh huh", "uh", "um", "ah", "oh", "yeah", "yes",
        "yep", "yup", "ok", "okay", "right", "sure", "alright", "all right", "i see", "got it",
        "cool", "great", "nice", "good", "wow", "really", "oh okay", "yeah yeah", "uh-huh",
    }
)  # fmt: skip


def sounds_complete(text: str) -> bool:
    """Whether ``text`` reads like a finished turn: a question, or a sentence ending in ``.`` or
    ``!`` whose last word does not lead into more ("and", "the", "um", "to"...)."""
    stripped = text.strip()
    if not stripped or stripped[-1] not in ".?!" or stripped.endswith("..."):
        return False
    words = _WORD.findall(stripped.lower())
    if not words:
        return False
    return stripped.endswith("?") or words[-1] not in _CONTINUATIONS


def is_backchannel(text: str) -> bool:
    """Whether ``text`` is listener feedback ("mhm", "yeah", "okay", "I see") rather than a turn:
    the caller wants the agent to go on."""
    words = _WORD.findall(text.lower().replace("-", " "))
    if not words:
        return False
    return " ".join(words) in _BACKCHANNELS or all(word in _BACKCHANNELS for word in words)


def is_listener_noise(transcript: Transcript, spoken_ms: float) -> bool:
    """Whether a sound the caller made over the agent is feedback or noise, not a turn: nothing
    transcribed, a backchannel, a hum Whisper spells as letters ("M. H. N."), or a short sound it
    is unsure of (tiny.en hears "mhm" as "and make a chance" at a log-probability near -1). A word
    that asks the agent to stop ("stop", "wait", "sorry"...) is never noise."""
    text = transcript.text
    if not text or is_backchannel(text):
        return True
    words = _WORD.findall(text.lower())
    if _STOP_WORDS.intersection(words):
        return False
    if words and all(len(word) == 1 for word in words):
        return True
    confidence = transcript.avg_logprob if transcript.avg_logprob is not None else 0.0
    return spoken_ms < 800 and confidence < -0.7


@dataclass(frozen=True)
class EndpointSettings:
    speculate: bool = True
    """Transcribe at each pause instead of after the end of the turn."""
    complete_silence_ms: int = 400
    """End-of-turn silence after a complete-sounding transcript. Shorter cuts callers off at
    commas: Whisper writes "Stop." for a "Stop," whose pause, with the unvoiced onset of the next
    word ("that"), reaches 350 ms."""
    incomplete_silence_ms: int = 900
    """End-of-turn silence after a transcript that trails off ("and", "um", no punctuation)."""
    preempt: bool = True
    """While the turn waits out that silence, start answering the speculative transcript with
    the audio held (and tools with side effects waiting) until the turn is confirmed."""
    preempt_lead_ms: int = 140
    """How long before the end of the turn a preemptive answer may start: the LLM's head start.
    Longer starts answers sooner and wastes more LLM requests on callers who go on (a lead of
    160 ms preempts at the 240 ms comma pause of "Friday evening, please.")."""
    question_lead_ms: int = 240
    """The lead after a question, while the call has thrown no preemptive answer away (then
    ``preempt_lead_ms``): a question hands the turn over (the caller waits for the answer) far
    more often than a statement, which callers follow with more ("I ordered a kettle. When does
    it come?"); 160 ms of silence after "Where is my order?" instead of 260, about when a short
    question's words are known after the quick pause. A caller who goes on after a question
    ("... It was due on Monday.") costs that call one LLM request, once. Never less than
    ``preempt_lead_ms``."""
    preempt_min_words: int = 2
    """Fewer words than this are answered only once the turn has ended."""
    skip_backlog: int = 1
    """Skip a speculative decode when this many decodes already wait for a Whisper worker: it
    would queue behind them (and push later callers' real decodes back) for words the end of
    the turn may transcribe anyway. It starts when fewer wait, if the caller is still silent.
    0: never skip."""
    quick_pause_ms: int = 60
    """The speculation pause (``VadSettings.pause_ms``) while a Whisper worker is idle of
    other calls' decodes (the call's own speculative ones, which a new pause supersedes, do
    not count): the words are known sooner when a decode costs nobody a wait (a question's
    at ~150 ms of silence with a ~90 ms decode, by its 160 ms preemption point). A shorter
    pause falls inside more utterances (pauses per test utterance, its last one included:
    1.9 at 60 ms, 1.6 at 80), and a decode at a pause the caller talks through is thrown
    away: with 16 calls on two cores, 76-88 a run against 104-113 when the quick pause held
    while no decode waited. 0: always the configured pause."""

    def __post_init__(self) -> None:
        if not 0 < self.complete_silence_ms <= self.incomplete_silence_ms:
            raise ValueError("need 0 < complete_silence_ms <= incomplete_silence_ms")
        if not 0 <= self.preempt_lead_ms < self.complete_silence_ms:
            raise ValueError("need 0 <= preempt_lead_ms < complete_silence_ms")
        if not 0 <= self.question_lead_ms < self.complete_silence_ms:
            raise ValueError("need 0 <= question_lead_ms < complete_silence_ms")
        if self.quick_pause_ms < 0 or self.skip_backlog < 0:
            raise ValueError("quick_pause_ms and skip_backlog must not be negative")
        if self.preempt_min_words < 1:
            raise ValueError("preempt_min_words must be at least 1")


class Speculation:
    """The transcription of an utterance up to a pause, running or done."""

    def __init__(self, paused: SpeechPaused, task: asyncio.Task[Transcript]) -> None:
        self.paused = paused
        self.task = task

    @property
    def transcript(self) -> Transcript | None:
        """The result, once the decode finished without error."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return None
        return self.task.result()

    def covers(self, ended: SpeechEnded) -> bool:
        """Whether ``ended`` added nothing but silence to the audio this speculation heard."""
        return ended.last_voiced_at == self.paused.last_voiced_at and ended.audio.startswith(
            self.paused.audio
        )

    def required_silence_ms(self, base_ms: int, settings: EndpointSettings) -> int:
        """The silence that ends the turn, given what is known of the words. While the decode
        runs, the turn waits for it (up to the longest silence): ending earlier would not start
        the answer sooner, since the answer needs the words, and would cut off a caller who
        trails off."""
        if not self.task.done():
            return settings.incomplete_silence_ms
        transcript = self.transcript
        if transcript is None or not transcript.text:
            return base_ms
        if sounds_complete(transcript.text):
            return settings.complete_silence_ms
        return max(base_ms, settings.incomplete_silence_ms)

    def preempt_due(
        self,
        silent_ms: float,
        base_ms: int,
        settings: EndpointSettings,
        *,
        questions_early: bool = True,
    ) -> bool:
        """Whether a preemptive answer to this transcript may start after ``silent_ms`` of
        silence: the words are known, there are enough of them, and the turn would end within
        the lead (``question_lead_ms`` after a question while ``questions_early``, else
        ``preempt_lead_ms``)."""
        transcript = self.transcript
        if transcript is None or len(_WORD.findall(transcript.text.lower())) < (
            settings.preempt_min_words
        ):
            return False
        lead = settings.preempt_lead_ms
        if questions_early and settings.preempt_lead_ms and transcript.text.rstrip().endswith("?"):
            lead = max(lead, settings.question_lead_ms)
        return silent_ms >= self.required_silence_ms(base_ms, settings) - lead

    def discard(self) -> None:
        """Abandon the result (the decode itself finishes in its thread)."""
        self.task.cancel()
        if self.task.done():
            with contextlib.suppress(BaseException):
                self.task.exception()
