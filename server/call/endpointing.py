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
sentence, 760 ms after a trailing "and"; before the second score of a finished sentence the
voice doubted, which often lifts the doubt), past the comma pauses of ordinary speech, and
never on a single word ("Hello?", "Wait."), which opens a turn more often than it ends one. A
question hands the turn over: after one the lead is ``question_lead_ms`` (an answer at 160 ms
of silence), until the call's caller goes on after a preemptive answer (they add to their
questions), from then on the ordinary lead. A decode that comes back later than that starts
the answer when it arrives.

The pause itself adapts to load, not to speed: ``quick_pause_ms`` (60 ms) while no other call's
decode keeps Whisper busy, the configured ``pause_ms`` (160 ms) while one does, since each
speculative decode at a pause the caller talks through is then a wait for someone; with
``skip_backlog`` decodes waiting, the speculative decode waits until fewer do (if the caller is
still silent then), instead of queueing.

Words and voice together (``words_end`` and an audio end-of-turn model's score,
:mod:`media.turn_model`, taken at ``model_silence_ms`` of each pause): the turn ends after the
short silence only when both say the caller is done. While the voice says they are not, or the
words stop on "for", "whether", "um", or in the middle of a digit group or a spelled name, the
agent holds the turn up to ``hold_ms``, then answers (:func:`end_of_turn` has the table); a
name spelled out to its last letter ends it after the short silence, on the words alone. A short
opener ("Right.", "Fine, thanks.") waits ``opener_silence_ms``: callers go on after one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from media import SpeechEnded, SpeechPaused, Transcript

__all__ = [
    "EndReason",
    "EndpointSettings",
    "Speculation",
    "TurnEnd",
    "WordsEnd",
    "edit_distance",
    "end_of_turn",
    "is_backchannel",
    "is_listener_noise",
    "sounds_complete",
    "words_end",
]

_T = TypeVar("_T")

WordsEnd = Literal[
    "closing", "complete", "spelled", "opener", "listing", "continues", "unsure", "none"
]
"""How a transcript ends (:func:`words_end`)."""
EndReason = Literal["words", "words+audio", "audio", "hold", "silence", "forced"]
"""Why a turn ended: the words alone (no audio score), words and voice agreeing, the voice
overruling the words (a longer wait), the hold limit, plain silence (no words), or the
utterance's length limit."""

_CONTINUATION_WORDS = """
and or but because if when while then that which whose the a an to of with at by as than whether
although though unless until so like into onto about
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


_OPENER_WORDS = """
right well so fine thanks thank you okay ok alright all i mean see oh ah um uh er hmm hi hello hey
good morning afternoon evening sure great cool look listen actually anyway and then
"""
_OPENERS = frozenset(_OPENER_WORDS.split())
_COURTESIES = frozenset({"please", "thanks"})
_NUMBER_WORD_LIST = "zero oh one two three four five six seven eight nine ten double triple"
_NUMBER_WORDS = frozenset(_NUMBER_WORD_LIST.split())
_SPELLED = re.compile(r"^[a-z]$")


def words_end(text: str) -> WordsEnd:
    """How ``text`` ends, for the end of the turn:

    - ``closing``: a question ("Where is my order?"), or a sentence that closes with a courtesy
      ("..., please.", "Thank you."): callers seldom go on after one;
    - ``complete``: :func:`sounds_complete`, and none of the below;
    - ``spelled``: letters spelled out that spell a word said before them ("The name is
      Rossi, R, O, S, S, I."; one letter may differ, since Whisper writes a name its own way:
      "Rossy R-O-S-S-I."): the spelling is done, however unfinished the voice sounds letter by
      letter;
    - ``opener``: up to three words that open turns more often than they end them ("Right.",
      "Fine, thanks.", "Well, I mean."); a question ("Hello?") is complete;
    - ``listing``: a digit group ("555-0134.", "4 7,"), number words read one by one ("five
      five"), or letters spelled out ("R, O, S."): the caller may be reading out more;
    - ``continues``: a last word that leads into more ("for", "whether", "um"), or "...";
    - ``unsure``: no end punctuation, nothing else to go by;
    - ``none``: no words.
    """
    stripped = text.strip()
    words = _WORD.findall(stripped.lower().replace("-", " "))
    if not words:
        return "none"
    if stripped.endswith("...") or words[-1] in _CONTINUATIONS:
        return "continues"
    if stripped.endswith("?"):
        return "closing"
    if _spells_a_word_said(words):
        return "spelled"
    if _is_listing(words):
        return "listing"
    if len(words) <= 3 and all(word in _OPENERS for word in words):
        return "opener"
    if not sounds_complete(stripped):
        return "unsure"
    return "closing" if _closes_with_courtesy(words) else "complete"


def _closes_with_courtesy(words: list[str]) -> bool:
    return words[-1] in _COURTESIES or words[-2:] == ["thank", "you"]


def _spells_a_word_said(words: list[str]) -> bool:
    """Whether the transcript ends with three or more single letters that spell a word said
    before them: as long as it, or one letter longer (Whisper drops a doubled letter: "rosy
    r-o-s-s-i"), and no more edits away than none in three letters, one in four, two in five or
    more (Whisper's own spelling of the name: "Rossy R-O-S-S-I"). So "R O S" of "Rossi" does
    not, nor "R O S S" of it."""
    count = 0
    while count < len(words) and _SPELLED.match(words[-1 - count]):
        count += 1
    if count < 3 or count == len(words):
        return False
    spelled = "".join(words[-count:])
    edits = min(count - 3, 2)
    return any(
        len(word) <= count <= len(word) + 1 and edit_distance(word, spelled) <= edits
        for word in words[:-count]
    )


def edit_distance(a: Sequence[object], b: Sequence[object]) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions of items (a
    string's characters, a list's words) that make ``a`` into ``b``."""
    row = list(range(len(b) + 1))
    for i, item in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (item != other))
    return row[-1]


def _is_listing(words: list[str]) -> bool:
    last = words[-1]
    digits = sum(char.isdigit() for char in last)
    if digits >= 3 or (digits and len(words) >= 2 and any(c.isdigit() for c in words[-2])):
        return True
    tail = words[-2:]
    if len(tail) == 2 and all(word in _NUMBER_WORDS for word in tail):
        return True
    return len(tail) == 2 and all(_SPELLED.match(word) for word in tail)


@dataclass(frozen=True)
class TurnEnd:
    """The silence after which the turn ends, and why (:func:`end_of_turn`)."""

    silence_ms: int
    reason: EndReason


def end_of_turn(
    words: WordsEnd | None,
    score: float | None,
    *,
    scoring: bool,
    base_ms: int,
    settings: EndpointSettings,
) -> TurnEnd:
    """The silence that ends a turn whose words end as ``words`` (None: still decoding) and
    whose voice scored ``score`` (the audio model's probability that the caller is done; None:
    no score, and ``scoring`` if one is on its way):

    ===========  ==========================  ======================  ====================
    words        voice done / no model       voice not done          score on its way
    ===========  ==========================  ======================  ====================
    closing      ``complete_silence_ms``     ``closing_...``         waits for it
    complete     ``complete_silence_ms``     ``disputed_...``        waits for it
    spelled      ``complete_silence_ms``     ``complete_silence_ms`` (the words decide)
    opener       ``opener_silence_ms``       ``opener_silence_ms``   (the voice can't tell)
    listing      ``listing_silence_ms``      ``hold_ms``             waits for it
    continues    ``hold_ms``                 ``hold_ms``             (the words decide)
    unsure       ``incomplete_...``          ``hold_ms``             waits for it
    none         ``base_ms``                 ``base_ms``
    ===========  ==========================  ======================  ====================

    While the words are being decoded the turn waits for them (``incomplete_silence_ms`` at
    most: the answer needs them anyway)."""
    if words is None:
        return TurnEnd(settings.incomplete_silence_ms, "words")
    if words == "none":
        return TurnEnd(base_ms, "silence")
    at_least = settings.complete_silence_ms  # no wait is shorter than a finished turn's
    if words == "opener":
        return TurnEnd(max(at_least, settings.opener_silence_ms), "words")
    if words == "spelled":
        return TurnEnd(at_least, "words")
    hold = settings.hold_ms
    if words == "continues":
        return TurnEnd(hold, "hold")
    if score is None and scoring:  # the voice's verdict is due within tens of ms
        return TurnEnd(hold, "words+audio")
    done = score is None or score >= settings.turn_threshold
    reason: EndReason = "words" if score is None else "words+audio"
    if words in ("complete", "closing"):
        if done:
            return TurnEnd(settings.complete_silence_ms, reason)
        doubted = settings.disputed_silence_ms
        if words == "closing":
            doubted = settings.closing_silence_ms
        return TurnEnd(max(at_least, doubted), "audio")
    if words == "listing":
        listing = max(at_least, settings.listing_silence_ms)
        return TurnEnd(listing, reason) if done else TurnEnd(hold, "hold")
    if done:
        return TurnEnd(max(base_ms, settings.incomplete_silence_ms), reason)
    return TurnEnd(hold, "hold")


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

    hold_ms: int = 2500
    """The longest the agent waits for a caller whose words or voice say they will go on
    ("a table for ...", "555 0134, ..."): then it answers."""
    opener_silence_ms: int = 700
    """End-of-turn silence after a short opener ("Right.", "Fine, thanks."): longer than a
    comma pause (Piper's is ~420 ms), which callers make after one before the question."""
    disputed_silence_ms: int = 1500
    """End-of-turn silence after a finished sentence in a voice that goes on ("I want to move
    my booking to[night]." of a "to ... next Friday", a 1.2 s pause). The model also doubts
    some long finished sentences (0.01-0.3 on two of the harness's eleven questions), which
    then wait this long: at 1 s, the hesitation corpus had 5 cut-ins in 22 lines, not 2."""
    listing_silence_ms: int = 1500
    """End-of-turn silence after a digit group or spelled letters in a voice that sounds
    finished (the voice may be wrong): longer than the pauses callers make between groups
    (0.5-1.2 s, plus the gaps around them)."""
    turn_threshold: float = 0.5
    """The audio model's score (probability the caller is done) at or above which the voice
    says the turn is over."""
    model_silence_ms: int = 200
    """The silence at which a pause is scored by the audio model (it was trained with about
    this much at the end; with 60 ms, finished questions score ~0.2)."""
    model_recheck_ms: int = 500
    """The silence at which a pause the model doubted after a finished sentence is scored once
    more (unfinished-looking words keep the first doubt): its scores rise with
    the silence after a finished turn (a long question: 0.31 at 200 ms, 0.91 at 500) and stay
    low after an unfinished one ("I'm calling ...": 0.01; "I want to move my booking ...":
    0.42). The later score decides. 0: score each pause once."""
    closing_silence_ms: int = 1000
    """End-of-turn silence after words that close a turn (a question, "..., please.", "thank
    you.") in a voice the model doubts at the recheck too: shorter than a finished sentence's
    wait (:attr:`disputed_silence_ms`), since callers seldom go on after them."""

    def __post_init__(self) -> None:
        for name in (
            "opener_silence_ms",
            "disputed_silence_ms",
            "listing_silence_ms",
            "closing_silence_ms",
        ):
            if not 0 < getattr(self, name) <= self.hold_ms:
                raise ValueError(f"need 0 < {name} <= hold_ms")
        if self.hold_ms < self.incomplete_silence_ms:
            raise ValueError("need hold_ms >= incomplete_silence_ms")
        if not 0.0 < self.turn_threshold < 1.0:
            raise ValueError("turn_threshold must be between 0 and 1")
        if not 0 < self.model_silence_ms < self.complete_silence_ms:
            raise ValueError("need 0 < model_silence_ms < complete_silence_ms")
        if self.model_recheck_ms and not self.model_silence_ms < self.model_recheck_ms:
            raise ValueError("need model_recheck_ms 0 or above model_silence_ms")
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
    """The transcription of an utterance up to a pause, running or done, and the audio model's
    score of the same pause (``scoring``, started at ``model_silence_ms`` when there is a
    model)."""

    def __init__(self, paused: SpeechPaused, task: asyncio.Task[Transcript]) -> None:
        self.paused = paused
        self.task = task
        self.scoring: asyncio.Task[float] | None = None
        self.rechecking: asyncio.Task[float] | None = None
        """The second score of a pause the first doubted (``model_recheck_ms``)."""

    @property
    def transcript(self) -> Transcript | None:
        """The result, once the decode finished without error."""
        return _result(self.task)

    @property
    def words(self) -> WordsEnd | None:
        """How the transcript ends (:func:`words_end`): None while the decode runs, ``none`` if
        it failed."""
        if not self.task.done():
            return None
        transcript = self.transcript
        return words_end(transcript.text) if transcript is not None else "none"

    @property
    def score(self) -> float | None:
        """The audio model's latest score, once it finished without error: the recheck's,
        else the first."""
        for task in (self.rechecking, self.scoring):
            score = None if task is None else _result(task)
            if score is not None:
                return score
        return None

    def recheck_due(self, silent_ms: float, settings: EndpointSettings) -> bool:
        """Whether the pause should be scored again now: the words read as a finished
        sentence, the first score doubted the turn was over, and ``model_recheck_ms`` of
        silence have passed (once per pause). Words that read unfinished keep the first
        doubt: a second look must not end "Friday at eight, for [two] ..." inside its pause."""
        return (
            self.rechecking is None
            and silent_ms >= settings.model_recheck_ms
            and self._doubted_sentence(settings)
        )

    def _doubted_sentence(self, settings: EndpointSettings) -> bool:
        """Whether the words read as a finished sentence that the first score doubted, and a
        second score is set (``model_recheck_ms``)."""
        first = None if self.scoring is None else _result(self.scoring)
        return (
            settings.model_recheck_ms > 0
            and first is not None
            and first < settings.turn_threshold
            and self.words in ("complete", "closing")
        )

    def covers(self, ended: SpeechEnded) -> bool:
        """Whether ``ended`` added nothing but silence to the audio this speculation heard."""
        return ended.last_voiced_at == self.paused.last_voiced_at and ended.audio.startswith(
            self.paused.audio
        )

    def turn_end(self, base_ms: int, settings: EndpointSettings) -> TurnEnd:
        """The silence that ends the turn, and why, given what is known of the words and the
        voice (:func:`end_of_turn`). While the decode runs, the turn waits for it: ending
        earlier would not start the answer sooner, since the answer needs the words, and would
        cut off a caller who trails off."""
        scoring = self.scoring is not None and not self.scoring.done()
        return end_of_turn(
            self.words, self.score, scoring=scoring, base_ms=base_ms, settings=settings
        )

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
        return silent_ms >= self._expected_end_ms(base_ms, settings) - lead

    def _expected_end_ms(self, base_ms: int, settings: EndpointSettings) -> int:
        """The silence the turn is bet to end at: as things stand (:meth:`turn_end`), or, while
        a finished sentence the voice doubted awaits its second score, that score's silence.
        The doubt is often lifted there ("Hi, I ordered a blue kettle last week and I would
        like to know when it will arrive.": 0.31 at 200 ms, 0.91 at 500), and an answer started
        only then is an LLM's first token later."""
        end = self.turn_end(base_ms, settings).silence_ms
        rechecked = self.rechecking is not None and self.rechecking.done()
        if not rechecked and self._doubted_sentence(settings):
            return min(end, settings.model_recheck_ms)
        return end

    def discard(self) -> None:
        """Abandon the results (the decode and the scoring finish in their threads)."""
        for task in (self.task, self.scoring, self.rechecking):
            if task is None:
                continue
            task.cancel()
            if task.done():
                with contextlib.suppress(BaseException):
                    task.exception()


def _result(task: asyncio.Task[_T]) -> _T | None:
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()
