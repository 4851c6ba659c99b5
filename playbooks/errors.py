"""Playbook file errors: a :class:`PlaybookError` holds every :class:`Problem` found in a file,
one line each in file order, naming the file, the line where it is known, and the field, e.g.
``support.yaml:14: stages[1].voice.speaking_rate: Input should be ...``.

:class:`LineMap` remembers which line of a YAML document (a ``.yaml`` file, a Markdown front
matter) each field path came from, so an error found later, by validation on the parsed data,
still points at the line.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import yaml
from pydantic.alias_generators import to_snake

__all__ = ["MAX_PROBLEMS", "LineMap", "PlaybookError", "Problem", "shown"]

_LAST_POSITION = re.compile(r"\[\d+\]$")
_LAST_KEY = re.compile(r"\.[^.]*$")


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_PROBLEMS = 50
"""Most problems an error lists, then ``... and N more problems``: a hostile file cannot flood
the terminal."""


@dataclass(frozen=True)
class Problem:
    """One problem of a playbook file: its ``source`` (the file's name), the field ``path`` (""
    for the file as a whole), the ``message`` and the ``line`` when it is known."""

    source: str
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        """One line: ``file[:line]: [path: ]message``, control characters escaped, cut to
        :data:`MAX_MESSAGE` characters."""
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        if self.path:
            where += f": {self.path}"
        return _clipped(_one_line(f"{where}: {self.message}"))


class PlaybookError(ValueError):
    """An invalid playbook file: its :attr:`problems` (at least one), in file order (by line
    where known, else in the order found, after those placed). ``str()`` is one line per problem
    (at most :data:`MAX_PROBLEMS`, then ``... and N more problems``); a single problem reads
    ``file[:line]: [path: ]message``, on one line. ``source``, ``path``, ``message`` and
    ``line`` are the first problem's.

    ``PlaybookError(source, path, message, line)`` is one problem; :meth:`of` takes several."""

    problems: tuple[Problem, ...]
    source: str
    path: str
    message: str
    line: int | None

    def __init__(self, source: str, path: str, message: str, line: int | None = None) -> None:
        self._hold([Problem(source, path, message, line)])

    @classmethod
    def of(cls, problems: Iterable[Problem]) -> PlaybookError:
        """The error listing ``problems`` (at least one; a repeated problem is listed once)."""
        found = list(problems)
        if not found:
            raise ValueError("a PlaybookError needs a problem")
        error = cls.__new__(cls)
        error._hold(found)
        return error

    def _hold(self, problems: list[Problem]) -> None:
        self.problems = tuple(sorted(dict.fromkeys(problems), key=_file_order))
        first = self.problems[0]
        self.source, self.path, self.message, self.line = (
            first.source,
            first.path,
            first.message,
            first.line,
        )
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """The lines ``str()`` joins: one per problem, at most :data:`MAX_PROBLEMS` of them,
        then ``... and N more problems``."""
        lines = [str(problem) for problem in self.problems[:MAX_PROBLEMS]]
        hidden = len(self.problems) - MAX_PROBLEMS
        if hidden > 0:
            lines.append(f"... and {hidden} more problem{'s' if hidden > 1 else ''}")
        return lines

    def map(self, change: Callable[[Problem], Problem]) -> PlaybookError:
        """This error with ``change`` applied to each problem; itself if none changes."""
        changed = [change(problem) for problem in self.problems]
        if all(new is old for new, old in zip(changed, self.problems, strict=True)):
            return self
        return PlaybookError.of(changed)

    def __reduce__(self) -> tuple[Callable[..., PlaybookError], tuple[tuple[Problem, ...]]]:
        return PlaybookError.of, (self.problems,)


def _file_order(problem: Problem) -> tuple[bool, int]:
    return problem.line is None, problem.line or 0


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
        """``error`` with the line of each problem's field, for the problems about this file
        and a field whose line (or an enclosing field's) is known; ``error`` itself when no
        problem gains a line."""
        return error.map(self.place)

    def place(self, problem: Problem) -> Problem:
        """``problem`` with the line of its field (see :meth:`locate`), else ``problem``."""
        if problem.source != self.label or problem.line is not None or not problem.path:
            return problem
        line = self.line_of(problem.path)
        if line is None:
            return problem
        return Problem(problem.source, problem.path, problem.message, line)


def _enclosing(path: str) -> str:
    """``path`` without its last list position (``[3]``) or else its last key (``.name``, which
    may hold brackets); unchanged when it is a single key."""
    shorter = _LAST_POSITION.sub("", path)
    return shorter if shorter != path else _LAST_KEY.sub("", path)


def _normal(path: str) -> str:
    """Keys in snake case: pydantic names a field by its camelCase alias in some errors. A key
    longer than any field's name is left as it is: to_snake takes quadratic time on a long run
    of capitals (minutes for a YAML key of 100,000)."""
    return ".".join(_snake(part) for part in path.split("."))


@functools.lru_cache(maxsize=4096)
def _snake(part: str) -> str:
    """One part of a path in snake case (cached: a document whose aliases repeat each other
    records up to ``LineMap.limit`` paths made of the same few parts)."""
    return to_snake(part) if len(part) <= 64 else part


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
