"""Finding and loading scenario files, with every problem of a file on its own line.

A scenario file is YAML (or JSON) whose top level is a :class:`~.model.Scenario`. A folder given
to :func:`find_scenarios` is searched (recursively) for ``*.scenario.yaml`` / ``*.scenario.yml``
files. Loading checks the file against the format, then against its playbook: the stages and
tools it names must exist, its WAV files must be there. Problems are reported as playbook
problems are: ``file:line: path: message``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from playbooks import LoadedPlaybook, PlaybookError, load_playbook
from playbooks.checks import DELEGATE_TOOL, RESERVED_TOOL
from playbooks.errors import Problem
from playbooks.identity import LANGUAGE_TOOL
from playbooks.loader import read_document
from playbooks.transfer import TRANSFER_TOOL

from .model import Expectation, Scenario

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
    imported); raises :class:`ScenarioError` listing every problem found, each with its line."""
    path = Path(path)
    try:
        data, locate = read_document(path, "a scenario")
    except PlaybookError as exc:
        raise ScenarioError.of(exc.problems) from None
    label = path.name
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        problems = [
            Problem(label, _path(error["loc"]), _message(error))
            for error in exc.errors()
            if _member_fits(data, error["loc"])
        ]
        raise ScenarioError.of(locate(ScenarioError.of(problems)).problems) from None
    playbook_file = (path.parent / scenario.playbook).resolve()
    try:
        playbook = load_playbook(playbook_file)
    except PlaybookError as exc:
        problem = Problem(label, "playbook", f"{scenario.playbook} is not a valid playbook:")
        located = locate(ScenarioError.of([problem])).problems[0]
        raise ScenarioError.of([located, *exc.problems]) from None
    loaded = LoadedScenario(scenario, path, playbook)
    problems = list(_against_playbook(loaded))
    if problems:
        raise ScenarioError.of(locate(ScenarioError.of(problems)).problems) from None
    return loaded


def _against_playbook(loaded: LoadedScenario) -> Iterable[Problem]:
    """What the scenario names that its playbook (or its folder) does not have."""
    scenario, label = loaded.scenario, loaded.path.name
    spec = loaded.playbook.spec
    stages = [stage.id for stage in spec.stages]
    tools = set(loaded.playbook.tools) | BUILT_IN_TOOLS

    def expectations(where: str, items: list[Expectation]) -> Iterable[Problem]:
        for n, item in enumerate(items):
            at = f"{where}[{n}]"
            if item.stage is not None and item.stage not in stages:
                yield Problem(label, f"{at}.stage", _unknown("stage", item.stage, stages, spec.id))
            named = item.tool if isinstance(item.tool, str) else getattr(item.tool, "name", None)
            for key, name in (("tool", named), ("no_tool", item.no_tool)):
                if name is not None and name not in tools:
                    yield Problem(label, f"{at}.{key}", _unknown("tool", name, tools, spec.id))

    for n, turn in enumerate(scenario.turns):
        yield from expectations(f"turns[{n}].expect", turn.expect)
        if turn.wav is not None and not loaded.resolve(turn.wav).is_file():
            yield Problem(label, f"turns[{n}].wav", f"no such file: {turn.wav}")
        for s, step in enumerate(turn.agent or []):
            for c, call in enumerate(step.tools):
                name = next(iter(call))
                if name not in tools:
                    where = f"turns[{n}].agent[{s}].tools[{c}]"
                    yield Problem(label, where, _unknown("tool", name, tools, spec.id))
    if scenario.simulated_caller is not None:
        yield from expectations("simulated_caller.expect", scenario.simulated_caller.expect)


def _unknown(kind: str, name: str, known: Iterable[str], playbook: str) -> str:
    listed = ", ".join(sorted(known))
    return f"{kind} {name!r} is not one of playbook {playbook!r}'s: {listed}"


_SCALAR_MEMBERS = ("str", "bool", "int", "float", "list[str]")


def _is_member(part: int | str) -> bool:
    """Whether a location part names a union's member rather than a field."""
    return isinstance(part, str) and (part[:1].isupper() or part in _SCALAR_MEMBERS)


def _member_fits(data: object, loc: tuple[int | str, ...]) -> bool:
    """Whether an error inside a union's member is about the member the value was meant as:
    a mapping is meant as the model (``tool: {name: ...}``), anything else as the scalar
    (``tool: book_table``); errors of the other member would only confuse."""
    value = data
    for part in loc:
        if _is_member(part):
            return isinstance(value, dict) == str(part)[:1].isupper()
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
