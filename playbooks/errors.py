"""Playbook file errors: one line each, naming the file, the line where it is known, and the
field, e.g. ``support.yaml:14: stages[1].voice.speaking_rate: Input should be ...``.

:class:`LineMap` remembers which line of a YAML document (a ``.yaml`` file, a Markdown front
matter) each field path came from, so an error found later, by validation on the parsed data,
still points at the line.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml
from pydantic.alias_generators import to_snake

__all__ = ["LineMap", "PlaybookError", "shown"]

_LAST_POSITION = re.compile(r"\[\d+\]$")
_LAST_KEY = re.compile(r"\.[^.]*$")


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PlaybookError(ValueError):
    """An invalid playbook file; ``str()`` is a one-line message naming the file, the line (when
    known) and the field path (when there is one)."""

    def __init__(self, source: str, path: str, message: str, line: int | None = None) -> None:
        self.source = source
        self.path = path
        self.message = message
        self.line = line
        where = source if line is None else f"{source}:{line}"
        if path:
            where += f": {path}"
        super().__init__(_clipped(_one_line(f"{where}: {message}")))


@dataclass
class LineMap:
    """Where each field path of a playbook's data (``stages[1].tools[0]``) came from."""

    label: str
    """The file's name, as errors about it give it."""
    lines: dict[str, int] = field(default_factory=dict)
    limit: int = 100_000
    """Most paths recorded: aliases repeating each other would make :meth:`record` endless (the
    loader then refuses the document for its size)."""

    def add(self, path: str, line: int) -> None:
        self.lines.setdefault(_normal(path), line)

    def record(
        self, node: yaml.Node, offset: int = 1, path: str = "", source: str | None = None
    ) -> None:
        """Record the line of every key and list item under ``node``, a composed YAML document
        whose 0-based marks are ``offset`` less than the file's line numbers. With ``source``,
        the document's text, lines end at ``\\n`` only, as in an editor (YAML also ends them at
        U+0085, U+2028 and U+2029). An alias inside its own anchor (``&r [x, *r]``) is not
        followed: the loader refuses such a document."""
        if source is None:

            def line(mark: yaml.Mark) -> int:
                return mark.line + offset

        else:
            ends = [match.start() for match in re.finditer("\n", source)]

            def line(mark: yaml.Mark) -> int:
                return bisect.bisect_left(ends, mark.index) + offset

        self._record(node, line, path, set())

    def _record(
        self, node: yaml.Node, line: Callable[[yaml.Mark], int], path: str, inside: set[int]
    ) -> None:
        if len(self.lines) >= self.limit or id(node) in inside:
            return
        inside.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    child = f"{path}.{key.value}" if path else str(key.value)
                    self.add(child, line(key.start_mark))
                    self._record(value, line, child, inside)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}[{index}]"
                self.add(child, line(item.start_mark))
                self._record(item, line, child, inside)
        inside.discard(id(node))

    def line_of(self, path: str) -> int | None:
        """The line of ``path`` or of its nearest enclosing field; None if none is known."""
        parts = _normal(path)
        while parts:
            if parts in self.lines:
                return self.lines[parts]
            enclosing = _enclosing(parts)
            if enclosing == parts:  # a top-level key such as ``a[b``
                return None
            parts = enclosing
        return None

    def locate(self, error: PlaybookError) -> PlaybookError:
        """``error`` with the line of its field, if it is about this file and a field whose
        line (or an enclosing field's) is known; otherwise ``error`` itself."""
        if error.source != self.label or error.line is not None:
            return error
        line = self.line_of(error.path) if error.path else None
        if line is None:
            return error
        return PlaybookError(error.source, error.path, error.message, line)


def _enclosing(path: str) -> str:
    """``path`` without its last list position (``[3]``) or else its last key (``.name``, which
    may hold brackets); unchanged when it is a single key."""
    shorter = _LAST_POSITION.sub("", path)
    return shorter if shorter != path else _LAST_KEY.sub("", path)


def _normal(path: str) -> str:
    """Keys in snake case: pydantic names a field by its camelCase alias in some errors. A key
    longer than any field's name is left as it is: to_snake takes quadratic time on a long run
    of capitals (minutes for a YAML key of 100,000)."""
    return ".".join(to_snake(part) if len(part) <= 64 else part for part in path.split("."))


MAX_MESSAGE = 500
"""Longest error message: a field or stage named by a huge string is cut in the middle."""


def _clipped(text: str) -> str:
    if len(text) <= MAX_MESSAGE:
        return text
    keep = (MAX_MESSAGE - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


def _one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped, as ``repr`` would."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
