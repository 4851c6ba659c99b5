"""When the caller's turn is over: speculative transcription at a pause, and an end-of-turn
silence that depends on what was said (text and timing only, no model).

At ``pause_ms`` of silence the session transcribes the utterance so far. If the caller stays
silent, that transcript is the turn's (no second decode), and the turn ends as soon as the silence
reaches the length the words call for: short after a complete-sounding sentence, longer after a
trailing "and", "um" or an unfinished clause, the configured ``end_silence_ms`` while the
transcript is not ready yet. If the caller speaks again, the speculation is discarded (counted as
wasted).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

from media import SpeechEnded, SpeechPaused, Transcript

__all__ = ["EndpointSettings", "Speculation", "is_backchannel", "sounds_complete"]

_CONTINUATION_WORDS = """
and or but so because if when while then that which who whose where the a an to of for with
from in on at by as than my your our their his her its is are was were be been am will would
can could should shall may might must do does did have has had not also like about into
um uh er erm hmm ah eh mm
"""
_CONTINUATIONS = frozenset(_CONTINUATION_WORDS.split())
_WORD = re.compile(r"[a-z']+")
_BACKCHANNELS = frozenset(
    {
        "mhm", "mm", "mmm", "hmm", "mm hmm", "uh huh", "uh", "um", "ah", "oh", "yeah", "yes",
        "yep", "yup", "ok", "okay", "right", "sure", "alright", "all right", "i see", "got it",
        "cool", "great", "nice", "good", "wow", "really", "oh okay", "yeah yeah", "uh-huh",
    }
)  # fmt: skip


def sounds_complete(text: str) -> bool:
    """Whether ``text`` reads like a finished turn: it ends in ``.``, ``?`` or ``!`` and its last
    word is not one that leads into more ("and", "the", "um", "to"...)."""
    stripped = text.strip()
    if not stripped or stripped[-1] not in ".?!" or stripped.endswith("..."):
        return False
    words = _WORD.findall(stripped.lower())
    return bool(words) and words[-1] not in _CONTINUATIONS


def is_backchannel(text: str) -> bool:
    """Whether ``text`` is listener feedback ("mhm", "yeah", "okay", "I see") rather than a turn:
    the caller wants the agent to go on."""
    normalised = " ".join(_WORD.findall(text.lower().replace("-", " ")))
    return normalised in _BACKCHANNELS


@dataclass(frozen=True)
class EndpointSettings:
    speculate: bool = True
    """Transcribe at each pause instead of after the end of the turn."""
    complete_silence_ms: int = 350
    """End-of-turn silence after a complete-sounding transcript. Shorter cuts callers off at
    commas: Whisper writes "Hello." for a "Hello," followed by a 300 ms pause."""
    incomplete_silence_ms: int = 900
    """End-of-turn silence after a transcript that trails off ("and", "um", no punctuation)."""

    def __post_init__(self) -> None:
        if not 0 < self.complete_silence_ms <= self.incomplete_silence_ms:
            raise ValueError("need 0 < complete_silence_ms <= incomplete_silence_ms")


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
        """The silence that ends the turn, given what (if anything) is known of the words."""
        transcript = self.transcript
        if transcript is None or not transcript.text:
            return base_ms
        if sounds_complete(transcript.text):
            return settings.complete_silence_ms
        return max(base_ms, settings.incomplete_silence_ms)

    def discard(self) -> None:
        """Abandon the result (the decode itself finishes in its thread)."""
        self.task.cancel()
        if self.task.done():
            with contextlib.suppress(BaseException):
                self.task.exception()
