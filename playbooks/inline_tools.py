"""Tools a playbook defines itself (llmrtc's ``ToolDefinition``: name, description, parameters),
bound by name to an implementation.

A definition is what the LLM is offered and what its arguments are validated against. Its
implementation is, in this order of lookup:

- a ``url``: an HTTP tool. The arguments are POSTed as a JSON object (with the definition's
  ``headers``, within its ``timeout_ms``) and the response body is the result; a status of 400 or
  more is a failed call, its body shown to the LLM;
- a tool of the tools module or of an MCP server with that name. Its own schema must agree with
  the definition: every argument the definition gives is one the tool takes (``orderId`` may name
  a Python parameter ``order_id``), the tool's required arguments are required by the definition,
  and simple types match. A disagreement fails the load, naming both.

The same definition may be repeated (llmrtc users embed a tool's definition in each stage that
offers it); two different definitions under one name fail the load.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic.alias_generators import to_snake

from .errors import PlaybookError, shown
from .models import Playbook, ToolDefinition
from .schema import UNSET, arguments_model, plain
from .tools import Tool, ToolError

__all__ = ["Definition", "bind_definitions", "inline_definitions", "unbound_message"]

_COMPATIBLE_TYPES = {("integer", "number")}
"""(definition's type, tool's type) pairs that agree although they differ: an integer is a
number."""


@dataclass(frozen=True)
class Definition:
    """An inline definition and where it first appears (``stages[1].tools[0]``)."""

    path: str
    spec: ToolDefinition


def inline_definitions(spec: Playbook, label: str) -> dict[str, Definition]:
    """Every inline definition of ``spec`` by name, ``global_tools`` first; raises
    PlaybookError when one name has two different definitions."""
    found: dict[str, Definition] = {}
    for path, definition in _definitions(spec):
        first = found.setdefault(definition.name, Definition(path, definition))
        if first.spec != definition:
            raise PlaybookError(
                label,
                path,
                f"tool {shown(definition.name)} is defined differently at {first.path}",
            )
    return found


def _definitions(spec: Playbook) -> Iterator[tuple[str, ToolDefinition]]:
    lists = [("global_tools", spec.global_tools)]
    lists += [(f"stages[{i}].tools", stage.tools) for i, stage in enumerate(spec.stages)]
    for where, entries in lists:
        for j, entry in enumerate(entries):
            if isinstance(entry, ToolDefinition):
                yield f"{where}[{j}]", entry


def unbound_message(name: str) -> str:
    """What an inline definition with no implementation is told."""
    return (
        f"tool {shown(name)} is defined here but has no implementation: give it a @tool function "
        f"{name} in the tools module (tools_module in the file, or --tools-module), a tool of an "
        'MCP server (mcp_servers), or a "url" to call it over HTTP'
    )


def bind_definitions(
    definitions: Mapping[str, Definition],
    implementations: Mapping[str, Tool],
    sources: Mapping[str, str],
    label: str,
) -> dict[str, Tool]:
    """The tool the LLM is given for each definition, bound to its implementation (an HTTP
    endpoint, or the tool of ``implementations`` with its name, which ``sources`` describes
    for errors: "the tools module", "MCP server 'shop'"); raises PlaybookError for a
    definition with no implementation, two of them, or a schema that disagrees."""
    bound: dict[str, Tool] = {}
    for name, definition in definitions.items():
        spec = definition.spec
        implementation = implementations.get(name)
        if spec.url is not None:
            if implementation is not None:
                raise PlaybookError(
                    label,
                    f"{definition.path}.url",
                    f"tool {shown(name)} has a url and is also a tool of {sources[name]}",
                )
            bound[name] = _http_tool(spec)
        elif implementation is None:
            raise PlaybookError(label, definition.path, unbound_message(name))
        else:
            bound[name] = _bound_tool(definition, implementation, sources[name], label)
    return bound


def _bound_tool(definition: Definition, tool: Tool, source: str, label: str) -> Tool:
    spec = definition.spec
    keys = _key_map(definition, tool, source, label)
    model, aliases = arguments_model(spec.name, spec.parameters)

    async def call(**fields: Any) -> str:
        sent = {keys[aliases[f]]: plain(v) for f, v in fields.items() if v is not UNSET}
        return await tool.call(json.dumps(sent))

    return Tool(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        function=call,
        timeout_s=tool.timeout_s,
        on_interrupt=tool.on_interrupt,
        side_effects=tool.side_effects,
        arguments_model=model,
    )


def _key_map(definition: Definition, tool: Tool, source: str, label: str) -> dict[str, str]:
    """Each argument of the definition mapped to the tool's (the same name, or its snake_case
    form); raises PlaybookError naming the definition and ``source`` where they disagree."""
    spec = definition.spec
    ours: dict[str, Any] = spec.parameters.get("properties", {})
    theirs: dict[str, Any] = tool.parameters.get("properties", {})
    where = f"{definition.path}.parameters"

    def disagree(path: str, problem: str) -> PlaybookError:
        return PlaybookError(
            label, path, f"tool {shown(spec.name)} here and in {source} disagree: {problem}"
        )

    keys: dict[str, str] = {}
    for key, schema in ours.items():
        target = key if key in theirs else to_snake(key)
        if target not in theirs:
            raise disagree(f"{where}.properties.{key}", f"it takes no argument {shown(key)}")
        ours_type, theirs_type = schema.get("type"), theirs[target].get("type")
        if (
            isinstance(ours_type, str)
            and isinstance(theirs_type, str)
            and ours_type != theirs_type
            and (ours_type, theirs_type) not in _COMPATIBLE_TYPES
        ):
            raise disagree(
                f"{where}.properties.{key}",
                f"{key} is {ours_type} here, {theirs_type} there",
            )
        keys[key] = target
    required_here = {keys[key] for key in spec.parameters.get("required", [])}
    for needed in tool.parameters.get("required", []):
        if needed not in required_here:
            found = next((key for key, target in keys.items() if target == needed), None)
            problem = (
                f"it requires {shown(needed)}, which is optional here"
                if found is not None
                else f"it requires {shown(needed)}, which is not defined here"
            )
            raise disagree(where, problem)
    return keys


def _http_tool(spec: ToolDefinition) -> Tool:
    assert spec.url is not None
    url, headers, timeout_s = spec.url, dict(spec.headers), spec.timeout_ms / 1000
    model, aliases = arguments_model(spec.name, spec.parameters)

    async def post(**fields: Any) -> str:
        body = {aliases[f]: plain(v) for f, v in fields.items() if v is not UNSET}
        try:
            async with httpx.AsyncClient(timeout=timeout_s, verify=_tls()) as client:
                response = await client.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ToolError(f"tool {spec.name!r}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            text = response.text[:500] or response.reason_phrase
            raise ToolError(f"tool {spec.name!r} failed: HTTP {response.status_code}: {text}")
        return response.text

    return Tool(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        function=post,
        timeout_s=timeout_s,
        arguments_model=model,
    )


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS settings of HTTP tools, built once: loading the CA certificates takes tens of
    milliseconds (measured 46 ms), which a client built per call would spend on the event
    loop, mid-turn."""
    return ssl.create_default_context()
