"""What a model writes is not what is spoken: a streaming filter that keeps only the prose.

Small models often write tool calls as text instead of using the API's ``tool_calls``, and
reasoning models think aloud. :class:`MarkupFilter` takes one LLM round's text deltas and
releases the speakable text, holding nothing back but what could still open markup:

- ``<think>``, ``<thinking>`` and ``<reasoning>`` blocks are dropped (a stray closing tag too),
  and so are the chat template's own ``<tool_response>`` and ``<tools>`` blocks and control
  tokens (``<|im_end|>``), which small models echo;
- code fences ``` are dropped, unless they hold JSON (then read as below);
- JSON objects (and lists of them) in the text, ``<tool_call>...</tool_call>`` blocks and fenced
  JSON are parsed: a tool call in any of the usual forms (``{"name", "arguments"|"parameters"}``,
  ``{"function": {...}}``, ``{"tool_call": {...}}``, ``{"tool_calls": [...]}``) is reported as a
  :class:`TextToolCall`; ``{"response": "text"}`` is spoken as its text; anything else is dropped.

Whatever is dropped is logged (logger ``playbooks.markup``), one line, truncated. Unknown
``<tags>`` and a lone ``<``, ``{`` or backtick in prose are released as soon as they cannot open
markup any more. Whether a text tool call's arguments fit a tool is
:func:`playbooks.schema.arguments_problem`'s to say.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MarkupFilter", "TextToolCall"]

log = logging.getLogger(__name__)

_TOOL_CALL = "<tool_call>"
_REASONING_TAGS = ("<think>", "<thinking>", "<reasoning>")
_PROTOCOL_TAGS = ("<tool_response>", "<tools>")
"""What chat templates wrap tool results and definitions in: a small model echoes them."""
_OPENING_TAGS = (*_REASONING_TAGS, *_PROTOCOL_TAGS, _TOOL_CALL)
_CLOSING_TAGS = tuple(f"</{tag[1:]}" for tag in _OPENING_TAGS)
_TAGS = _OPENING_TAGS + _CLOSING_TAGS
_LONGEST_TAG = max(len(tag) for tag in _TAGS)
_FENCE = "```"
_CLOSERS = {
    closer: re.compile(re.escape(closer), re.IGNORECASE) for closer in (*_CLOSING_TAGS, _FENCE)
}
"""What ends each kind of block, found in any case."""
_MAY_OPEN = re.compile(r"[{\[<`]")
_SPECIAL_TOKEN = re.compile(r"<\|[\w.-]{1,40}\|>")
"""A chat template's control token written out (``<|im_end|>``, ``<|python_tag|>``)."""
_SPECIAL_TOKEN_START = re.compile(r"<\|[\w.-]{0,40}\|?")
"""What may still become a control token."""
_FENCE_INFO = re.compile(r"[\w+.#-]*")
_JSON_OUTSIDE_STRINGS = frozenset("0123456789+-.eE,:{}[] \t\r\ntruefalsn")
"""Characters that may appear in JSON outside its strings: any other one means prose."""
_LOG_CHARS = 160

_Mode = Literal["text", "json", "block"]


@dataclass(frozen=True)
class TextToolCall:
    """A tool call the model wrote as text (not yet checked against the tools offered)."""

    name: str
    arguments: dict[str, Any]
    at: int
    """Where it was written: how many characters of speakable text the round released before."""
    markup: str
    """What the model wrote, for logs."""


class MarkupFilter:
    """The speakable text of ONE LLM round. Feed it with :meth:`push`, end it with :meth:`finish`;
    :meth:`take_tool_calls` returns the tool calls found (in the order written).

    Prose is released at once; from a character that may open markup (``{``, ``[``, ``<`` or a
    backtick) the text is held until it is known to be prose (released) or markup (dropped,
    spoken as its ``response``, or reported as tool calls).
    """

    def __init__(self) -> None:
        self._pending = ""
        """Text received and neither released nor dropped yet."""
        self._mode: _Mode = "text"
        self._opener = ""
        self._closer = ""
        """In a block: the tag or fence that opened it and the one that ends it."""
        self._scanned = 0
        """In a block or JSON: how much of ``_pending`` was already scanned."""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._released = 0
        self._ends_in_space = False
        self._trim = False
        """Drop the whitespace that follows dropped markup (when no word precedes it)."""
        self._calls: list[TextToolCall] = []

    def push(self, delta: str) -> str:
        """Add the next delta; returns the text that became speakable (maybe "")."""
        self._pending += delta
        return self._drain(final=False)

    def finish(self) -> str:
        """The round ended: returns the rest of the speakable text. An unfinished block or JSON
        object is read as it stands (a tool call in it still counts) or dropped."""
        return self._drain(final=True)

    def take_tool_calls(self) -> list[TextToolCall]:
        """The tool calls found since the last call of this method."""
        calls, self._calls = self._calls, []
        return calls

    # -- scanning --------------------------------------------------------------------------------

    def _drain(self, final: bool) -> str:
        out: list[str] = []
        while self._pending:
            if self._mode == "text":
                step = self._text_step(final)
            elif self._mode == "json":
                step = self._json_step(final)
            else:
                step = self._block_step(final)
            if step is None:  # waiting for more text
                break
            out.append(step)
        return "".join(out)

    def _text_step(self, final: bool) -> str | None:
        pending = self._pending
        match = _MAY_OPEN.search(pending)
        if match is None:
            self._pending = ""
            return self._release(pending)
        if match.start() > 0:
            self._pending = pending[match.start() :]
            return self._release(pending[: match.start()])
        first = pending[0]
        if first == "<":
            token = _SPECIAL_TOKEN.match(pending)
            if token is not None:
                self._pending = pending[token.end() :]
                log.info("dropped a control token %s from speech", token.group())
                self._dropped()
                return ""
            if not final and _SPECIAL_TOKEN_START.fullmatch(pending):
                return None
            head = pending[:_LONGEST_TAG].lower()
            for tag in _TAGS:
                if head.startswith(tag):
                    self._pending = pending[len(tag) :]
                    if tag.startswith("</"):
                        log.info("dropped a stray %s from speech", tag)
                        self._dropped()
                    else:
                        self._enter_block(tag, f"</{tag[1:]}")
                    return ""
            if not final and any(tag.startswith(head) for tag in _TAGS):
                return None
        elif first == "`":
            if pending.startswith(_FENCE):
                self._pending = pending[len(_FENCE) :]
                self._enter_block(_FENCE, _FENCE)
                return ""
            if not final and _FENCE.startswith(pending):
                return None
        else:
            opens = _opens_json(pending)
            if opens:
                self._mode = "json"
                self._scanned = self._depth = 0
                self._in_string = self._escaped = False
                return ""
            if opens is None and not final:
                return None
        self._pending = pending[1:]
        return self._release(first)

    def _json_step(self, final: bool) -> str | None:
        pending = self._pending
        for i in range(self._scanned, len(pending)):
            char = pending[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._mode = "text"
                    self._pending = pending[i + 1 :]
                    return self._read(pending[: i + 1], pending[: i + 1], "JSON")
            elif char not in _JSON_OUTSIDE_STRINGS:  # prose that only began like JSON
                self._mode = "text"
                self._pending = pending[1:]
                return self._release(pending[0])
        self._scanned = len(pending)
        if not final:
            return None
        self._mode = "text"
        self._pending = ""
        return self._read(pending, pending, "unfinished JSON")

    def _enter_block(self, opener: str, closer: str) -> None:
        self._mode = "block"
        self._opener, self._closer = opener, closer
        self._scanned = 0

    def _block_step(self, final: bool) -> str | None:
        pending, closer = self._pending, self._closer
        start = max(0, self._scanned - len(closer) + 1)
        found = _CLOSERS[closer].search(pending, start)
        if found is None and not final:
            self._scanned = len(pending)
            return None
        self._mode = "text"
        if found is None:
            self._pending = ""
            body, closed = pending, False
        else:
            self._pending = pending[found.end() :]
            body, closed = pending[: found.start()], True
        markup = f"{self._opener}{body}{closer if closed else ''}"
        unclosed = "" if closed else "unclosed "
        article = "a" if closed else "an"
        if self._opener == _FENCE:
            code = _code(body)
            if code.lstrip().startswith(("{", "[")):
                return self._read(code, markup, f"{unclosed}code block")
            return self._drop(f"{article} {unclosed}code block", markup, closed)
        if self._opener == _TOOL_CALL:
            return self._read(_unfenced(body), markup, f"{unclosed}{_TOOL_CALL} block")
        if self._opener in _PROTOCOL_TAGS:
            return self._drop(f"{article} {unclosed}{self._opener} block", markup, closed)
        return self._drop(f"{article} {unclosed}reasoning block", markup, closed)

    # -- what markup means -----------------------------------------------------------------------

    def _read(self, text: str, markup: str, kind: str) -> str:
        """Markup that may hold JSON: tool calls are reported, responses spoken, the rest
        dropped."""
        values = _json_values(text)
        if values is None:
            return self._drop(f"malformed {kind}", markup, closed=False)
        spoken: list[str] = []
        for value in values:
            calls = _tool_calls(value)
            if calls is not None:
                for name, arguments in calls:
                    self._calls.append(TextToolCall(name, arguments, self._released, markup))
                self._dropped()
            elif isinstance(value, dict) and isinstance(value.get("response"), str):
                spoken.append(self._release(value["response"]))
            else:
                self._drop(kind, markup, closed=True)
        return "".join(spoken)

    def _drop(self, what: str, markup: str, closed: bool) -> str:
        level = logging.INFO if closed else logging.WARNING
        clipped = markup if len(markup) <= _LOG_CHARS else markup[:_LOG_CHARS] + "…"
        log.log(level, "dropped %s from speech: %r", what, clipped)
        self._dropped()
        return ""

    def _dropped(self) -> None:
        self._trim = self._released == 0 or self._ends_in_space

    def _release(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            if not text:
                return ""
            self._trim = False
        if text:
            self._released += len(text)
            self._ends_in_space = text[-1].isspace()
        return text


def _opens_json(text: str) -> bool | None:
    """Whether ``text`` (from its ``{`` or ``[``) opens a JSON object with keys, or a list of
    them (``{}`` and ``{ word }`` are prose); None: not known yet."""
    expected = "{" if text[0] == "[" else '"'
    for char in text[1:]:
        if char.isspace():
            continue
        if char != expected:
            return False
        if expected == '"':
            return True
        expected = '"'
    return None


def _code(body: str) -> str:
    """A fenced block's code: ``body`` without its info string (```` ```json ````)."""
    info = _FENCE_INFO.match(body)
    end = info.end() if info else 0
    return body[end + 1 :] if body[end : end + 1] == "\n" else body


def _unfenced(text: str) -> str:
    """``text`` without the code fence some models put around JSON inside a tag."""
    stripped = text.strip()
    if not stripped.startswith(_FENCE):
        return text
    body = stripped[len(_FENCE) :]
    return _code(body[: -len(_FENCE)] if body.endswith(_FENCE) else body)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after the other; None if it holds anything else."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    index, text = 0, text.strip()
    while index < len(text):
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while index < len(text) and (text[index].isspace() or text[index] == ","):
            index += 1
    return values or None


def _tool_calls(value: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """The ``(name, arguments)`` of the tool calls ``value`` writes; None if it is no tool call."""
    if isinstance(value, list):
        calls: list[tuple[str, dict[str, Any]]] = []
        for item in value:
            found = _tool_calls(item)
            if found is None:
                return None
            calls += found
        return calls or None
    if not isinstance(value, dict):
        return None
    for wrapper in ("tool_calls", "tool_call"):
        if wrapper in value:
            return _tool_calls(value[wrapper])
    function = value.get("function")
    if isinstance(function, dict):  # {"type": "function", "function": {"name", "arguments"}}
        return _tool_calls(function)
    name = value.get("name", function)  # {"function": "name", "arguments": {...}} too
    key = next((k for k in ("arguments", "parameters") if k in value), None)
    if not isinstance(name, str) or not name or key is None:
        return None
    arguments = value[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    return [(name, arguments)] if isinstance(arguments, dict) else None
