"""Sentence chunking of a streamed LLM answer into speakable pieces for TTS.

A chunk closes at ``.``, ``!`` or ``?`` (with any closing quotes or brackets) followed by
whitespace, or at a newline; never inside abbreviations (Mr., e.g., etc.), initials, decimals
(3.14), times (7:30), URLs or e-mail addresses. Markdown and symbols a voice cannot say are
stripped. The first chunk of an answer is released early at a clause boundary (a comma,
semicolon, colon or dash) once it holds a few words, so the first audio starts before a long first
sentence is complete; shorter openings ("Yes, sure,") wait for more, since Piper phrases a lone
word poorly, and the rest of the answer goes by sentences.

Sooner still, with ``first_phrase_min_words``, the first chunk may end mid-clause, before a word
that opens a phrase ("on", "and", "our"...) once it holds that many words and does not end on a
word that leans on the next ("is", "to", "the"...): "It should arrive" is said while "on Friday
morning." still streams. Such a chunk ends in no punctuation, which is how
:func:`joins_next` tells the synthesis to close the gap after it. An opener that ends a delta
counts as a whole word: an LLM streams tokens, and an opener's token is the word (" our", not
" our" + "selves"), so the phrase leaves one token sooner. Only that decision depends on where
the deltas end; a delta cut inside a word ("an" + "other") at worst ends the phrase before a
word that opens none, never inside a word.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["SentenceChunker", "joins_next", "speakable"]

_ABBREVIATIONS_TEXT = """mr mrs ms mx dr prof sr jr st mt ft vs etc e.g i.e cf approx no nos vol
fig inc ltd co corp dept est jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri
sat sun a.m p.m u.s u.k ph.d b.sc m.sc min max avg tel ext"""
ABBREVIATIONS = frozenset(_ABBREVIATIONS_TEXT.split())
_TERMINATORS = ".!?…"
_CLOSERS = "\"')]}”’»*_"
_CLAUSE = re.compile(r"[,;:](?=\s)|\s[–—-]\s")
_PHRASE_OPENERS_TEXT = """on in at to for from with by about into after before until and but or so
because which who when where the a an our your my their his her its this these those"""
PHRASE_OPENERS = frozenset(_PHRASE_OPENERS_TEXT.split())
"""Words a spoken phrase starts with, before which a first chunk may end mid-clause."""
_LEANING_TEXT = """is are was were be been being am has have had do does did will would shall should
can could may might must not no to of as than so very too just also over under through across
around between against without within along behind beyond near off onto upon via per like"""
_LEANING = PHRASE_OPENERS | frozenset(_LEANING_TEXT.split())
"""Words that lean on the next one ("is", "will", "to", "the", "over"): a chunk never ends on
one, as in "Your order is" or "jumps over"."""
_NEXT_WORD = re.compile(r"\s+([A-Za-z']+)(?=[\s,;:.!?])")
_LAST_WORD = re.compile(r"\s+([A-Za-z']+)$")
_ENDS_SPOKEN_BREAK = ".!?…,;:"


def joins_next(chunk: str) -> bool:
    """Whether ``chunk`` ends mid-phrase (no punctuation): what follows continues it, so the
    silence a synthesizer puts after it is no pause of the text."""
    return bool(chunk) and chunk.rstrip(_CLOSERS)[-1:] not in _ENDS_SPOKEN_BREAK


class SentenceChunker:
    """Text deltas in (:meth:`push`), speakable chunks out as soon as each closes.

    ``first_clause_min_chars``: the first chunk is released at the first clause boundary at or
    after this many characters (0 disables). ``first_phrase_min_words``: the first chunk may
    also end before a word of :data:`PHRASE_OPENERS` once it holds this many words (0, the
    default, disables). ``max_chars``: a chunk without any boundary is cut at a space beyond this
    length, so a run-on answer still streams.
    """

    def __init__(
        self,
        first_clause_min_chars: int = 24,
        max_chars: int = 300,
        first_phrase_min_words: int = 0,
    ) -> None:
        self.first_clause_min_chars = first_clause_min_chars
        self.first_phrase_min_words = first_phrase_min_words
        self.max_chars = max_chars
        self._buffer = ""
        self._scanned = 0
        self._released = 0

    def push(self, delta: str) -> list[str]:
        self._buffer += delta
        chunks: list[str] = []
        while (cut := self._next_cut()) is not None:
            piece, self._buffer = self._buffer[:cut], self._buffer[cut:]
            self._scanned = 0
            text = speakable(piece)
            if text:
                chunks.append(text)
                self._released += 1
        return chunks

    def flush(self) -> list[str]:
        """The remainder, at the end of the answer."""
        text = speakable(self._buffer)
        self.reset()
        return [text] if text else []

    def reset(self) -> None:
        """Forget buffered text (a retracted answer) and start a new answer."""
        self._buffer = ""
        self._scanned = 0
        self._released = 0

    def _next_cut(self) -> int | None:
        """Where the next chunk ends, or None to wait for more text.

        Each rule decides from the text up to its cut plus at most one character of lookahead.
        The cut that a growing buffer would reveal first wins (ties: sentence, then clause, then
        length), so the chunks do not depend on how the text was split into deltas.
        """
        buffer = self._buffer
        sentence = self._sentence_cut()
        # a run-on chunk is cut as soon as the buffer holds max_chars + 1 characters
        overflow_at = self.max_chars + 1 if len(buffer) > self.max_chars else None
        if self._released == 0 and (self.first_clause_min_chars or self.first_phrase_min_words):
            horizon = len(buffer)
            if sentence is not None:
                horizon = min(horizon, sentence[1] - 1)
            if overflow_at is not None:
                horizon = min(horizon, overflow_at)
            early = self._early_cut(horizon)
            if early is not None:
                return early
        if sentence is not None and (overflow_at is None or sentence[1] <= overflow_at):
            return sentence[0]
        if overflow_at is not None:
            return self._clause_cut(self.max_chars // 2, overflow_at) or _last_space(
                buffer, self.max_chars
            )
        return None

    def _sentence_cut(self) -> tuple[int, int] | None:
        """The first sentence end: (cut, length of the prefix that decides it), or None."""
        buffer = self._buffer
        i = self._scanned
        while i < len(buffer):
            char = buffer[i]
            if char == "\n":
                return i + 1, i + 1
            if char in _TERMINATORS:
                end = i + 1
                while end < len(buffer) and buffer[end] in _CLOSERS + _TERMINATORS:
                    end += 1
                if end >= len(buffer):
                    break  # need the next character to decide
                if buffer[end].isspace() and not _is_abbreviation(buffer, i):
                    return end, end + 1
            i += 1
        self._scanned = max(0, min(i, len(buffer) - 1))
        return None

    def _early_cut(self, horizon: int) -> int | None:
        """The first chunk's early end decided first within ``horizon`` characters: a clause
        boundary (decided where it ends) or a phrase opener (decided one character past it)."""
        clause = (
            self._clause_cut(self.first_clause_min_chars, horizon)
            if self.first_clause_min_chars
            else None
        )
        phrase = self._phrase_cut(self.first_phrase_min_words, horizon)
        if phrase is None or (clause is not None and clause <= phrase[1]):
            return clause
        return phrase[0]

    def _phrase_cut(self, min_words: int, endpos: int) -> tuple[int, int] | None:
        """(cut, decided at): the space before the first phrase opener that follows at least
        ``min_words`` words, the opener and the character after it within ``endpos``."""
        if not min_words:
            return None
        for match in _NEXT_WORD.finditer(self._buffer, 0, endpos):
            if match.end() >= endpos:
                return None  # the word may go on
            if self._opens_phrase(match, min_words):
                return match.start() + 1, match.end() + 1
        if endpos == len(self._buffer):  # a word at the end of the last delta
            last = _LAST_WORD.search(self._buffer, 0, endpos)
            if last is not None and self._opens_phrase(last, min_words):
                return last.start() + 1, endpos
        return None

    def _opens_phrase(self, word: re.Match[str], min_words: int) -> bool:
        before = self._buffer[: word.start()].split()
        return (
            word.group(1).lower() in PHRASE_OPENERS
            and len(before) >= min_words
            and before[-1].lower() not in _LEANING
        )

    def _clause_cut(self, min_chars: int, endpos: int) -> int | None:
        """The end of the first clause boundary at or after ``min_chars`` that is decided
        within the first ``endpos`` characters."""
        if endpos < min_chars:
            return None
        for match in _CLAUSE.finditer(self._buffer, min_chars - 1, endpos):
            return match.end()
        return None


def _is_abbreviation(buffer: str, dot: int) -> bool:
    if buffer[dot] != ".":
        return False
    start = dot
    while start > 0 and not buffer[start - 1].isspace() and buffer[start - 1] not in "(\"'":
        start -= 1
    word = buffer[start:dot].lower().lstrip("*_")
    if not word:
        return False
    if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
        return True
    # "1." starting a line (after any indent) is a list marker, not the end of a sentence
    line_start = buffer.rfind("\n", 0, start) + 1
    return word.isdigit() and not buffer[line_start:start].strip(" \t")


def _last_space(buffer: str, limit: int) -> int | None:
    cut = buffer.rfind(" ", 0, limit)
    return cut + 1 if cut > 0 else limit


_FENCE = re.compile(r"```[\w+-]*")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s*", re.MULTILINE)
_LIST_MARKER = re.compile(r"^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+", re.MULTILINE)
"""A list item's marker, with the spaces after it on its own line ("42." ending a line is a
number, not a marker)."""
_EMPHASIS = re.compile(r"(\*{1,3}|_{2,3}|~~|`)")
_LONE_UNDERSCORE = re.compile(r"(?<!\w)_|_(?!\w)")
_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+(?=[.,!?;:…]+(?:\s|$))")


def speakable(text: str) -> str:
    """``text`` without markdown syntax and symbols a voice cannot say; whitespace collapsed."""
    text = _FENCE.sub(" ", text)
    text = _LINK.sub(r"\1", text)
    text = _HEADING.sub("", text)
    text = _LIST_MARKER.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _LONE_UNDERSCORE.sub("", text)
    text = "".join(char for char in text if _sayable(char))
    text = _SPACES.sub(" ", text).strip()
    text = _SPACE_BEFORE_PUNCTUATION.sub("", text)  # "Great news 🎉!" -> "Great news!"
    return text if any(char.isalnum() for char in text) else ""


def _sayable(char: str) -> bool:
    category = unicodedata.category(char)
    if category.startswith("C"):  # control, format, surrogate, private use, unassigned
        return char in "\n\t"
    return not (category in ("So", "Sk") or char in "|<>{}[]\\^")
