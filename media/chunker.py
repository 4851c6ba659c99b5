"""Sentence chunking of a streamed LLM answer into speakable pieces for TTS.

A chunk closes at ``.``, ``!`` or ``?`` (with any closing quotes or brackets) followed by
whitespace, or at a newline; never inside abbreviations (Mr., e.g., etc.), initials, decimals
(3.14), times (7:30), URLs or e-mail addresses. Markdown and symbols a voice cannot say are
stripped. The first chunk of an answer is released early at a clause boundary (a comma,
semicolon, colon or dash) once it holds a few words, so the first audio starts before a long first
sentence is complete; shorter openings ("Yes, sure,") wait for more, since Piper phrases a lone
word poorly, and the rest of the answer goes by sentences.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["SentenceChunker", "speakable"]

_ABBREVIATIONS_TEXT = """mr mrs ms mx dr prof sr jr st mt ft vs etc e.g i.e cf approx no nos vol
fig inc ltd co corp dept est jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri
sat sun a.m p.m u.s u.k ph.d b.sc m.sc min max avg tel ext"""
ABBREVIATIONS = frozenset(_ABBREVIATIONS_TEXT.split())
_TERMINATORS = ".!?…"
_CLOSERS = "\"')]}”’»*_"
_CLAUSE = re.compile(r"[,;:](?=\s)|\s[–—-]\s")


class SentenceChunker:
    """Text deltas in (:meth:`push`), speakable chunks out as soon as each closes.

    ``first_clause_min_chars``: the first chunk is released at the first clause boundary at or
    after this many characters (0 disables). ``max_chars``: a chunk without any boundary is cut
    at a space beyond this length, so a run-on answer still streams.
    """

    def __init__(self, first_clause_min_chars: int = 24, max_chars: int = 300) -> None:
        self.first_clause_min_chars = first_clause_min_chars
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
        if self._released == 0 and self.first_clause_min_chars:
            horizon = len(buffer)
            if sentence is not None:
                horizon = min(horizon, sentence[1] - 1)
            if overflow_at is not None:
                horizon = min(horizon, overflow_at)
            early = self._clause_cut(self.first_clause_min_chars, horizon)
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
