"""Markdown playbooks: a ``.md`` file compiled to the same data as a YAML playbook.

``#`` names the playbook (its text is the global prompt); each ``##`` is a stage (its text is
the stage prompt; ``{#id}`` after the title sets the id, else the title's slug); under a stage,
``### Steps`` (a numbered list the prompt carries), ``### Triggers`` (``- condition → stage``,
each an ``intent`` transition), ``### Tools`` (``- tool_name``, or ``- mcp:server`` for every
tool of an MCP server) and ``### Transfer`` (``- to: sip:desk@pbx``, ``- say: ...``, ``- mode:
warm``, ``- when: ...``, ``- ring_timeout_ms: ...``: the stage's ``transfer``). An optional
YAML front matter between ``---`` lines holds everything else: playbook fields, ``transitions``
in the YAML form and per-stage options under ``stages: {stage_id: {...}}``. See
docs/playbooks-markdown.md.

:func:`compile_markdown` returns the data with a :class:`~playbooks.errors.LineMap`; the loader
validates the data like a YAML file's and passes any :class:`PlaybookError` through
:func:`locate`, so every problem reads ``file.md:LINE: message``. A malformed document lists
every problem of its body (a bad heading, section line or trigger...) in one error, except for
those after which the rest cannot be read: a front matter's YAML error, text or a stage before
the ``#`` heading. Problems of the body's structure come before those of the compiled playbook:
the playbook is checked once its body reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import LineMap, PlaybookError, Problem
from .errors import shown as _shown
from .loader import MAX_VALUES, _SafeLoader

__all__ = ["compile_markdown", "locate", "slug"]

_LINE_END = re.compile(r"\r\n|\r|\n")
"""CommonMark's line ends (``str.splitlines`` also splits at U+0085, U+2028, form feeds and more,
so error lines would not match an editor's)."""
# No pattern may backtrack over a run of spaces: on a line of 100,000 that takes hours.
_HEADING = re.compile(r"(#{1,3})[ \t]+(.*)")
_EXPLICIT_ID = re.compile(r"\{#([^{}\s]+)\}$")
_FENCE = re.compile(r"^[ \t]{0,3}(```|~~~)")
_STEP = re.compile(r"^\d{1,3}[.)][ \t]+\S")
_ARROW = re.compile(r"→|->|=>")
_TOOL = re.compile(r"^`?(mcp:[\w.-]+|[A-Za-z_][\w.-]*)`?(?:[ \t]*(?:[:—–]|[ \t]-[ \t]).*)?$")
_SECTIONS = ("steps", "triggers", "tools", "transfer")
_TRANSFER_KEYS = {
    "to": "to",
    "say": "say",
    "mode": "mode",
    "when": "description",
    "ring_timeout_ms": "ring_timeout_ms",
}
"""``### Transfer`` bullets (``- to: sip:desk@pbx``) and the ``transfer`` fields they set."""
_FROM_BODY = {
    "name": "the # heading",
    "global_system_prompt": "the text under the # heading",
    "globalSystemPrompt": "the text under the # heading",
}
_STAGE_FROM_BODY = {
    "id": "the ## heading ({#id})",
    "name": "the ## heading",
    "system_prompt": "the stage's text and its ### Steps",
    "systemPrompt": "the stage's text and its ### Steps",
    "tools": "the stage's ### Tools",
}
STEPS_INTRO = "Follow these steps:"
"""The line between a stage's text and its numbered steps in the stage prompt."""


def slug(title: str) -> str:
    """A stage or playbook id from a title: lowercase words joined by ``_``."""
    return re.sub(r"\W+", "_", title.lower()).strip("_")


@dataclass
class _Stage:
    title: str
    id: str
    line: int
    text: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    triggers: list[tuple[str, str, int]] = field(default_factory=list)
    tools: list[tuple[str, int]] = field(default_factory=list)
    transfer: dict[str, str] = field(default_factory=dict)
    sections: dict[str, int] = field(default_factory=dict)


@dataclass
class _Document:
    label: str
    name: str | None = None
    name_line: int = 0
    text: list[str] = field(default_factory=list)
    stages: list[_Stage] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)
    """The line of each stage id."""
    problems: list[Problem] = field(default_factory=list)

    def problem(self, line: int, message: str) -> None:
        """Note a problem at ``line``; the document is refused once read."""
        self.problems.append(Problem(self.label, "", message, line))

    def stop(self, line: int, message: str) -> PlaybookError:
        """The error to raise at a problem after which the rest cannot be read."""
        return PlaybookError.of([*self.problems, Problem(self.label, "", message, line)])

    def check(self) -> None:
        """Raise the problems noted, if any."""
        if self.problems:
            raise PlaybookError.of(self.problems)


def compile_markdown(text: str, label: str) -> tuple[dict[str, Any], LineMap]:
    """The playbook data of a Markdown file (not yet validated) and where its fields came from.
    Raises :class:`PlaybookError` (``label:LINE: message``) for a malformed document."""
    lines = _LINE_END.split(text)
    if lines[-1] == "":  # the last line's end, or an empty file
        lines.pop()
    front, body_start, where = _front_matter(lines, label)
    doc = _parse_body(lines, body_start, label)
    doc.check()
    if doc.name is None:
        raise _error(label, max(body_start, 1), "no '# Playbook name' heading")
    if not doc.stages:
        raise _error(label, doc.name_line, "no '## Stage' heading: a playbook needs a stage")
    data = _assemble(doc, front, where)
    doc.check()
    return data, where


def _front_matter(lines: list[str], label: str) -> tuple[dict[str, Any], int, LineMap]:
    """The front matter's mapping, the index of the first body line, and its key lines."""
    where = LineMap(label, limit=MAX_VALUES)
    if not lines or lines[0].rstrip() != "---":
        return {}, 0, where
    end = next((i for i in range(1, len(lines)) if lines[i].rstrip() in ("---", "...")), None)
    if end is None:
        raise _error(label, 1, "front matter opened with '---' is never closed")
    source = "\n".join(lines[1:end])
    try:
        loader = _SafeLoader(source)
    except yaml.reader.ReaderError as exc:  # a control character, before any parsing
        line = source.count("\n", 0, exc.position) + 2
        raise _error(label, line, f"front matter: {exc.reason} #x{exc.character:04x}") from None
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as exc:  # lines counted at \n only, as in the body
        line = source.count("\n", 0, exc.problem_mark.index) + 2 if exc.problem_mark else 1
        raise _error(label, line, f"front matter: {exc.problem or exc.context}") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise _error(label, 1, f"front matter: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise _error(label, 2, "front matter must be a YAML mapping")
    if node is not None:
        where.record(node, offset=2, source=source)
    return data, end + 1, where


def _parse_body(lines: list[str], start: int, label: str) -> _Document:
    doc = _Document(label)
    stage: _Stage | None = None
    section: str | None = None
    fenced = False
    for index in range(start, len(lines)):
        number, raw = index + 1, lines[index]
        heading = None if fenced else _heading(raw)
        if _FENCE.match(raw):
            fenced = not fenced
        if heading is not None:
            level, title = heading
            if level == 1:
                if doc.name is not None:
                    doc.problem(number, "a second '#' heading: one playbook per file")
                else:
                    doc.name, doc.name_line = title, number
            elif level == 2:
                if doc.name is None:
                    raise doc.stop(number, "a stage before the '# Playbook name' heading")
                stage, section = _new_stage(doc, title, number), None
                doc.stages.append(stage)
            elif stage is None:
                doc.problem(number, f"'### {title}' outside a '##' stage")
            elif title.lower() not in _SECTIONS:
                message = (
                    f"unknown section {_shown(title)}; expected Steps, Triggers, Tools or Transfer"
                )
                doc.problem(number, message)
                section = None  # its lines are the stage's text
            else:
                section = title.lower()
                if section in stage.sections:
                    first = stage.sections[section]
                    doc.problem(number, f"a second '### {title}' (first at line {first})")
                else:
                    stage.sections[section] = number
            continue
        if doc.name is None:
            if raw.strip():
                raise doc.stop(number, "text before the '# Playbook name' heading")
        elif stage is None:
            doc.text.append(raw)
        elif section is None or fenced:
            (stage.steps if section == "steps" else stage.text).append(raw)
        elif raw.strip():
            _section_line(doc, stage, section, raw, number)
    if fenced:
        doc.problem(len(lines), "a code block is never closed")
    return doc


def _heading(raw: str) -> tuple[int, str] | None:
    """The level and title of a ``#``, ``##`` or ``###`` heading line, without its optional
    closing ``#`` sequence; None for any other line."""
    match = _HEADING.match(raw)
    if match is None:
        return None
    title = match.group(2).rstrip(" \t")
    unclosed = title.rstrip("#")
    if unclosed != title and unclosed[-1:] in (" ", "\t"):
        title = unclosed
    return len(match.group(1)), title.strip()


def _bullet(raw: str) -> str | None:
    """The text of a ``- item`` line (``*`` and ``+`` too), or None."""
    if raw[:1] not in ("-", "*", "+") or raw[1:2] not in (" ", "\t"):
        return None
    text = raw[2:].strip(" \t")
    return text if text and not text[-1].isspace() else None


def _new_stage(doc: _Document, title: str, number: int) -> _Stage:
    explicit = _EXPLICIT_ID.search(title)
    name = title[: explicit.start()].strip() if explicit else title
    stage_id = explicit.group(1) if explicit else slug(name)
    if not name:
        doc.problem(number, "a stage heading needs a title")
    elif not stage_id:
        doc.problem(number, f"no id can be made of {_shown(name)}: add {{#id}}")
    elif stage_id in doc.lines:
        message = f"duplicate stage id {_shown(stage_id)} (line {doc.lines[stage_id]})"
        doc.problem(number, message)
    else:
        doc.lines[stage_id] = number
    return _Stage(name, stage_id, number)  # refused with the document if it has a problem


def _section_line(doc: _Document, stage: _Stage, section: str, raw: str, number: int) -> None:
    """Add a line of a ``### Steps``, ``### Triggers`` or ``### Tools`` section to ``stage``,
    or note why it cannot be."""
    if section == "steps":
        if not _STEP.match(raw) and not (raw[:1].isspace() and stage.steps):
            doc.problem(number, "a step is a numbered line: '1. Ask for ...'")
        else:
            stage.steps.append(raw.rstrip())
        return
    bullet = _bullet(raw)
    if section == "triggers":
        parts = _ARROW.split(bullet) if bullet else []
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            doc.problem(number, "a trigger is a bullet: '- <condition> → <stage>'")
        else:
            condition = parts[0].strip().rstrip(".")
            stage.triggers.append((condition, parts[1].strip().strip("`"), number))
        return
    if section == "transfer":
        key, colon, value = (bullet or "").partition(":")
        key = key.strip().lower()
        if not colon or key not in _TRANSFER_KEYS or not value.strip():
            doc.problem(number, "a transfer line is a bullet: '- to: sip:desk@pbx.example.com'")
        elif _TRANSFER_KEYS[key] in stage.transfer:
            doc.problem(number, f"a second '{key}:' in ### Transfer")
        else:
            stage.transfer[_TRANSFER_KEYS[key]] = value.strip()
        return
    tool = _TOOL.match(bullet) if bullet else None
    if tool is None:
        doc.problem(number, "a tool is a bullet with its name: '- lookup_order'")
    else:
        stage.tools.append((tool.group(1), number))


def _assemble(doc: _Document, front: dict[str, Any], where: LineMap) -> dict[str, Any]:
    """The playbook's data; its problems noted in ``doc`` (the data is then not to be used)."""
    for key, source in _FROM_BODY.items():
        if key in front:
            doc.problem(_line(where, key), f"{key}: set by {source}, not front matter")
    ids = {stage.id: i for i, stage in enumerate(doc.stages)}  # a dict: thousands of stages
    options = front.pop("stages", None) or {}
    if not isinstance(options, dict):
        doc.problem(_line(where, "stages"), "stages: a mapping of stage id to options")
        options = {}
    front_lines = dict(where.lines)
    where.lines.clear()
    for path, line in front_lines.items():  # front matter paths -> compiled data paths
        match = re.match(r"stages\.([^.\[]+)(.*)$", path)
        if match is None:
            where.lines.setdefault(path, line)  # already normal: add() would redo it
        elif match.group(1) in ids:
            where.lines.setdefault(f"stages[{ids[match.group(1)]}]{match.group(2)}", line)
    for stage_id, extra in list(options.items()):
        line = front_lines.get(f"stages.{stage_id}", 1)
        if stage_id not in ids:
            message = f"stages: no stage {_shown(stage_id)} in this file (stages: {', '.join(ids)})"
            doc.problem(line, message)
        elif not isinstance(extra, dict):
            doc.problem(line, f"stages.{stage_id}: a mapping of stage options")
            del options[stage_id]
        else:
            for key, source in _STAGE_FROM_BODY.items():
                if key in extra:
                    key_line = front_lines.get(f"stages.{stage_id}.{key}", line)
                    doc.problem(key_line, f"{key}: set by {source}, not front matter")

    listed = front.pop("transitions", None) or []
    if not isinstance(listed, list):
        doc.problem(_line(where, "transitions"), "transitions: a list of transitions")
        listed = []
    transitions: list[Any] = list(listed)
    taken = {t["id"] for t in transitions if isinstance(t, dict) and isinstance(t.get("id"), str)}
    stages: list[dict[str, Any]] = []
    for i, stage in enumerate(doc.stages):
        where.add(f"stages[{i}]", stage.line)
        for j, (_, line) in enumerate(stage.tools):
            where.add(f"stages[{i}].tools[{j}]", line)
        stages.append(
            {
                "id": stage.id,
                "name": stage.title,
                "system_prompt": _prompt(doc, stage),
                "tools": [name for name, _ in stage.tools],
                **options.get(stage.id, {}),
            }
        )
        if "transfer" in stage.sections:
            line = stage.sections["transfer"]
            if "transfer" in options.get(stage.id, {}):
                doc.problem(line, "transfer: set by both ### Transfer and the front matter")
            where.add(f"stages[{i}].transfer", line)
            stages[-1]["transfer"] = stage.transfer
        for condition, target, line in stage.triggers:
            target_id = target if target in ids else slug(target)
            if target_id not in ids:
                doc.problem(line, f"unknown stage {_shown(target)} (stages: {', '.join(ids)})")
                continue
            transition_id = _unique(f"{stage.id}_to_{target_id}", taken)
            where.add(f"transitions[{len(transitions)}]", line)
            transitions.append(
                {
                    "id": transition_id,
                    "from": stage.id,
                    "condition": {"type": "intent", "intent": condition},
                    "action": {"target_stage": target_id},
                    "description": condition,
                }
            )
    where.add("name", doc.name_line)
    where.add("global_system_prompt", doc.name_line)
    where.add("stages", doc.stages[0].line)
    where.add("initial_stage", doc.stages[0].line)
    where.add("id", doc.name_line)
    assert doc.name is not None
    data: dict[str, Any] = {
        "id": slug(doc.name) or doc.name,
        "name": doc.name,
        "initial_stage": doc.stages[0].id,
        **front,
        "stages": stages,
        "transitions": transitions,
    }
    prompt = "\n".join(doc.text).strip()
    if prompt:
        data["global_system_prompt"] = prompt
    return data


def _prompt(doc: _Document, stage: _Stage) -> str:
    text = "\n".join(stage.text).strip()
    steps = "\n".join(stage.steps).strip()
    if steps:
        text = f"{text}\n\n{STEPS_INTRO}\n{steps}" if text else f"{STEPS_INTRO}\n{steps}"
    if not text:
        doc.problem(stage.line, f"stage {_shown(stage.id)} has no prompt text or steps")
    return text


def _unique(base: str, taken: set[Any]) -> str:
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}_{n}"
    taken.add(candidate)
    return candidate


def locate(where: LineMap, error: PlaybookError) -> PlaybookError:
    """``error`` with each problem as ``file.md:LINE: [field: ]message`` (line 1 when its
    field's is unknown): the compiled data's paths are not what the author wrote, so only the
    field's own key is named, and not at all when it is a list position."""
    return error.map(lambda problem: _placed(where, problem))


def _placed(where: LineMap, problem: Problem) -> Problem:
    if problem.source != where.label or problem.line is not None:  # from elsewhere, or placed
        return problem
    last = re.split(r"[.\[]", problem.path)[-1] if problem.path else ""
    prefix = f"{last}: " if last and not last.endswith("]") else ""
    return Problem(where.label, "", prefix + problem.message, _line(where, problem.path))


def _line(where: LineMap, path: str) -> int:
    return where.line_of(path) or 1


def _error(label: str, line: int, message: str) -> PlaybookError:
    return PlaybookError(label, "", message, line)
