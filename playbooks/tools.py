"""Tools: plain Python functions the LLM may call, described to it by a JSON schema.

Decorate a function of a playbook's tools module with :func:`tool`. Its parameters' type hints and
its docstring (first paragraph, plus a Google-style ``Args:`` section) become the schema; arguments
from the LLM are validated against it before the call. Sync tools run in a worker thread, async
tools on the event loop; every call has a timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

__all__ = ["DEFAULT_TOOL_TIMEOUT_S", "InvalidToolCall", "Tool", "ToolError", "tool"]

DEFAULT_TOOL_TIMEOUT_S = 30.0
OnInterrupt = Literal["cancel", "finish"]
_MARKER = "__vocable_tool__"


class ToolError(Exception):
    """A tool call that could not produce a result; the message is shown to the LLM."""


class InvalidToolCall(ToolError):
    """A call the LLM got wrong (unknown tool, arguments that are not valid), as opposed to a
    tool that failed while running."""


def tool_arguments(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object (none: empty); raises InvalidToolCall."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        raise InvalidToolCall("arguments are not valid JSON") from None
    if not isinstance(parsed, dict):
        raise InvalidToolCall("arguments must be a JSON object")
    return parsed


@dataclass(frozen=True)
class Tool:
    """A callable with its LLM-facing description; built by :func:`tool` or ``from_function``."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    on_interrupt: OnInterrupt = "cancel"
    """When the caller barges in mid-call: ``cancel`` the tool, or let it ``finish`` (for
    actions that must not stop half-way) and record its real result."""
    side_effects: bool = True
    """Whether calling it changes something outside the conversation (books, sends, charges). A
    turn started before the caller has surely finished (on a speculative transcript) runs such
    tools only once the turn is confirmed; declare ``side_effects=False`` for look-ups."""
    arguments_model: type[BaseModel] | None = field(default=None, repr=False)

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        on_interrupt: OnInterrupt = "cancel",
        side_effects: bool = True,
    ) -> Tool:
        summary, arg_docs = _parse_docstring(inspect.getdoc(function) or "")
        model = _arguments_model(function, arg_docs)
        schema = model.model_json_schema()
        _strip_titles(schema)
        return cls(
            name=name or function.__name__,
            description=description or summary,
            parameters=schema,
            function=function,
            timeout_s=timeout_s,
            on_interrupt=on_interrupt,
            side_effects=side_effects,
            arguments_model=model,
        )

    def openai_schema(self) -> dict[str, Any]:
        """The ``tools`` entry for a chat-completions request."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def call(self, arguments_json: str) -> str:
        """Validate the LLM's JSON arguments, run the tool, and return its result as text.

        Raises :class:`InvalidToolCall` for invalid arguments, :class:`ToolError` for a timeout or
        an exception in the tool.
        Cancellation propagates (a sync tool's thread is left to finish on its own).
        """
        arguments = self._validate(arguments_json)
        try:
            async with asyncio.timeout(self.timeout_s):
                if inspect.iscoroutinefunction(self.function):
                    result = await self.function(**arguments)
                else:
                    result = await asyncio.to_thread(self.function, **arguments)
        except TimeoutError:
            raise ToolError(f"tool {self.name!r} timed out after {self.timeout_s:g} s") from None
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(f"tool {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        return _result_text(result)

    def _validate(self, arguments_json: str) -> dict[str, Any]:
        try:
            raw = json.loads(arguments_json or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidToolCall(
                f"arguments for {self.name!r} are not valid JSON: {exc.msg}"
            ) from None
        if not isinstance(raw, dict):
            raise InvalidToolCall(f"arguments for {self.name!r} must be a JSON object")
        if self.arguments_model is None:
            return raw
        try:
            validated = self.arguments_model.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(arguments)'}: {err['msg']}"
                for err in exc.errors()
            )
            raise InvalidToolCall(f"invalid arguments for {self.name!r}: {problems}") from None
        return {name: getattr(validated, name) for name in type(validated).model_fields}


@overload
def tool(function: Callable[..., Any], /) -> Callable[..., Any]: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = ...,
    on_interrupt: OnInterrupt = ...,
    side_effects: bool = ...,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    on_interrupt: OnInterrupt = "cancel",
    side_effects: bool = True,
) -> Any:
    """Mark a function as a playbook tool; usable bare (``@tool``) or with options.

    The function itself is returned unchanged, so it stays directly callable in tests.
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(
            fn,
            _MARKER,
            Tool.from_function(
                fn,
                name=name,
                description=description,
                timeout_s=timeout_s,
                on_interrupt=on_interrupt,
                side_effects=side_effects,
            ),
        )
        return fn

    return mark(function) if function is not None else mark


def tool_of(obj: object) -> Tool | None:
    """The :class:`Tool` attached by :func:`tool`, if any."""
    found = getattr(obj, _MARKER, None)
    return found if isinstance(found, Tool) else None


def _arguments_model(function: Callable[..., Any], arg_docs: dict[str, str]) -> type[BaseModel]:
    hints = _type_hints(function)
    fields: dict[str, Any] = {}
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, Field(default, description=arg_docs.get(param.name)))
    return create_model(
        f"{function.__name__}_arguments",
        __config__=ConfigDict(extra="forbid"),
        **fields,
    )


def _type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        return inspect.get_annotations(function, eval_str=True)
    except Exception:  # an unresolvable forward reference: fall back to untyped
        return {}


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and the per-argument descriptions of a Google-style docstring."""
    lines = doc.splitlines()
    summary_lines: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line):
            break
        summary_lines.append(line.strip())
    args: dict[str, str] = {}
    in_args = False
    current: str | None = None
    arg_indent: int | None = None  # deeper lines continue the argument above
    for line in lines:
        if _ARGS_HEADER.match(line):
            in_args = True
            continue
        if not in_args:
            continue
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section
        indent = len(line) - len(line.lstrip())
        match = _ARG_LINE.match(line)
        if match and (arg_indent is None or indent <= arg_indent):
            arg_indent = indent
            current = match.group(1).lstrip("*")
            args[current] = match.group(2).strip()
        elif current and line.strip():
            args[current] = f"{args[current]} {line.strip()}"
    return " ".join(summary_lines), args


_SCHEMA_VALUES = frozenset({"default", "const", "enum", "examples"})
"""Schema keywords holding data, where a "title" key is the tool author's, not pydantic's."""


def _strip_titles(schema: Any) -> None:
    """Drop pydantic's generated titles: noise in the LLM's context."""
    if isinstance(schema, dict):
        schema.pop("title", None)
        for key, value in schema.items():
            if key in _SCHEMA_VALUES:
                continue
            if key == "properties" and isinstance(value, dict):
                for prop in value.values():
                    _strip_titles(prop)
            else:
                _strip_titles(value)
    elif isinstance(schema, list):
        for item in schema:
            _strip_titles(item)


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    return json.dumps(result, default=str, ensure_ascii=False)
