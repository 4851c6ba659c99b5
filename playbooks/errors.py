"""Playbook file errors: one line each, naming the file, the line where it is known, and the
field, e.g. ``support.yaml:14: stages[1].voice.speaking_rate: Input should be ...``.

:class:`LineMap` remembers which line of a YAML document (a ``.yaml`` file, a Markdown front
matter) each field path came from, so an error found later, by validation on the parsed data,
still points at the line.
"""

from __future__ import annotations

import re
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
        super().__init__(_one_line(f"{where}: {message}"))


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

    def record(self, node: yaml.Node, offset: int = 1, path: str = "") -> None:
        """Record the line of every key and list item under ``node``, a composed YAML document
        whose 0-based marks are ``offset`` less than the file's line numbers."""
        if len(self.lines) >= self.limit:
            return
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    child = f"{path}.{key.value}" if path else str(key.value)
                    self.add(child, key.start_mark.line + offset)
                    self.record(value, offset, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}[{index}]"
                self.add(child, item.start_mark.line + offset)
                self.record(item, offset, child)

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
    """Keys in snake case: pydantic names a field by its camelCase alias in some errors."""
    return ".".join(to_snake(part) for part in path.split("."))


def _one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped, as ``repr`` would."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
