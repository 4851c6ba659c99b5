"""Playbooks as text for people: a listing of stages and transitions, and a Mermaid stage graph.

Both work on the compiled model, so a YAML, JSON or Markdown file gives the same output.
"""

from __future__ import annotations

import re

from .loader import LoadedPlaybook, offline_tool_names
from .models import Condition, Playbook, Stage, Transition

__all__ = ["condition_text", "mermaid", "outline"]


def condition_text(condition: Condition, stage: Stage | None = None) -> str:
    """A condition in a few words, e.g. ``tool_call cancel_order``; ``stage`` fills in the
    defaults a condition takes from its source stage."""
    match condition.type:
        case "keyword":
            return f"keyword in {condition.match_in}: {', '.join(condition.keywords)}"
        case "tool_call":
            return f"tool_call {condition.tool_name}"
        case "intent":
            return f"intent {condition.intent!r} (confidence {condition.confidence:g})"
        case "llm_decision":
            return "llm_decision with summary" if condition.require_summary else "llm_decision"
        case "max_turns":
            count = condition.count or (stage.max_turns if stage else None)
            return f"max_turns {count}" if count else "max_turns"
        case "timeout":
            duration_ms = condition.duration_ms or (stage.timeout_ms if stage else None)
            return f"timeout {duration_ms} ms" if duration_ms else "timeout"
        case "custom":
            return f"custom {condition.function}()"
    return str(condition.type)


def outline(playbook: LoadedPlaybook | Playbook) -> str:
    """The compiled playbook: its tools, then its stages (mode, tools, prompt size, greeting)
    each followed by the transitions leaving it; ``from: "*"`` transitions last. A
    :class:`Playbook` not loaded lists the tools only when the file names them all."""
    if isinstance(playbook, LoadedPlaybook):
        spec, tools = playbook.spec, ", ".join(sorted(playbook.tools)) or "none"
    else:
        spec, names = playbook, offline_tool_names(playbook)
        if names is None:
            tools = _not_loaded(spec)
        else:
            tools = ", ".join(sorted(names.tools())) or "none"
            if spec.mcp_servers:
                tools += " (as the file lists them; --connect asks the MCP servers)"
    lines = [f"playbook {spec.id}: {spec.name}"]
    if spec.version:
        lines.append(f"version: {spec.version}")
    lines += [f"initial stage: {spec.initial_stage}", f"tools: {tools}"]
    if spec.global_tools:
        lines.append(f"global tools: {', '.join(spec.global_tool_names)}")
    for server in spec.mcp_servers:
        where = server.url or " ".join([server.command or "", *server.args])
        lines.append(f"MCP server {server.name}: {where}")
    if spec.languages:
        lines.append(f"languages: {', '.join(spec.languages)}")
    for stage in spec.stages:
        lines += ["", f"stage {stage.id}: {stage.name} [{stage.mode}]"]
        if stage.tools:
            lines.append(f"  tools: {', '.join(stage.tool_names)}")
        prompt_lines = len(stage.system_prompt.splitlines())
        lines.append(f"  prompt: {prompt_lines} line{'s' if prompt_lines != 1 else ''}")
        lines += _voice_lines(stage)
        own = [t for t in spec.transitions if t.from_stage == stage.id]
        lines += [_transition_line(t, stage) for t in _sorted(own)]
        if stage.mode == "single-shot":
            idle = [t.id for t in own if t.condition.type in ("llm_decision", "tool_call")]
            if stage.tools or idle:
                lines.append(
                    "  note: single-shot offers no tools"
                    + (f"; never fires: {', '.join(idle)}" if idle else "")
                )
    anywhere = [t for t in spec.transitions if t.from_stage == "*"]
    if anywhere:
        lines += ["", "from any stage:"]
        lines += [_transition_line(t, None) for t in _sorted(anywhere)]
    return "\n".join(lines)


def mermaid(spec: Playbook) -> str:
    """The stage graph as a Mermaid ``stateDiagram-v2``: one arrow per transition, labelled by
    its condition; a ``from: "*"`` transition is drawn from every other stage."""
    ids = {stage.id: _node_id(stage.id, i) for i, stage in enumerate(spec.stages)}
    lines = ["stateDiagram-v2"]
    for stage in spec.stages:
        lines.append(f'    state "{_label(stage.name)}" as {ids[stage.id]}')
    lines.append(f"    [*] --> {ids[spec.initial_stage]}")
    for transition in _sorted(spec.transitions):
        target = transition.action.target_stage
        sources = (
            [s for s in spec.stages if s.id != target]
            if transition.from_stage == "*"
            else [spec.stage(transition.from_stage)]
        )
        for source in sources:
            label = _label(condition_text(transition.condition, source))
            lines.append(f"    {ids[source.id]} --> {ids[target]}: {label}")
    for stage in spec.stages:  # delegation: an arrow to each worker stage
        if stage.delegates is not None:
            for worker in stage.delegates.workers:
                lines.append(f"    {ids[stage.id]} --> {ids[worker]}: delegates")
    return "\n".join(lines)


def _not_loaded(spec: Playbook) -> str:
    """The ``tools:`` line of a playbook whose tool names only running its sources tells."""
    sources = [f"imports {spec.tools_module}"] if spec.tools_module else []
    sources += ["starts the MCP servers"] if spec.mcp_servers else []
    return f"not loaded (--connect {' and '.join(sources)})"


def _voice_lines(stage: Stage) -> list[str]:
    """Who speaks in ``stage``: persona, voice, greeting, and the workers it delegates to."""
    lines = []
    if stage.persona is not None:
        lines.append(f"  persona: {stage.persona.role}")
    if stage.voice is not None:
        settings = stage.voice.model_dump(exclude_none=True)
        lines.append("  voice: " + ", ".join(f"{k} {v}" for k, v in settings.items()))
    if stage.greeting:
        lines.append(f"  greeting: {stage.greeting}")
    if stage.delegates is not None:
        workers = ", ".join(stage.delegates.workers)
        lines.append(f"  delegates ({stage.delegates.mode}): {workers}")
    if stage.transfer is not None:
        lines.append(f"  transfers ({stage.transfer.mode}) to {stage.transfer.to}")
    return lines


def _sorted(transitions: list[Transition]) -> list[Transition]:
    """In evaluation order: descending priority, then file order."""
    return sorted(transitions, key=lambda t: -t.priority)


def _transition_line(transition: Transition, stage: Stage | None) -> str:
    priority = f" priority {transition.priority}" if transition.priority else ""
    return (
        f"  -> {transition.action.target_stage} when {condition_text(transition.condition, stage)}"
        f"  [{transition.id}{priority}]"
    )


def _node_id(stage_id: str, index: int) -> str:
    """The stage id when Mermaid takes it as a state id, else ``s<index>``."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stage_id) and stage_id not in ("end", "state"):
        return stage_id
    return f"s{index}"


def _label(text: str, limit: int = 80) -> str:
    """Text Mermaid shows as is: no quotes, colons, semicolons or line breaks."""
    text = re.sub(r"[\":;#{}\[\]<>\s]+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
