"""Reports of scenario runs: readable text (each turn: what was said, heard, done, how long, what
failed and why), a JSON document, and JUnit XML for CI systems (one test case per scenario and
run, its failures named by turn)."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .result import ScenarioResult, TurnResult

__all__ = ["PassRate", "pass_rates", "write_json", "write_junit", "write_text"]

MARKS = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}


@dataclass(frozen=True)
class PassRate:
    """How often one scenario passed over its runs."""

    name: str
    file: str
    passed: int
    runs: int

    @property
    def rate(self) -> float:
        return self.passed / self.runs if self.runs else 0.0


def pass_rates(results: Sequence[ScenarioResult]) -> list[PassRate]:
    """Each scenario's pass rate over its runs, in the order first run."""
    tally: dict[tuple[str, str], list[bool]] = {}
    for result in results:
        tally.setdefault((result.file, result.name), []).append(result.passed)
    return [
        PassRate(name, file, sum(outcomes), len(outcomes))
        for (file, name), outcomes in tally.items()
    ]


def write_text(results: Sequence[ScenarioResult], out: TextIO, *, verbose: bool = False) -> None:
    """The readable report: every scenario run with its turns (all of them when ``verbose``
    or when the run failed, else one line), then the totals and pass rates."""
    for result in results:
        mark = "PASS" if result.passed else "FAIL"
        how = f"{result.mode}, {result.transport}, {result.agent_llm} LLM"
        run = f" (run {result.run})" if result.run > 1 or _repeated(results, result) else ""
        out.write(f"{mark} {result.file}: {result.name}{run} [{how}] {result.duration_s:.1f} s\n")
        if verbose or not result.passed:
            for turn in result.turns:
                _write_turn(turn, out)
            if result.audio_file:
                out.write(f"    audio: {result.audio_file}\n")
        if result.error is not None:
            out.write(f"    stopped: {result.error}\n")
        for note in dict.fromkeys(result.notes):
            out.write(f"    note: {note}\n")
        for failure in result.failures:
            if failure.turn is not None:
                out.write(f"    -> turn {failure.turn}: {failure.check}: {failure.reason}\n")
    passed = sum(r.passed for r in results)
    out.write(f"\n{passed} of {len(results)} scenario runs passed\n")
    rates = pass_rates(results)
    if any(rate.runs > 1 for rate in rates):
        out.write("pass rate per scenario:\n")
        for rate in rates:
            out.write(f"  {rate.passed}/{rate.runs} ({rate.rate:.0%}) {rate.file}: {rate.name}\n")
    skipped = sum(len(r.skipped) for r in results)
    if skipped:
        out.write(f"{skipped} check(s) skipped (see each turn's 'skip' lines)\n")


def _repeated(results: Sequence[ScenarioResult], result: ScenarioResult) -> bool:
    return sum(r.file == result.file and r.name == result.name for r in results) > 1


def _write_turn(turn: TurnResult, out: TextIO) -> None:
    timing = [f"{turn.duration_ms / 1000:.1f} s"]
    if turn.voice_to_voice_ms is not None:
        timing.append(f"voice-to-voice {turn.voice_to_voice_ms:.0f} ms")
    if turn.cut_in_ms is not None:
        timing.append(f"cut in {turn.cut_in_ms:.0f} ms into the line")
    out.write(f"  turn {turn.number}: {turn.action} ({', '.join(timing)})\n")
    if turn.understood is not None:
        out.write(_field("agent heard", turn.understood))
    if turn.turn_ends:
        out.write(_field("turn ended", "; ".join(turn.turn_ends)))
    if turn.tools:
        called = "; ".join(_tool_line(tool) for tool in turn.tools)
        out.write(_field("tools", called))
    if turn.answer:
        out.write(_field("agent said", turn.answer))
    if turn.heard is not None:
        out.write(_field("caller heard", turn.heard))
    if turn.stage is not None:
        out.write(_field("stage", turn.stage))
    for check in turn.checks:
        out.write(_field(MARKS[check.outcome], f"{check.check} -- {check.detail}"))
    if turn.failed and turn.timeline:
        out.write(_field("timeline", "; ".join(turn.timeline)))


def _tool_line(tool: dict[str, Any]) -> str:
    line = f"{tool['name']} {json.dumps(tool['arguments'])}"
    if tool.get("error"):
        return f"{line} -> failed: {json.dumps(tool.get('result'))[:120]}"
    if "result" in tool:
        return f"{line} -> {json.dumps(tool['result'])[:120]}"
    return line


def _field(label: str, text: str) -> str:
    lines = textwrap.wrap(text, width=96, subsequent_indent=" " * 18) or [""]
    return f"    {label:>12}: " + "\n".join(lines) + "\n"


def write_json(results: Sequence[ScenarioResult], out: TextIO) -> None:
    """``{"passed": bool, "runs": [...], "pass_rates": [...]}``, each run with its turns, checks
    and the call's events."""
    document: dict[str, Any] = {
        "passed": all(r.passed for r in results),
        "runs": [r.to_dict() for r in results],
        "pass_rates": [
            {"name": p.name, "file": p.file, "passed": p.passed, "runs": p.runs, "rate": p.rate}
            for p in pass_rates(results)
        ],
    }
    json.dump(document, out, indent=2, default=str)
    out.write("\n")


def write_junit(results: Sequence[ScenarioResult], out: TextIO) -> None:
    """JUnit XML: a test suite of every run, a test case per scenario run (``classname`` its
    file, ``name`` the scenario and run), failures listed by turn; skipped checks go to the
    case's ``system-out``."""
    suite = ET.Element(
        "testsuite",
        name="vocable scenarios",
        tests=str(len(results)),
        failures=str(sum(1 for r in results if r.failures and r.error is None)),
        errors=str(sum(1 for r in results if r.error is not None)),
        time=f"{sum(r.duration_s for r in results):.2f}",
    )
    for result in results:
        name = result.name + (f" (run {result.run})" if _repeated(results, result) else "")
        case = ET.SubElement(
            suite, "testcase", classname=result.file, name=name, time=f"{result.duration_s:.2f}"
        )
        checks = [f for f in result.failures if f.turn is not None]
        if checks:
            failure = ET.SubElement(case, "failure", message=str(checks[0]), type="expectation")
            failure.text = "\n".join(str(f) for f in checks)
        if result.error is not None:
            error = ET.SubElement(case, "error", message=result.error, type="run")
            error.text = result.error
        lines = []
        for turn in result.turns:
            lines.append(f"turn {turn.number}: {turn.action}")
            lines += [f"  {MARKS[c.outcome]}: {c.check} -- {c.detail}" for c in turn.checks]
        ET.SubElement(case, "system-out").text = "\n".join(lines)
    ET.indent(suite)
    out.write(ET.tostring(suite, encoding="unicode", xml_declaration=True))
    out.write("\n")
