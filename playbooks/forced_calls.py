"""A forced tool call as a JSON schema, for servers that do not enforce ``tool_choice``.

llama.cpp's server accepts ``tool_choice: "required"`` (or a named function) and, for many chat
templates, lets the model answer in prose all the same. It does enforce a ``response_format``
JSON schema, by grammar: the answer is then one JSON object naming a tool and its arguments,
which :mod:`playbooks.markup` reads back as a tool call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["forced_call_format"]


def forced_call_format(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
) -> dict[str, Any] | None:
    """The ``response_format`` that makes the answer a call of the tool(s) ``tool_choice``
    forces (``"required"``: any of ``tools``; ``{"type": "function", "function": {"name":
    N}}``: N); None when it forces none."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    functions = [t["function"] for t in tools if isinstance(t.get("function"), dict)]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f.get("name") == name]
    elif tool_choice != "required":
        return None
    if not functions:
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}
