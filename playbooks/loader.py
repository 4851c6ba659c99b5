"""Loading playbook files (YAML, JSON, Markdown) and their tools module, one clear error each.

Every failure raises :class:`PlaybookError`, whose message names the file, the line (YAML and
Markdown files) and the field path, e.g.
``support.yaml:68: transitions[2].action.target_stage: unknown stage 'billing'``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_snake

from .checks import (
    RESERVED_TOOL,
    ToolNames,
    check_questions,
    check_references,
    expand_server_tools,
    unvalidated_references,
)
from .errors import LineMap, PlaybookError, Problem
from .errors import shown as _shown
from .inline_tools import bind_definitions, inline_definitions
from .models import Playbook, ToolDefinition
from .tools import Tool, tool_of

__all__ = [
    "RESERVED_TOOL",
    "LoadedPlaybook",
    "PlaybookError",
    "check_playbook",
    "load_playbook",
    "load_playbooks",
    "read_document",
]

PLAYBOOK_SUFFIXES = (".yaml", ".yml", ".json", ".md")
MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings; a YAML alias counts its whole value again each time it
is used) a playbook file may hold: bounds the work validation does on an alias bomb."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings a playbook file may have."""
Locate = Callable[[PlaybookError], PlaybookError]
"""Adds the line of its field to an error about the file (see :class:`LineMap`)."""


@dataclass(frozen=True)
class LoadedPlaybook:
    """A validated playbook together with the tools and condition functions it refers to.

    ``spec`` is the file's playbook with each ``mcp:<server>`` tool entry replaced by the names
    of that server's tools; ``servers`` holds those names by server.
    """

    spec: Playbook
    tools: Mapping[str, Tool]
    functions: Mapping[str, Callable[..., Any]]
    source: Path | None = None
    servers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_spec(
        cls,
        spec: Playbook,
        tools: Mapping[str, Tool] | None = None,
        functions: Mapping[str, Callable[..., Any]] | None = None,
        source: Path | None = None,
        servers: Mapping[str, tuple[str, ...]] | None = None,
    ) -> LoadedPlaybook:
        """Check cross-references (``tools`` includes the MCP servers' tools, whose names
        ``servers`` gives by server), expand ``mcp:<server>`` entries and build; raises
        :class:`PlaybookError`."""
        servers = dict(servers or {})
        from_servers: set[str] = set().union(*servers.values())
        names = ToolNames(
            module=frozenset(name for name in tools or {} if name not in from_servers),
            functions=frozenset(functions or {}),
            servers=servers,
        )
        label = source.name if source else spec.id
        check_references(spec, source, label, names)
        expanded = expand_server_tools(spec, servers)
        check_questions(expanded, {n: t.parameters for n, t in (tools or {}).items()}, label)
        return cls(expanded, dict(tools or {}), dict(functions or {}), source, servers)


def load_playbook(path: str | Path, tools_module: str | Path | None = None) -> LoadedPlaybook:
    """Parse, validate and resolve one playbook file: its tools module (the file's own, else
    ``tools_module``) is imported, its MCP servers are started and its inline tool definitions
    are bound (see :func:`check_playbook` for a check that runs nothing)."""
    path = Path(path)
    data, locate = _read(path)
    try:
        return _resolve(data, path, path.name, _given(tools_module))
    except PlaybookError as exc:
        raise locate(exc) from None


def check_playbook(path: str | Path, tools_module: str | Path | None = None) -> Playbook:
    """Parse and validate one playbook file without running anything: the tools module is not
    imported (only found) and no MCP server is started, so tool and function names are checked
    only when the file itself says them all: no ``tools_module``, and every MCP server lists its
    ``tools``. Raises :class:`PlaybookError` (with the line) like :func:`load_playbook`."""
    path = Path(path)
    label = path.name
    data, locate = _read(path)
    try:
        spec = _validate(data, label)
        module = _module_path(spec, path, _given(tools_module))
        if module is not None:
            _module_file(module, label)
        inline_definitions(spec, label)  # one name, two definitions
        names = offline_tool_names(spec) if module is None else None
        check_references(spec, path, label, names)
    except PlaybookError as exc:
        raise locate(exc) from None
    return spec


def offline_tool_names(spec: Playbook) -> ToolNames | None:
    """The tool names ``spec`` can refer to, as far as the file alone tells (its inline
    definitions and the MCP servers' listed tools; function names are not known, since a tools
    module may be given when it runs); None when a tools module or an MCP server taking ``all``
    its tools adds names only known once they run."""
    if spec.tools_module or any(server.tools == "all" for server in spec.mcp_servers):
        return None
    entries = [*spec.global_tools, *(entry for stage in spec.stages for entry in stage.tools)]
    return ToolNames(
        module=frozenset(e.name for e in entries if isinstance(e, ToolDefinition)),
        functions=None,
        servers={s.name: tuple(s.tools) for s in spec.mcp_servers if s.tools != "all"},
    )


def read_document(path: Path, what: str = "a playbook") -> tuple[Any, Locate]:
    """A playbook-like file's data (a mapping; for files beside playbooks, such as test
    scenarios, ``what`` names the kind in errors) and how to put lines on errors about it;
    raises :class:`PlaybookError` when it cannot be read, parsed, or is too big."""
    data, locate = _read(path, what)
    _check_size(data, path.name)
    return data, locate


def _read(path: Path, what: str = "a playbook") -> tuple[Any, Locate]:
    """The file's parsed data (a Markdown file compiled) and how to put lines on its errors."""
    label = path.name
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PlaybookError(str(path), "", f"cannot read file: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise PlaybookError(
            label, "", f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}"
        ) from None
    if path.suffix.lower() == ".md":
        from .markdown import compile_markdown, locate  # it imports this module

        data, lines = compile_markdown(text, label)
        return data, lambda exc: locate(lines, exc)
    data, where = _parse(text, label, path.suffix.lower(), what)
    return data, where.locate if where is not None else lambda exc: exc


def _validate(data: Any, label: str) -> Playbook:
    _check_size(data, label)
    try:
        return Playbook.model_validate(data)
    except ValidationError as exc:
        problems = _validation_problems(label, exc)
        # the stage ids a transition or the start names, which pydantic cannot check
        named = {problem.path for problem in problems}
        problems += [p for p in unvalidated_references(data, label) if p.path not in named]
        raise PlaybookError.of(problems) from None


def _resolve(data: Any, path: Path, label: str, tools_module: Path | None) -> LoadedPlaybook:
    """Validate a parsed playbook file and load the tools it refers to."""
    spec = _validate(data, label)
    tools: dict[str, Tool] = {}
    functions: dict[str, Callable[..., Any]] = {}
    sources: dict[str, str] = {}
    module_file = _module_path(spec, path, tools_module)
    if module_file is not None:
        module = _import_module(module_file, label)
        tools, functions = _collect(module)
        sources = dict.fromkeys(tools, f"the tools module {module_file.name}")
    servers: dict[str, tuple[str, ...]] = {}
    if spec.mcp_servers:
        by_server = _mcp_tools(spec, path.parent, label, tools)
        servers = {name: tuple(found) for name, found in by_server.items()}
        for server, found in by_server.items():
            tools.update(found)
            sources.update(dict.fromkeys(found, f"MCP server {server!r}"))
    definitions = inline_definitions(spec, label)
    tools.update(bind_definitions(definitions, tools, sources, label))
    return LoadedPlaybook.from_spec(spec, tools, functions, path, servers)


def _given(tools_module: str | Path | None) -> Path | None:
    return Path(tools_module) if tools_module is not None else None


def _module_path(spec: Playbook, path: Path, given: Path | None) -> Path | None:
    """The tools module: the file's own (relative to it), else the one given (``--tools-module``,
    relative to the working directory), else none."""
    if spec.tools_module:
        return path.parent / spec.tools_module
    return given


def _mcp_tools(
    spec: Playbook, cwd: Path, label: str, module_tools: Mapping[str, Tool]
) -> dict[str, dict[str, Tool]]:
    """The tools of each of the playbook's MCP servers, by server name (sessions opened now); see
    :mod:`playbooks.mcp`."""
    from .mcp import McpLoadError, mcp_tools

    try:
        found = mcp_tools(spec.mcp_servers, cwd)
    except McpLoadError as exc:
        raise PlaybookError(label, exc.path, exc.message) from None
    for name in (name for tools in found.values() for name in tools):
        if name in module_tools:
            raise PlaybookError(
                label,
                "mcp_servers",
                f"tool {name!r} is defined by the tools module and an MCP server",
            )
    return found


def load_playbooks(
    path: str | Path, tools_module: str | Path | None = None
) -> dict[str, LoadedPlaybook]:
    """Load one file, or every playbook file in a folder, keyed by playbook id; ``tools_module``
    serves the files that name none."""
    path = Path(path)
    files = (
        sorted(p for p in path.iterdir() if p.suffix.lower() in PLAYBOOK_SUFFIXES)
        if path.is_dir()
        else [path]
    )
    loaded: dict[str, LoadedPlaybook] = {}
    for file in files:
        playbook = load_playbook(file, tools_module)
        if playbook.spec.id in loaded:
            message = f"duplicate playbook id {_shown(playbook.spec.id)}"
            raise PlaybookError(file.name, "id", message)
        loaded[playbook.spec.id] = playbook
    if not loaded:
        raise PlaybookError(str(path), "", "no playbook files (.yaml, .yml, .json, .md) found")
    return loaded


class _SafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reporting a value its constructors refuse (a 30 February, an
    integer of 5,000 digits) as a YAML error at that value's line, like a syntax error, and
    refusing to nest deeper than MAX_DEPTH (scanning deep flow nests takes quadratic time)."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self._depth >= MAX_DEPTH:
            mark = parent.start_mark if parent is not None else None
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"invalid value: {exc}", node.start_mark
            ) from None


def _parse(
    text: str, label: str, suffix: str, what: str = "a playbook"
) -> tuple[Any, LineMap | None]:
    """The file's data and, for YAML, the line of each field (JSON's parser keeps none)."""
    where: LineMap | None = None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlaybookError(
                label, "", f"JSON syntax error at line {exc.lineno}: {exc.msg}"
            ) from None
        except ValueError as exc:  # an integer of more digits than Python converts
            raise PlaybookError(label, "", f"invalid JSON value: {exc}") from None
        except RecursionError:
            raise PlaybookError(label, "", "nested too deeply") from None
    else:
        try:
            data, where = _load_yaml(text, label)
        except yaml.MarkedYAMLError as exc:
            line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
            problem = exc.problem or exc.context or "invalid YAML"
            raise PlaybookError(label, "", f"YAML syntax error at line {line}: {problem}") from None
        except yaml.reader.ReaderError as exc:  # a control character, before any parsing
            line = text.count("\n", 0, exc.position) + 1
            raise PlaybookError(
                label, "", f"YAML syntax error at line {line}: {exc.reason} #x{exc.character:04x}"
            ) from None
        except yaml.YAMLError as exc:
            raise PlaybookError(label, "", f"YAML error: {exc}") from None
        except RecursionError:
            raise PlaybookError(label, "", "nested too deeply") from None
    if not isinstance(data, dict):
        raise PlaybookError(label, "", f"{what} must be a mapping at the top level")
    return data, where


def _load_yaml(text: str, label: str) -> tuple[Any, LineMap]:
    """Parse with :class:`_SafeLoader`, recording the line of every field; raises yaml.YAMLError
    (or RecursionError)."""
    loader = _SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    where = LineMap(label, limit=MAX_VALUES)
    if node is not None:
        where.record(node)
    return data, where


def _check_size(data: Any, label: str) -> None:
    """Refuse a document nested deeper than MAX_DEPTH, holding more than MAX_VALUES values, or
    holding itself (a YAML alias inside its own anchor): validating it could take forever."""
    count = 0

    def fail(message: str) -> None:
        raise PlaybookError(label, "", message)

    def walk(value: Any, depth: int, inside: frozenset[int]) -> None:
        nonlocal count
        count += 1
        if count > MAX_VALUES:
            fail(f"more than {MAX_VALUES} values (YAML aliases repeating each other?)")
        if isinstance(value, dict):
            children: list[Any] = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            children = value
        else:
            return
        if depth >= MAX_DEPTH:
            fail(f"nested more than {MAX_DEPTH} levels deep")
        if id(value) in inside:
            fail("a YAML alias is used inside its own anchor")
        inside = inside | {id(value)}
        for child in children:
            walk(child, depth + 1, inside)

    walk(data, 0, frozenset())


def _validation_problems(label: str, exc: ValidationError) -> list[Problem]:
    """Every error of ``exc`` as a problem of the file ``label``, located by the field path
    (without the tags and labels pydantic puts in for a union's members). A smart union (not
    discriminated) counts as one problem: the errors of the member that got furthest into the
    value, or one message for all when none got past the union's own value. A required field
    missing beside an unknown key that looks like a misspelling of it is the unknown key only."""
    errors = [(*_schema_loc(error["loc"]), error) for error in exc.errors()]
    problems = []
    for parts, _, error in _without_misspelt(_one_member_each(errors)):
        if error["type"] == "missing" and parts and isinstance(parts[-1], str):
            parts = [*parts[:-1], to_snake(parts[-1])]  # pydantic names it by its camelCase alias
        if error["type"] == "union_tag_invalid":
            given = error.get("input")
            tag = given.get("type") if isinstance(given, dict) else None
            expected = error["ctx"]["expected_tags"]
            message = f"unknown condition type {_shown(tag)}; expected one of {expected}"
        elif error["type"] == "extra_forbidden":
            message = "unknown field"
        else:
            message = error["msg"]
        problems.append(Problem(label, _format_loc(parts), message))
    return problems


_Loc = list[int | str]
_Error = tuple[_Loc, tuple[int, str] | None, Any]
"""An error's location without union tags, where its outermost smart union is (the length of
the location up to it, and the member's label) and the pydantic error itself."""


def _one_member_each(errors: list[_Error]) -> list[_Error]:
    """``errors`` with those inside each smart union narrowed to one member's (see
    :func:`_validation_problems`), in the place of the union's first error."""
    order: list[_Error | _UnionAt] = []
    unions: dict[_UnionAt, dict[str, list[_Error]]] = {}
    for entry in errors:
        parts, union, _ = entry
        if union is None:
            order.append(entry)
            continue
        key = _UnionAt(parts[: union[0]])
        if key not in unions:
            unions[key] = {}
            order.append(key)
        unions[key].setdefault(union[1], []).append(entry)
    narrowed: list[_Error] = []
    for item in order:
        if isinstance(item, _UnionAt):
            narrowed.extend(_one_member(list(item), unions[item]))
        else:
            narrowed.append(item)
    return narrowed


class _UnionAt(tuple[int | str, ...]):
    """A smart union's place: the path to it."""

    __slots__ = ()


def _one_member(at: _Loc, members: dict[str, list[_Error]]) -> list[_Error]:
    depth = len(at)
    if all(len(parts) == depth for errors in members.values() for parts, _, _ in errors):
        messages = list(dict.fromkeys(e["msg"] for errors in members.values() for *_, e in errors))
        joined = messages[0] + "".join(f", or {_lowered(m)}" for m in messages[1:])
        return [(at, None, {"type": "union", "msg": joined})]
    return max(members.values(), key=lambda errors: max(len(parts) for parts, _, _ in errors))


def _lowered(message: str) -> str:
    """``Input should be ...`` as ``input should be ...``, an acronym left as it is."""
    return message[:1].lower() + message[1:] if message[1:2].islower() else message


def _without_misspelt(errors: list[_Error]) -> list[_Error]:
    """``errors`` without a missing field that an unknown key beside it misspells (the unknown
    key names the typo; each unknown key explains one missing field at most)."""
    unknown: dict[tuple[int | str, ...], list[str]] = {}
    for parts, _, error in errors:
        if error["type"] == "extra_forbidden" and parts and isinstance(parts[-1], str):
            unknown.setdefault(tuple(parts[:-1]), []).append(_snake(parts[-1]))
    kept = []
    for entry in errors:
        parts, _, error = entry
        beside = unknown.get(tuple(parts[:-1]), []) if error["type"] == "missing" else []
        if beside and isinstance(parts[-1], str):
            typo = difflib.get_close_matches(_snake(parts[-1]), beside, n=1)
            if typo:
                beside.remove(typo[0])
                continue
        kept.append(entry)
    return kept


def _snake(key: str) -> str:
    """``key`` in snake case; a key longer than any field's name as it is (to_snake takes
    quadratic time on a long run of capitals)."""
    return to_snake(key) if len(key) <= 64 else key


def _schema_loc(loc: tuple[int | str, ...]) -> tuple[_Loc, tuple[int, str] | None]:
    """A pydantic error location as the file's field path, found by following the playbook's
    schema: without a discriminated union member's tag (``condition.intent.intent`` is the
    ``intent`` field of an intent condition) nor a smart union member's label (``list[str]``).
    Also where the outermost smart union is: the path's length up to it and the label."""
    refs = _schema_refs()
    schema = _unwrapped(Playbook.__pydantic_core_schema__, refs)
    parts: _Loc = []
    union: tuple[int, str] | None = None
    for part in loc:
        kind = schema.get("type") if schema is not None else None
        if schema is None:
            parts.append(part)  # past what the schema tells: a key of the file
        elif kind == "tagged-union" and str(part) in (tags := _index(schema)):
            schema = _unwrapped(tags[str(part)], refs)  # the member's tag, not a key of the file
        elif kind == "union" and isinstance(part, str):  # the member's label
            if union is None:
                union = (len(parts), part)
            labelled = (choice for choice in schema["choices"] if isinstance(choice, tuple))
            schema = next((_unwrapped(c[0], refs) for c in labelled if c[1] == part), None)
        elif kind == "model-fields" and isinstance(part, str):
            parts.append(part)
            schema = _unwrapped(_index(schema).get(part), refs)
        elif kind in ("list", "set", "frozenset", "dict"):
            parts.append(part)
            schema = _unwrapped(
                schema.get("values_schema" if kind == "dict" else "items_schema"), refs
            )
        else:
            parts.append(part)
            schema = None
    return parts, union


_INDEXES: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
"""Each schema :func:`_index` was asked about (kept, so its id is not reused) and its index."""


def _index(schema: dict[str, Any]) -> dict[str, Any]:
    """A discriminated union's members by tag, or a model's field schemas by each key they are
    read from (the field's name and its validation aliases); made once for each schema."""
    known = _INDEXES.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    index: dict[str, Any] = {}
    if schema["type"] == "tagged-union":
        index = {str(tag): choice for tag, choice in schema["choices"].items()}
    else:
        for name, field_schema in schema["fields"].items():
            alias = field_schema.get("validation_alias")
            for choice in [name, *(alias if isinstance(alias, list) else [alias])]:
                first = choice[0] if isinstance(choice, list) and choice else choice
                if isinstance(first, str):
                    index.setdefault(first, field_schema["schema"])
    _INDEXES[id(schema)] = (schema, index)
    return index


_WRAPPERS = frozenset(
    {"default", "nullable", "function-before", "function-after", "function-wrap", "model"}
)


def _unwrapped(schema: Any, refs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The schema that validates a value's content, through defaults, nullables, validator
    functions, models and references; None when it is not known."""
    for _ in range(100):
        if not isinstance(schema, dict):
            return None
        kind = schema.get("type")
        if kind == "definition-ref":
            schema = refs.get(schema.get("schema_ref", ""))
        elif kind in _WRAPPERS or kind == "definitions":
            schema = schema.get("schema")
        else:
            return schema
    return None


@functools.cache
def _schema_refs() -> dict[str, Any]:
    """The playbook schema's definitions by reference."""
    refs: dict[str, Any] = {}
    stack: list[Any] = [Playbook.__pydantic_core_schema__]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("ref"), str) and "type" in node:
                refs.setdefault(node["ref"], node)
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return refs


def _format_loc(loc: _Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = part or "''"  # an empty key, named all the same
            out += f".{part}" if out else part
    return out


def _module_file(file: Path, label: str) -> None:
    """Refuse a ``tools_module`` that is not a file."""
    try:
        found = file.is_file()
    except OSError as exc:  # e.g. a name too long for the file system
        raise PlaybookError(
            label, "tools_module", f"cannot read {_shown(str(file))}: {exc.strerror}"
        ) from None
    if not found:
        raise PlaybookError(label, "tools_module", f"file not found: {file}")


def _import_module(file: Path, label: str) -> ModuleType:
    _module_file(file, label)
    name = f"vocable_tools_{abs(hash(file.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PlaybookError(label, "tools_module", f"not a Python module: {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic look the module up while importing
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise PlaybookError(
            label, "tools_module", f"importing {file.name} failed: {type(exc).__name__}: {exc}"
        ) from None
    return module


def _collect(module: ModuleType) -> tuple[dict[str, Tool], dict[str, Callable[..., Any]]]:
    tools: dict[str, Tool] = {}
    functions: dict[str, Callable[..., Any]] = {}
    for attr, value in vars(module).items():
        if attr.startswith("_") or not callable(value):
            continue
        found = tool_of(value)
        if found is not None:
            tools[found.name] = found
        elif inspect.isfunction(value) and value.__module__ == module.__name__:
            functions[attr] = value  # candidates for `custom` conditions
    return tools, functions
