"""Cross-references of a validated playbook: what pydantic cannot check field by field.

:func:`check_references` always checks the structure (stage ids, transitions, delegation workers,
voice files, the start language, ``mcp:<server>`` entries naming a listed server); tool and
function names only when it is given the names the tools module and MCP servers provide, which
takes importing the one and starting the others. Every problem found is listed, with its field
path, in one :class:`PlaybookError`; the loader adds the lines. :func:`unvalidated_references`
checks the stage ids a file names even when validation refused it, so that those problems are
listed with pydantic's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic.alias_generators import to_camel

from .errors import PlaybookError, Problem, shown
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
from .transfer import TRANSFER_TOOL

__all__ = [
    "DELEGATE_TOOL",
    "MCP_PREFIX",
    "RESERVED_TOOL",
    "ToolNames",
    "check_questions",
    "check_references",
    "expand",
    "expand_server_tools",
    "server_of",
    "unknown_tool",
    "unvalidated_references",
]

RESERVED_TOOL = "playbook_transition"
"""Offered by the engine itself when an llm_decision transition leaves the stage."""
DELEGATE_TOOL = "delegate"
"""The built-in tool of a stage with ``delegates`` (see :mod:`playbooks.delegation`)."""
MCP_PREFIX = "mcp:"
"""A ``tools`` / ``global_tools`` entry ``mcp:<server>`` takes every tool that MCP server gives."""

Fail = Callable[[str, str], None]


@dataclass(frozen=True)
class ToolNames:
    """The names a playbook may refer to: ``module`` tools and ``functions`` (candidates for
    ``custom`` conditions and stage hooks) of the tools module, and each MCP server's tools by
    server name (after its ``tools`` filter). ``functions`` None: not known (a file that names no
    tools module may be given one when it runs, ``--tools-module``)."""

    module: frozenset[str] = frozenset()
    functions: frozenset[str] | None = frozenset()
    servers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def tools(self) -> set[str]:
        """Every tool name, of the module and the servers."""
        return set(self.module).union(*self.servers.values())


def server_of(entry: str) -> str | None:
    """The server an ``mcp:<server>`` entry names; None for a plain tool name."""
    return entry[len(MCP_PREFIX) :] if entry.startswith(MCP_PREFIX) else None


def expand(names: Sequence[str], servers: Mapping[str, Sequence[str]]) -> list[str]:
    """``names`` with each ``mcp:<server>`` entry replaced by that server's tools, each name once
    (first place wins)."""
    out: list[str] = []
    for name in names:
        server = server_of(name)
        out.extend(servers.get(server, ()) if server is not None else [name])
    return list(dict.fromkeys(out))


def expand_server_tools(spec: Playbook, servers: Mapping[str, Sequence[str]]) -> Playbook:
    """``spec`` with the ``mcp:<server>`` entries of ``global_tools`` and every stage's ``tools``
    replaced by the server's tool names (see :func:`expand`), and inline definitions by their
    names; ``spec`` itself if it has neither."""
    lists = [spec.global_tools, *(stage.tools for stage in spec.stages)]
    if all(isinstance(e, str) and server_of(e) is None for entries in lists for e in entries):
        return spec
    stages = [
        stage.model_copy(update={"tools": expand(stage.tool_names, servers)})
        for stage in spec.stages
    ]
    return spec.model_copy(
        update={"global_tools": expand(spec.global_tool_names, servers), "stages": stages}
    )


def check_references(
    spec: Playbook, source: Path | None, label: str, names: ToolNames | None
) -> None:
    """Raise :class:`PlaybookError` listing every broken reference of ``spec`` (read from
    ``source``, named ``label`` in errors). ``names`` None: tool and function names are not
    checked (they are not known yet)."""
    problems: list[Problem] = []

    def fail(path: str, message: str) -> None:
        problems.append(Problem(label, path, message))

    stage_ids: set[str] = set()
    for i, stage in enumerate(spec.stages):
        if stage.id in stage_ids:
            fail(f"stages[{i}].id", f"duplicate stage id {shown(stage.id)}")
        stage_ids.add(stage.id)
    if spec.initial_stage not in stage_ids:
        fail("initial_stage", f"unknown stage {shown(spec.initial_stage)}")
    for i, server in enumerate(spec.mcp_servers):
        if any(other.name == server.name for other in spec.mcp_servers[:i]):
            fail(f"mcp_servers[{i}].name", f"duplicate MCP server name {server.name!r}")
    if names is not None:
        _check_reserved(names, fail)
    _check_tool_lists(spec, names, fail)
    _check_voices(spec, source, fail)
    _check_delegation(spec, names, fail)
    _check_transitions(spec, stage_ids, names, fail)
    _check_hooks(spec, names, fail)
    if problems:
        raise PlaybookError.of(problems)


def check_questions(spec: Playbook, parameters: Mapping[str, Any], label: str) -> None:
    """Raise :class:`PlaybookError` when a stage's ``questions`` names no argument of the
    stage's own tools (``parameters``: each tool's JSON schema of arguments, by tool name; the
    stages' ``mcp:`` entries already expanded). Built-in tools take no details to ask for."""
    problems: list[Problem] = []
    for i, stage in enumerate(spec.stages):
        arguments = {
            argument
            for name in stage.tool_names
            for argument in (parameters.get(name) or {}).get("properties", {})
        }
        for key in stage.questions:
            if key not in arguments:
                taken = ", ".join(sorted(arguments)) or "none"
                message = f"no tool of this stage takes {shown(key)} (their arguments: {taken})"
                problems.append(Problem(label, f"stages[{i}].questions.{key}", message))
    if problems:
        raise PlaybookError.of(problems)


def _check_reserved(names: ToolNames, fail: Fail) -> None:
    for name in sorted(({RESERVED_TOOL, TRANSFER_TOOL} | BUILTIN_TOOLS) & names.tools()):
        where = "tools_module" if name in names.module else "mcp_servers"
        if name == RESERVED_TOOL:
            fail(where, f"the tool name {name!r} is reserved for stage transitions")
        elif name == TRANSFER_TOOL:
            fail(where, f"the tool name {name!r} is reserved for call transfers")
        else:
            fail(where, f"the tool name {name!r} is reserved for the built-in tool")


def _check_tool_lists(spec: Playbook, names: ToolNames | None, fail: Fail) -> None:
    """Each entry of ``global_tools`` and the stages' ``tools`` names a tool (when ``names`` are
    known) or a listed MCP server; a named ``tool_choice`` is offered in its stage."""
    servers = {server.name for server in spec.mcp_servers}
    known = names.tools() if names is not None else set()
    lists = [("global_tools", spec.global_tool_names)]
    lists += [(f"stages[{i}].tools", stage.tool_names) for i, stage in enumerate(spec.stages)]
    for where, entries in lists:
        for j, name in enumerate(entries):
            server = server_of(name)
            if name == TRANSFER_TOOL:
                message = "transfer_call is built in: give the stage or the playbook a transfer"
                fail(f"{where}[{j}]", message + " ({to: ..., say: ...}) instead of listing it")
            elif server is not None:
                if server not in servers:
                    declared = ", ".join(sorted(servers)) or "none"
                    message = f"no MCP server {shown(server)} (mcp_servers: {declared})"
                    fail(f"{where}[{j}]", message)
                elif names is not None and server not in names.servers:
                    fail(f"{where}[{j}]", f"the tools of MCP server {shown(server)} are not loaded")
            elif names is not None and name not in known and name not in BUILTIN_TOOLS:
                fail(f"{where}[{j}]", unknown_tool(name, spec, names))
    for i, stage in enumerate(spec.stages):
        choice = stage.tool_choice
        if not isinstance(choice, NamedToolChoice):
            continue
        listed = [*stage.tool_names, *spec.global_tool_names]
        if names is not None:
            offered = expand(listed, names.servers)
        elif any(server_of(name) is not None for name in listed):
            continue  # a server's tools are known once it runs
        else:
            offered = listed
        if choice.tool_name not in offered:
            fail(
                f"stages[{i}].tool_choice.tool_name",
                f"tool {shown(choice.tool_name)} is not offered in stage {shown(stage.id)}",
            )


def _check_hooks(spec: Playbook, names: ToolNames | None, fail: Fail) -> None:
    """A stage's ``on_enter`` / ``on_exit`` names a function of the tools module."""
    if names is None or names.functions is None:
        return
    for i, stage in enumerate(spec.stages):
        for key, function in (("on_enter", stage.on_enter), ("on_exit", stage.on_exit)):
            if function is not None and function not in names.functions:
                message = f"unknown function {shown(function)} (define it in the tools module)"
                fail(f"stages[{i}].{key}", message)


def _check_transitions(
    spec: Playbook, stage_ids: set[str], names: ToolNames | None, fail: Fail
) -> None:
    transition_ids: set[str] = set()
    for i, transition in enumerate(spec.transitions):
        where = f"transitions[{i}]"
        if transition.id in transition_ids:
            fail(f"{where}.id", f"duplicate transition id {shown(transition.id)}")
        transition_ids.add(transition.id)
        if transition.from_stage != "*" and transition.from_stage not in stage_ids:
            fail(f"{where}.from", f"unknown stage {shown(transition.from_stage)}")
        if transition.action.target_stage not in stage_ids:
            fail(
                f"{where}.action.target_stage",
                f"unknown stage {shown(transition.action.target_stage)}",
            )
        condition = transition.condition
        if transition.from_stage == "*":
            sources = spec.stages
        else:  # none when the stage is unknown (a problem found above)
            sources = [stage for stage in spec.stages if stage.id == transition.from_stage][:1]
        if isinstance(condition, ToolCallCondition):
            if names is not None and condition.tool_name not in names.tools():
                fail(f"{where}.condition.tool_name", unknown_tool(condition.tool_name, spec, names))
        elif isinstance(condition, CustomCondition):
            known = names.functions if names is not None else None
            if known is not None and condition.function not in known:
                fail(
                    f"{where}.condition.function",
                    f"unknown function {shown(condition.function)} (define it in the tools module)",
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


def _check_voices(spec: Playbook, source: Path | None, fail: Fail) -> None:
    """Voice model files exist (relative to the playbook file); the start language is known."""
    voices: list[tuple[str, Voice | None]] = [("voice", spec.voice)]
    voices += [(f"stages[{i}].voice", stage.voice) for i, stage in enumerate(spec.stages)]
    voices += [(f"languages.{code}.voice", lang.voice) for code, lang in spec.languages.items()]
    for where, voice in voices:
        if voice is None or voice.model is None:
            continue
        model = resolve_model(voice.model, source)
        config = model.with_name(model.name + ".json")
        try:
            missing = [str(p) for p in (model, config) if not p.is_file()]
        except OSError as exc:
            missing = [f"{model} ({exc.strerror})"]
        if missing:
            fail(f"{where}.model", f"Piper voice file not found: {', '.join(missing)}")
    if spec.languages and spec.language is not None and spec.language not in spec.languages:
        fail("language", f"unknown language {shown(spec.language)} (not in languages)")


def _check_delegation(spec: Playbook, names: ToolNames | None, fail: Fail) -> None:
    """Workers are other stages; a delegating stage offers no tool named ``delegate``, neither
    by name nor through an ``mcp:<server>`` entry (when the servers' tools are known)."""
    servers = names.servers if names is not None else {}
    ids = {stage.id for stage in spec.stages}
    for i, stage in enumerate(spec.stages):
        if stage.delegates is None:
            continue
        for j, worker in enumerate(stage.delegates.workers):
            if worker not in ids:
                fail(f"stages[{i}].delegates.workers[{j}]", f"unknown stage {shown(worker)}")
            if worker == stage.id:
                fail(f"stages[{i}].delegates.workers[{j}]", "a stage cannot delegate to itself")
        if DELEGATE_TOOL in expand([*spec.global_tool_names, *stage.tool_names], servers):
            fail(f"stages[{i}].delegates", "the tool name 'delegate' is reserved for delegation")


def unknown_tool(name: str, spec: Playbook, names: ToolNames) -> str:
    """The message for a tool name no source gives, naming what each source does give."""
    module = ", ".join(sorted(names.module)) or "none"
    parts = [f"tools module defines: {module}"] if spec.tools_module or not names.servers else []
    filtered = {server.name for server in spec.mcp_servers if server.tools != "all"}
    for server, tools in names.servers.items():
        how = " (by its tools list)" if server in filtered else ""
        parts.append(f"MCP server {server!r} gives{how}: {', '.join(tools) or 'none'}")
    return f"unknown tool {shown(name)} ({'; '.join(parts)})"


def unvalidated_references(data: Any, label: str) -> list[Problem]:
    """The stage references :func:`check_references` would refuse in ``data``, a playbook file's
    data that validation refused: duplicate stage ids, and an ``initial_stage``, a transition's
    ``from`` and ``action.target_stage`` or a delegation worker naming no stage (or its own).
    Only strings are checked (pydantic names the rest), and nothing when some stage has no id:
    the ids are not known."""
    stages = _key(data, "stages")
    if not isinstance(stages, list) or not all(isinstance(_key(s, "id"), str) for s in stages):
        return []
    problems: list[Problem] = []
    ids: set[str] = set()
    for i, stage in enumerate(stages):
        if stage["id"] in ids:
            message = f"duplicate stage id {shown(stage['id'])}"
            problems.append(Problem(label, f"stages[{i}].id", message))
        ids.add(stage["id"])
    for path, named, own in _stage_names(data, stages):
        if not isinstance(named, str):
            continue
        if named not in ids:
            problems.append(Problem(label, path, f"unknown stage {shown(named)}"))
        elif named == own:
            problems.append(Problem(label, path, "a stage cannot delegate to itself"))
    return problems


def _stage_names(data: Any, stages: list[Any]) -> Iterator[tuple[str, Any, str | None]]:
    """Where ``data`` names a stage (not yet checked to be a string), the value, and the id of
    the stage it must differ from (a delegation's own)."""
    yield "initial_stage", _key(data, "initial_stage"), None
    transitions = _key(data, "transitions")
    for i, transition in enumerate(transitions if isinstance(transitions, list) else []):
        source = _key(transition, "from_stage", "from")
        if source != "*":
            yield f"transitions[{i}].from", source, None
        target = _key(_key(transition, "action"), "target_stage")
        yield f"transitions[{i}].action.target_stage", target, None
    for i, stage in enumerate(stages):
        workers = _key(_key(stage, "delegates"), "workers")
        for j, worker in enumerate(workers if isinstance(workers, list) else []):
            yield f"stages[{i}].delegates.workers[{j}]", worker, stage["id"]


def _key(data: Any, name: str, alias: str | None = None) -> Any:
    """The value of field ``name`` in unvalidated ``data``, given by its alias (``alias``, else
    the camelCase name) or its name; None when absent or ``data`` is not a mapping."""
    if not isinstance(data, dict):
        return None
    alias = alias or to_camel(name)
    return data[alias] if alias in data else data.get(name)
