"""Loading playbook files (YAML, JSON, Markdown) and their tools module, one clear error each.

Every failure raises :class:`PlaybookError`, whose message names the file, the line (YAML and
Markdown files) and the field path, e.g.
``support.yaml:68: transitions[2].action.target_stage: unknown stage 'billing'``.
"""

from __future__ import annotations

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

from .checks import RESERVED_TOOL, ToolNames, check_references, expand_server_tools
from .errors import LineMap, PlaybookError
from .errors import shown as _shown
from .models import Playbook
from .tools import Tool, tool_of

__all__ = [
    "RESERVED_TOOL",
    "LoadedPlaybook",
    "PlaybookError",
    "check_playbook",
    "load_playbook",
    "load_playbooks",
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
        check_references(spec, source, source.name if source else spec.id, names)
        expanded = expand_server_tools(spec, servers)
        return cls(expanded, dict(tools or {}), dict(functions or {}), source, servers)


def load_playbook(path: str | Path) -> LoadedPlaybook:
    """Parse, validate and resolve one playbook file: its tools module is imported and its MCP
    servers are started (see :func:`check_playbook` for a check that runs nothing)."""
    path = Path(path)
    data, locate = _read(path)
    try:
        return _resolve(data, path, path.name)
    except PlaybookError as exc:
        raise locate(exc) from None


def check_playbook(path: str | Path) -> Playbook:
    """Parse and validate one playbook file without running anything: the tools module is not
    imported (only found) and no MCP server is started, so tool and function names are checked
    only when the file itself says them all: no ``tools_module``, and every MCP server lists its
    ``tools``. Raises :class:`PlaybookError` (with the line) like :func:`load_playbook`."""
    path = Path(path)
    label = path.name
    data, locate = _read(path)
    try:
        spec = _validate(data, label)
        if spec.tools_module:
            _module_file(path.parent / spec.tools_module, label)
        check_references(spec, path, label, offline_tool_names(spec))
    except PlaybookError as exc:
        raise locate(exc) from None
    return spec


def offline_tool_names(spec: Playbook) -> ToolNames | None:
    """The tool names ``spec`` can refer to, as far as the file alone tells; None when a tools
    module or an MCP server taking ``all`` its tools adds names only known once they run."""
    if spec.tools_module or any(server.tools == "all" for server in spec.mcp_servers):
        return None
    return ToolNames(servers={s.name: tuple(s.tools) for s in spec.mcp_servers if s.tools != "all"})


def _read(path: Path) -> tuple[Any, Locate]:
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
    data, where = _parse(text, label, path.suffix.lower())
    return data, where.locate if where is not None else lambda exc: exc


def _validate(data: Any, label: str) -> Playbook:
    _check_size(data, label)
    try:
        return Playbook.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(label, exc) from None


def _resolve(data: Any, path: Path, label: str) -> LoadedPlaybook:
    """Validate a parsed playbook file and load the tools it refers to."""
    spec = _validate(data, label)
    tools: dict[str, Tool] = {}
    functions: dict[str, Callable[..., Any]] = {}
    if spec.tools_module:
        module = _import_module(path.parent / spec.tools_module, label)
        tools, functions = _collect(module)
    servers: dict[str, tuple[str, ...]] = {}
    if spec.mcp_servers:
        by_server = _mcp_tools(spec, path.parent, label, tools)
        servers = {name: tuple(found) for name, found in by_server.items()}
        for found in by_server.values():
            tools.update(found)
    return LoadedPlaybook.from_spec(spec, tools, functions, path, servers)


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


def load_playbooks(path: str | Path) -> dict[str, LoadedPlaybook]:
    """Load one file, or every playbook file in a folder, keyed by playbook id."""
    path = Path(path)
    files = (
        sorted(p for p in path.iterdir() if p.suffix.lower() in PLAYBOOK_SUFFIXES)
        if path.is_dir()
        else [path]
    )
    loaded: dict[str, LoadedPlaybook] = {}
    for file in files:
        playbook = load_playbook(file)
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


def _parse(text: str, label: str, suffix: str) -> tuple[Any, LineMap | None]:
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
        raise PlaybookError(label, "", "a playbook must be a mapping at the top level")
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


def _validation_error(label: str, exc: ValidationError) -> PlaybookError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "missing":
        # a misspelt key is both missing and unknown: the unknown key names the typo
        first = next(
            (
                e
                for e in errors
                if e["type"] == "extra_forbidden" and e["loc"][:-1] == first["loc"][:-1]
            ),
            first,
        )
    loc = list(first["loc"])
    if first["type"] == "missing" and loc and isinstance(loc[-1], str):
        loc[-1] = to_snake(loc[-1])  # pydantic names a missing field by its camelCase alias
    if first["type"] == "union_tag_invalid":
        tag = first.get("input", {}).get("type") if isinstance(first.get("input"), dict) else None
        expected = first["ctx"]["expected_tags"]
        message = f"unknown condition type {_shown(tag)}; expected one of {expected}"
    elif first["type"] == "extra_forbidden":
        message = "unknown field"
    else:
        message = first["msg"]
    others = len(errors) - 1
    more = f" (and {others} more problem{'s' if others > 1 else ''})" if others else ""
    return PlaybookError(label, _format_loc(loc), message + more)


# Fields holding a union: pydantic puts the member's tag in the location, after the field name.
_UNION_FIELDS = frozenset({"condition", "tool_choice", "toolChoice"})


def _format_loc(loc: list[int | str]) -> str:
    out = ""
    for index, part in enumerate(loc):
        if index and loc[index - 1] in _UNION_FIELDS and isinstance(part, str):
            continue  # the union member's tag, not a key of the file
        if isinstance(part, int):
            out += f"[{part}]"
        else:
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
