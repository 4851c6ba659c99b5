"""Finding and loading scenario files, with every problem of a file on its own line.

A scenario file is YAML (or JSON) whose top level is a :class:`~.model.Scenario`. A folder given
to :func:`find_scenarios` is searched (recursively) for ``*.scenario.yaml`` / ``*.scenario.yml``
files. Loading checks the file against the format, then against its playbook: the stages and
tools it names must exist, its WAV files must be there. Problems are reported as playbook
problems are: ``file:line: path: message``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from playbooks import LoadedPlaybook, PlaybookError, load_playbook
from playbooks.checks import DELEGATE_TOOL, RESERVED_TOOL
from playbooks.errors import Problem
from playbooks.identity import LANGUAGE_TOOL
from playbooks.loader import read_document
from playbooks.transfer import TRANSFER_TOOL

from .model import Scenario

__all__ = [
    "SCENARIO_SUFFIXES",
    "LoadedScenario",
    "ScenarioError",
    "find_scenarios",
    "load_scenario",
]

SCENARIO_SUFFIXES = (".scenario.yaml", ".scenario.yml")
BUILT_IN_TOOLS = frozenset({RESERVED_TOOL, DELEGATE_TOOL, LANGUAGE_TOOL, TRANSFER_TOOL})
"""Tools the engine offers besides a playbook's own."""


class ScenarioError(PlaybookError):
    """An invalid scenario file (or a scenario path that is not one): one line per problem."""


@dataclass(frozen=True)
class LoadedScenario:
    """A valid scenario with its file and its playbook, loaded."""

    scenario: Scenario
    path: Path
    playbook: LoadedPlaybook

    @property
    def label(self) -> str:
        """How reports name it: the file's name and the scenario's name."""
        return f"{self.path.name}: {self.scenario.name}"

    def afresh(self) -> LoadedScenario:
        """The same scenario with its playbook loaded again from its file: a tools module's
        state (a restaurant's bookings) starts as written, so a run does not find the tables
        an earlier run booked. Raises :class:`~playbooks.PlaybookError` if the file changed
        into an invalid one."""
        if self.playbook.source is None:
            return self
        return replace(self, playbook=load_playbook(self.playbook.source))

    def resolve(self, relative: str) -> Path:
        """A path the file gives, relative to the file's folder."""
        return (self.path.parent / relative).resolve()


def find_scenarios(paths: Sequence[str | Path]) -> list[Path]:
    """The scenario files of ``paths``: a file as given, a folder's ``*.scenario.yaml`` files
    (recursively, sorted); raises :class:`ScenarioError` for a path that does not exist or a
    folder with none."""
    found: list[Path] = []
    problems: list[Problem] = []
    for given in map(Path, paths):
        if given.is_dir():
            inside = sorted(
                p for p in given.rglob("*") if p.is_file() and p.name.endswith(SCENARIO_SUFFIXES)
            )
            if not inside:
                message = f"no scenario files ({', '.join(SCENARIO_SUFFIXES)}) in this folder"
                problems.append(Problem(str(given), "", message))
            found += inside
        elif given.is_file():
            found.append(given)
        else:
            problems.append(Problem(str(given), "", "no such file or folder"))
    if problems:
        raise ScenarioError.of(problems)
    return list(dict.fromkeys(found))


def load_scenario(path: str | Path) -> LoadedScenario:
    """Load, validate and check one scenario file against its playbook (whose tools module is
    imported); raises :class:`ScenarioError` listing every problem found, each with its line:
    the format's, and the stages, tools and files it names that do not exist."""
    path = Path(path)
    try:
        data, locate = read_document(path, "a scenario")
    except PlaybookError as exc:
        raise ScenarioError.of(exc.problems) from None
    label = path.name
    problems: list[Problem] = []
    scenario: Scenario | None = None
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        problems += [
            Problem(label, _path(error["loc"]), _message(error))
            for error in exc.errors()
            if _member_fits(data, error["loc"])
        ]
    playbook: LoadedPlaybook | None = None
    named = data.get("playbook")
    if isinstance(named, str) and named:
        try:
            playbook = load_playbook((path.parent / named).resolve())
        except PlaybookError as exc:
            problems.append(Problem(label, "playbook", f"{named} is not a valid playbook:"))
            problems += exc.problems
    if playbook is not None:
        problems += _against_playbook(data, path, playbook)
    if problems:
        raise ScenarioError.of(locate(ScenarioError.of(problems)).problems) from None
    assert scenario is not None  # valid, else a problem was found
    assert playbook is not None
    return LoadedScenario(scenario, path, playbook)


def _against_playbook(data: dict[str, Any], path: Path, loaded: LoadedPlaybook) -> list[Problem]:
    """What the file's data names that its playbook (or its folder) does not have: stages and
    tools of expectations and scripts, WAV files. Read from the data as written, so these are
    found beside the format's own problems."""
    label, spec = path.name, loaded.spec
    stages = [stage.id for stage in spec.stages]
    tools = set(loaded.tools) | BUILT_IN_TOOLS
    problems: list[Problem] = []

    def check(where: str, kind: str, name: Any, known: Iterable[str]) -> None:
        if isinstance(name, str) and name not in known:
            problems.append(Problem(label, where, _unknown(kind, name, known, spec.id)))

    def expectations(where: str, items: Any) -> None:
        for n, item in enumerate(_items(items)):
            if not isinstance(item, dict):
                continue
            at = f"{where}[{n}]"
            check(f"{at}.stage", "stage", item.get("stage"), stages)
            tool = item.get("tool")
            check(f"{at}.tool", "tool", tool.get("name") if isinstance(tool, dict) else tool, tools)
            check(f"{at}.no_tool", "tool", item.get("no_tool"), tools)

    for n, turn in enumerate(_items(data.get("turns"))):
        if not isinstance(turn, dict):
            continue
        expectations(f"turns[{n}].expect", turn.get("expect"))
        wav = turn.get("wav")
        if isinstance(wav, str) and wav and not (path.parent / wav).is_file():
            problems.append(Problem(label, f"turns[{n}].wav", f"no such file: {wav}"))
        for s, step in enumerate(_items(turn.get("agent"))):
            calls = step.get("tools") if isinstance(step, dict) else None
            for c, call in enumerate(_items(calls)):
                if isinstance(call, dict) and len(call) == 1:
                    where = f"turns[{n}].agent[{s}].tools[{c}]"
                    check(where, "tool", next(iter(call)), tools)
    caller = data.get("simulated_caller")
    if isinstance(caller, dict):
        expectations("simulated_caller.expect", caller.get("expect"))
    return problems


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _unknown(kind: str, name: str, known: Iterable[str], playbook: str) -> str:
    listed = ", ".join(sorted(known))
    return f"{kind} {name!r} is not in playbook {playbook!r} (its {kind}s: {listed})"


_SCALAR_MEMBERS = ("str", "bool", "int", "float", "list[str]")


def _is_model_member(part: int | str) -> bool:
    """Whether a location part names a model (a union's member, or a model's validator)."""
    return isinstance(part, str) and (part[:1].isupper() or part.startswith("function-"))


def _is_member(part: int | str) -> bool:
    """Whether a location part names a union's member rather than a field."""
    return _is_model_member(part) or part in _SCALAR_MEMBERS


def _member_fits(data: object, loc: tuple[int | str, ...]) -> bool:
    """Whether an error inside a union's member is about the member the value was meant as:
    a mapping is meant as the model (``tool: {name: ...}``), anything else as the scalar
    (``tool: book_table``); errors of the other member would only confuse."""
    value = data
    for part in loc:
        if _is_member(part):
            return isinstance(value, dict) == _is_model_member(part)
        try:
            value = value[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return True
    return True


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as a field path (``turns[2].expect[0].tool``), without the names
    pydantic gives a union's members (``str``, ``ToolCheck``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_member(part):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _message(error: object) -> str:
    assert isinstance(error, dict)
    if error["type"] == "extra_forbidden":
        return "unknown field"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")
