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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_snake

from .errors import LineMap, PlaybookError
from .identity import BUILTIN_TOOLS, resolve_model
from .models import (
    CustomCondition,
    MaxTurnsCondition,
    NamedToolChoice,
    Playbook,
    TimeoutCondition,
    ToolCallCondition,
    Voice,
)
from .tools import Tool, tool_of

__all__ = ["LoadedPlaybook", "PlaybookError", "load_playbook", "load_playbooks"]

PLAYBOOK_SUFFIXES = (".yaml", ".yml", ".json", ".md")
MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings; a YAML alias counts its whole value again each time it
is used) a playbook file may hold: bounds the work validation does on an alias bomb."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings a playbook file may have."""
RESERVED_TOOL = "playbook_transition"
"""Offered by the engine itself when an llm_decision transition leaves the stage."""


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class LoadedPlaybook:
    """A validated playbook together with the tools and condition functions it refers to."""

    spec: Playbook
    tools: Mapping[str, Tool]
    functions: Mapping[str, Callable[..., Any]]
    source: Path | None = None

    @classmethod
    def from_spec(
        cls,
        spec: Playbook,
        tools: Mapping[str, Tool] | None = None,
        functions: Mapping[str, Callable[..., Any]] | None = None,
        source: Path | None = None,
    ) -> LoadedPlaybook:
        """Check cross-references and build; raises :class:`PlaybookError`."""
        loaded = cls(spec, dict(tools or {}), dict(functions or {}), source)
        _check_references(loaded, source.name if source else spec.id)
        return loaded


def load_playbook(path: str | Path) -> LoadedPlaybook:
    """Parse, validate and resolve one playbook file."""
    path = Path(path)
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
        try:
            return _resolve(data, path, label)
        except PlaybookError as exc:
            raise locate(lines, exc) from None
    data, where = _parse(text, label, path.suffix.lower())
    try:
        return _resolve(data, path, label)
    except PlaybookError as exc:
        raise (where.locate(exc) if where is not None else exc) from None


def _resolve(data: Any, path: Path, label: str) -> LoadedPlaybook:
    """Validate a parsed playbook file and load the tools it refers to."""
    _check_size(data, label)
    try:
        spec = Playbook.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(label, exc) from None
    tools: dict[str, Tool] = {}
    functions: dict[str, Callable[..., Any]] = {}
    if spec.tools_module:
        module = _import_module(path.parent / spec.tools_module, label)
        tools, functions = _collect(module)
    if spec.mcp_servers:
        tools = {**tools, **_mcp_tools(spec, path.parent, label, tools)}
    return LoadedPlaybook.from_spec(spec, tools, functions, path)


def _mcp_tools(
    spec: Playbook, cwd: Path, label: str, module_tools: Mapping[str, Tool]
) -> dict[str, Tool]:
    """The tools of the playbook's MCP servers (sessions opened now); see :mod:`playbooks.mcp`."""
    from .mcp import McpLoadError, mcp_tools

    try:
        found = mcp_tools(spec.mcp_servers, cwd)
    except McpLoadError as exc:
        raise PlaybookError(label, exc.path, exc.message) from None
    for name in found:
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


def _import_module(file: Path, label: str) -> ModuleType:
    try:
        found = file.is_file()
    except OSError as exc:  # e.g. a name too long for the file system
        raise PlaybookError(
            label, "tools_module", f"cannot read {_shown(str(file))}: {exc.strerror}"
        ) from None
    if not found:
        raise PlaybookError(label, "tools_module", f"file not found: {file}")
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


def _check_references(loaded: LoadedPlaybook, label: str) -> None:
    spec = loaded.spec

    def fail(path: str, message: str) -> None:
        raise PlaybookError(label, path, message)

    stage_ids: set[str] = set()
    for i, stage in enumerate(spec.stages):
        if stage.id in stage_ids:
            fail(f"stages[{i}].id", f"duplicate stage id {_shown(stage.id)}")
        stage_ids.add(stage.id)
    if spec.initial_stage not in stage_ids:
        fail("initial_stage", f"unknown stage {_shown(spec.initial_stage)}")

    if RESERVED_TOOL in loaded.tools:
        fail("tools_module", f"the tool name {RESERVED_TOOL!r} is reserved for stage transitions")
    for name in BUILTIN_TOOLS & set(loaded.tools):
        fail("tools_module", f"the tool name {name!r} is reserved for the built-in tool")
    for j, name in enumerate(spec.global_tools):
        if name not in loaded.tools and name not in BUILTIN_TOOLS:
            fail(f"global_tools[{j}]", _unknown_tool(name, loaded))
    for i, stage in enumerate(spec.stages):
        for j, name in enumerate(stage.tools):
            if name not in loaded.tools and name not in BUILTIN_TOOLS:
                fail(f"stages[{i}].tools[{j}]", _unknown_tool(name, loaded))
        choice = stage.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.tool_name not in (
            *stage.tools,
            *spec.global_tools,
        ):
            fail(
                f"stages[{i}].tool_choice.tool_name",
                f"tool {_shown(choice.tool_name)} is not offered in stage {_shown(stage.id)}",
            )

    _check_voices(loaded, fail)
    _check_delegation(loaded, fail)

    transition_ids: set[str] = set()
    for i, transition in enumerate(spec.transitions):
        where = f"transitions[{i}]"
        if transition.id in transition_ids:
            fail(f"{where}.id", f"duplicate transition id {_shown(transition.id)}")
        transition_ids.add(transition.id)
        if transition.from_stage != "*" and transition.from_stage not in stage_ids:
            fail(f"{where}.from", f"unknown stage {_shown(transition.from_stage)}")
        if transition.action.target_stage not in stage_ids:
            fail(
                f"{where}.action.target_stage",
                f"unknown stage {_shown(transition.action.target_stage)}",
            )
        condition = transition.condition
        sources = (
            spec.stages if transition.from_stage == "*" else [spec.stage(transition.from_stage)]
        )
        if isinstance(condition, ToolCallCondition) and condition.tool_name not in loaded.tools:
            fail(f"{where}.condition.tool_name", _unknown_tool(condition.tool_name, loaded))
        elif isinstance(condition, CustomCondition) and condition.function not in loaded.functions:
            fail(
                f"{where}.condition.function",
                f"unknown function {_shown(condition.function)} (define it in the tools module)",
            )
        elif (
            isinstance(condition, MaxTurnsCondition)
            and condition.count is None
            and any(stage.max_turns is None for stage in sources)
        ):
            fail(f"{where}.condition.count", "required when the stage sets no max_turns")
        elif (
            isinstance(condition, TimeoutCondition)
            and condition.duration_ms is None
            and any(stage.timeout_ms is None for stage in sources)
        ):
            fail(f"{where}.condition.duration_ms", "required when the stage sets no timeout_ms")


def _check_voices(loaded: LoadedPlaybook, fail: Callable[[str, str], None]) -> None:
    """Voice model files exist (relative to the playbook file); the start language is known."""
    spec = loaded.spec
    voices: list[tuple[str, Voice | None]] = [("voice", spec.voice)]
    voices += [(f"stages[{i}].voice", stage.voice) for i, stage in enumerate(spec.stages)]
    voices += [(f"languages.{code}.voice", lang.voice) for code, lang in spec.languages.items()]
    for where, voice in voices:
        if voice is None or voice.model is None:
            continue
        model = resolve_model(voice.model, loaded.source)
        config = model.with_name(model.name + ".json")
        try:
            missing = [str(p) for p in (model, config) if not p.is_file()]
        except OSError as exc:
            missing = [f"{model} ({exc.strerror})"]
        if missing:
            fail(f"{where}.model", f"Piper voice file not found: {', '.join(missing)}")
    if spec.languages and spec.language is not None and spec.language not in spec.languages:
        fail("language", f"unknown language {_shown(spec.language)} (not in languages)")


def _check_delegation(loaded: LoadedPlaybook, fail: Callable[[str, str], None]) -> None:
    """Workers are other stages; a delegating stage offers no tool named ``delegate``."""
    spec = loaded.spec
    ids = {stage.id for stage in spec.stages}
    for i, stage in enumerate(spec.stages):
        if stage.delegates is None:
            continue
        for j, worker in enumerate(stage.delegates.workers):
            if worker not in ids:
                fail(f"stages[{i}].delegates.workers[{j}]", f"unknown stage {_shown(worker)}")
            if worker == stage.id:
                fail(f"stages[{i}].delegates.workers[{j}]", "a stage cannot delegate to itself")
        if "delegate" in (*spec.global_tools, *stage.tools):
            fail(f"stages[{i}].delegates", "the tool name 'delegate' is reserved for delegation")


def _unknown_tool(name: str, loaded: LoadedPlaybook) -> str:
    known = ", ".join(sorted(loaded.tools)) or "none"
    return f"unknown tool {_shown(name)} (tools module defines: {known})"
