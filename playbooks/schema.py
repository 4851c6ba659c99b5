"""JSON Schema (the subset tools use) as pydantic models: how the arguments an LLM gives a tool
whose schema is data (an MCP server's, a playbook's inline definition) are validated.

:func:`arguments_model` maps each top-level property to a field ``f0``, ``f1``... aliased to the
JSON key (keys need not be Python names); an optional argument the LLM left out is :data:`UNSET`
and is not sent on. :func:`plain` turns validated values back into JSON data.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

__all__ = ["UNSET", "arguments_model", "arguments_problem", "plain"]


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()
"""The default of an optional argument the LLM left out: not sent to the server."""
_SIMPLE: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
}
_CONSTRAINTS = {
    "minimum": "ge",
    "maximum": "le",
    "exclusiveMinimum": "gt",
    "exclusiveMaximum": "lt",
    "minLength": "min_length",
    "maxLength": "max_length",
    "pattern": "pattern",
    "minItems": "min_length",
    "maxItems": "max_length",
}


def arguments_model(name: str, schema: dict[str, Any]) -> tuple[type[BaseModel], dict[str, str]]:
    """A model validating the tool's arguments, and its field names mapped to the JSON keys."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    extra: Literal["allow", "forbid"] = "allow" if schema.get("additionalProperties") else "forbid"
    model = _object_model(f"{name}_arguments", schema, defs, 0, extra=extra, top=True)
    aliases = {f"f{i}": key for i, key in enumerate(schema.get("properties", {}))}
    return model, aliases


def arguments_problem(arguments: Any, schema: dict[str, Any]) -> str | None:
    """What keeps ``arguments`` from being a valid call of a tool whose parameters are
    ``schema``, validated as a tool whose schema is data validates them (:func:`arguments_model`);
    None when they are. E.g. ``arguments.days: Input should be a valid integer``."""
    if not isinstance(arguments, dict):
        return "arguments: must be an object"
    try:
        model = _model_of(json.dumps(schema, sort_keys=True))
        model.model_validate(arguments)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = "arguments" + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )
        return f"{where}: {error['msg']}"
    except (TypeError, ValueError) as exc:  # a schema pydantic cannot express
        return f"the tool's schema cannot be checked: {exc}"
    return None


@functools.lru_cache(maxsize=256)
def _model_of(schema: str) -> type[BaseModel]:
    """The arguments model of a schema (as sorted JSON), built once: a tool offered at every
    turn is checked at every turn."""
    return arguments_model("tool", json.loads(schema))[0]


def _object_model(
    name: str,
    schema: dict[str, Any],
    defs: dict[str, Any],
    depth: int,
    *,
    extra: Literal["allow", "forbid", "ignore"] = "allow",
    top: bool = False,
) -> type[BaseModel]:
    required = set(schema.get("required", []))
    fields: dict[str, Any] = {}
    for i, (key, prop) in enumerate(schema.get("properties", {}).items()):
        annotation = _annotation(prop if isinstance(prop, dict) else {}, defs, depth + 1)
        if key in required:
            default: Any = ...
        elif top:
            default = UNSET
        else:
            default = None
        fields[f"f{i}"] = (annotation, Field(default, alias=key))
    return create_model(name, __config__=ConfigDict(extra=extra, populate_by_name=False), **fields)


def _annotation(schema: dict[str, Any], defs: dict[str, Any], depth: int) -> Any:
    if depth > 16:
        return Any
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = defs.get(ref.rsplit("/", 1)[-1])
        return _annotation(target, defs, depth + 1) if isinstance(target, dict) else Any
    if "const" in schema:
        return Literal[schema["const"]]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return Literal[tuple(schema["enum"])]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            members = tuple(_annotation(o, defs, depth + 1) for o in options if isinstance(o, dict))
            return Union[members] if members else Any  # noqa: UP007
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict):
        return _annotation(all_of[0], defs, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        members = tuple(_annotation({**schema, "type": k}, defs, depth + 1) for k in kind)
        return Union[members] if members else Any  # noqa: UP007
    if kind == "array":
        items = schema.get("items")
        inner = _annotation(items, defs, depth + 1) if isinstance(items, dict) else Any
        return _constrained(list[inner], schema)  # type: ignore[valid-type]
    if kind == "object":
        if isinstance(schema.get("properties"), dict) and schema["properties"]:
            return _object_model(f"object_{depth}", schema, defs, depth)
        return dict[str, Any]
    if kind in _SIMPLE:
        return _constrained(_SIMPLE[kind], schema)
    return Any


def _constrained(annotation: Any, schema: dict[str, Any]) -> Any:
    found = {arg: schema[key] for key, arg in _CONSTRAINTS.items() if key in schema}
    return Annotated[annotation, Field(**found)] if found else annotation


def plain(value: Any) -> Any:
    """A validated value as JSON data, leaving out the nested fields the LLM did not give."""
    if isinstance(value, BaseModel):
        data = {
            (info.alias or key): plain(getattr(value, key))
            for key, info in type(value).model_fields.items()
            if key in value.model_fields_set
        }
        return {**data, **{k: plain(v) for k, v in (value.model_extra or {}).items()}}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
