"""A turn's expectations checked against what happened in it.

``tool``, ``transfer`` and ``hangup`` expectations are matched in the order written against the
turn's events (others may come between); the rest look at the turn as a whole. A ``judge``
expectation is decided by :class:`~.judge.Judge` (skipped, and said so, without one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .judge import Verdict
from .model import Expectation, TextCheck, ToolCheck
from .result import CheckResult, Outcome

__all__ = ["TurnFacts", "check_turn", "describe", "ends_call", "markup_in", "words_of"]

MARKUP = re.compile(
    r"(\*\*|__|`|^\s{0,3}#{1,6}\s|^\s*[-*+]\s|^\s*\d+\.\s|\[[^\]]*\]\([^)]*\)|</?[a-zA-Z_][\w-]*>"
    r"|<\|[\w.-]+\|>|[{}]|\|\s*-{3,})",
    re.MULTILINE,
)
"""Markdown emphasis, code, headings, list items, links, tags, special tokens, JSON braces,
table rules: what a listener should never hear read out."""

JudgeCall = Callable[[str], Awaitable[Verdict]]
"""Judges a statement of the turn (see :class:`~.judge.Judge`)."""


@dataclass
class TurnFacts:
    """What a turn did, as the checks need it."""

    events: list[dict[str, Any]]
    """The call's events during the turn, in order."""
    spoken: list[str]
    """The answer's sentences (``agent_sentence`` texts)."""
    stage: str | None
    heard: str | None = None
    """What the caller heard, transcribed; None when not transcribed."""
    voice_to_voice_ms: float | None = None
    silent_after_ms: float | None = None
    """A barge-in turn: from the caller's first voiced frame to the agent's silence."""
    cut_in_ms: float | None = None
    """When the agent's first sound came while the caller's line was still being said: its
    time from the line's first voiced frame; None: it waited for the whole line."""
    barge_in: bool = False
    ended: bool = False
    voice: bool = True
    judge: JudgeCall | None = None
    answer: str = ""
    """The turn's last answer (what ``answer`` checks read); ``spoken`` has every sentence."""


def words_of(text: str) -> str:
    """Lowercase, punctuation gone, spaces single: how texts are compared."""
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


def describe(expectation: Expectation) -> str:
    """The expectation as a short line, as written (``tool: book_table {guests: 2}``)."""
    kind = expectation.kind
    value = getattr(expectation, kind)
    if isinstance(value, ToolCheck):
        shown = value.name + (f" {json.dumps(value.arguments)}" if value.arguments else "")
    elif isinstance(value, TextCheck):
        shown = json.dumps(value.model_dump(exclude_none=True))
    else:
        shown = json.dumps(value) if not isinstance(value, str) else value
    return f"{kind}: {shown}"


def markup_in(text: str) -> str | None:
    """The first piece of markup in ``text``, if any."""
    found = MARKUP.search(text)
    return found.group(0).strip() or found.group(0) if found else None


async def check_turn(expectations: Sequence[Expectation], facts: TurnFacts) -> list[CheckResult]:
    """Each expectation's outcome, in the order written; then, for each tool that failed in
    the turn without a ``tool`` check expecting its error, a failed check naming it."""
    results = []
    cursor = 0
    for expectation in expectations:
        name = describe(expectation)
        kind = expectation.kind
        if kind in ("tool", "transfer", "hangup"):
            found, detail = _in_order(expectation, facts, cursor)
            if found is not None:
                cursor = found + 1
            results.append(CheckResult(name, "passed" if found is not None else "failed", detail))
            continue
        outcome, detail = await _whole(expectation, facts)
        results.append(CheckResult(name, outcome, detail))
    return results + _unexpected_tool_errors(expectations, facts.events)


def _unexpected_tool_errors(
    expectations: Sequence[Expectation], events: list[dict[str, Any]]
) -> list[CheckResult]:
    expected = {
        check.name
        for e in expectations
        if isinstance(check := e.tool, ToolCheck) and check.error not in (None, False)
    }
    failed = []
    for event in events:
        name = event.get("name")
        if event["type"] != "tool_call_end" or not event.get("error") or name in expected:
            continue
        failed.append(
            CheckResult(f"tool {name} ran without error", "failed", _tool_error(events, event))
        )
    return failed


def _tool_error(events: list[dict[str, Any]], end: dict[str, Any]) -> str:
    """What a failed tool call's ``error`` event said (else its result)."""
    for event in events:
        if event["type"] == "error" and event.get("tool") == end.get("name"):
            return f"{end.get('name')} failed: {event.get('message')}"[:300]
    return f"{end.get('name')} failed: {json.dumps(end.get('result'))}"[:300]


def _tool_outcome(check: ToolCheck, events: list[dict[str, Any]], start: int) -> str | None:
    """Why the call begun at ``events[start]`` did not end as ``check`` wants (its result, or
    its error); None when it did."""
    if check.result is None and check.error is None:
        return None
    call_id, name = events[start].get("id"), events[start].get("name")
    end = next(
        (
            e
            for e in events[start + 1 :]
            if e["type"] == "tool_call_end"
            and (e.get("id") == call_id if call_id is not None else e.get("name") == name)
        ),
        None,
    )
    if end is None:
        return "it had not finished when the turn ended"
    failed = bool(end.get("error"))
    if check.error not in (None, False):
        if not failed:
            return f"it did not fail: {json.dumps(end.get('result'))[:200]}"
        said = _tool_error(events, end)
        if isinstance(check.error, str) and words_of(check.error) not in words_of(said):
            return f"it failed otherwise: {said}"
        return None
    if failed:
        return _tool_error(events, end)
    result = end.get("result")
    if isinstance(check.result, str):
        shown = result if isinstance(result, str) else json.dumps(result)
        if words_of(check.result) not in words_of(shown):
            return f"result {shown[:200]!r} lacks {check.result!r}"
        return None
    assert check.result is not None
    problem = _arguments_problem(check.result, result)
    return None if problem is None else f"result: {problem}"


def _in_order(expectation: Expectation, facts: TurnFacts, cursor: int) -> tuple[int | None, str]:
    """The index of the first event at or after ``cursor`` meeting ``expectation`` (and what
    was found), or None and why not."""
    events = facts.events
    if expectation.tool is not None:
        wanted = expectation.tool
        check = wanted if isinstance(wanted, ToolCheck) else ToolCheck(name=wanted)
        calls = [(n, e) for n, e in enumerate(events) if e["type"] == "tool_call_start"]
        outcomes = []
        for n, event in calls:
            if n >= cursor and event.get("name") == check.name:
                problem = _arguments_problem(check.arguments, event.get("arguments"))
                if problem is None:
                    outcome = _tool_outcome(check, events, n)
                    if outcome is None:
                        return n, f"called with {json.dumps(event.get('arguments'))}"
                    outcomes.append(outcome)
        if outcomes:
            return None, f"called as expected, but {outcomes[0]}"
        same = [e for n, e in calls if e.get("name") == check.name]
        if same:
            given = "; ".join(json.dumps(e.get("arguments")) for e in same)
            problems = [_arguments_problem(check.arguments, e.get("arguments")) for e in same]
            if any(p is None for p in problems):
                return None, "called, but before an event this turn expected first"
            return None, f"called with other arguments ({problems[0]}): {given}"
        called = ", ".join(str(e.get("name")) for _, e in calls) or "none"
        return None, f"not called; tools called: {called}"
    if expectation.transfer is not None:
        target = expectation.transfer
        for n, event in enumerate(events):
            if n >= cursor and event["type"] == "transfer_started":
                shown = json.dumps({k: v for k, v in event.items() if k not in ("t_ms", "type")})
                if target is True or (isinstance(target, str) and target.lower() in shown.lower()):
                    return n, f"requested: {shown}"
        return None, "no transfer was requested" + _later(events, cursor, "transfer_started")
    for n, event in enumerate(events):  # hangup
        if n >= cursor and ends_call(event):
            reason = event.get("reason")
            return n, f"the call ended ({reason})" if reason else "the call ended"
    if facts.ended:
        return len(events), "the call ended"
    return None, "the call did not end"


def ends_call(event: dict[str, Any]) -> bool:
    """Whether ``event`` says the call ended (a ``hangup`` with its reason, on the server's
    event stream; a ``closed`` state, on the data channel)."""
    closed = event["type"] == "state" and event.get("state") == "closed"
    return closed or event["type"] == "hangup"


def _later(events: list[dict[str, Any]], cursor: int, kind: str) -> str:
    early = any(e["type"] == kind for e in events[:cursor])
    return " after the events expected before it" if early else ""


def _arguments_problem(wanted: dict[str, Any], given: Any) -> str | None:
    """Why ``given`` lacks the ``wanted`` subset; None when it has it."""
    if not wanted:
        return None
    if not isinstance(given, dict):
        return f"arguments {str(given)[:80]!r} are not an object"
    for key, value in wanted.items():
        if key not in given:
            return f"no {key!r}"
        if not _same(value, given[key]):
            return f"{key} is {json.dumps(given[key])}, not {json.dumps(value)}"
    return None


def _same(wanted: Any, given: Any) -> bool:
    if isinstance(wanted, str) and isinstance(given, str):
        return words_of(wanted) == words_of(given)
    if isinstance(wanted, dict) and isinstance(given, dict):
        return _arguments_problem(wanted, given) is None
    numbers = [
        v for v in (wanted, given) if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    if len(numbers) == 1 and any(isinstance(v, str) for v in (wanted, given)):
        return str(wanted).strip() == str(given).strip()  # 2 and "2": as a model may give it
    return bool(wanted == given)


async def _whole(expectation: Expectation, facts: TurnFacts) -> tuple[Outcome, str]:
    """(outcome, detail) of an expectation about the turn as a whole."""
    kind = expectation.kind
    if expectation.stage is not None:
        if facts.stage == expectation.stage:
            return "passed", f"in {facts.stage}"
        return "failed", f"the conversation is in stage {facts.stage!r}"
    if expectation.no_tool is not None:
        called = [e for e in facts.events if e["type"] == "tool_call_start"]
        if any(e.get("name") == expectation.no_tool for e in called):
            return "failed", "it was called"
        return "passed", "not called"
    if expectation.answer is not None:
        return _text(expectation.answer, facts.answer, "the answer")
    if expectation.heard is not None:
        if not facts.voice:
            return "skipped", "nothing is heard in text mode"
        return _text(expectation.heard, facts.heard or "", "the caller heard", by_ear=True)
    if expectation.no_markup is not None:
        for sentence in facts.spoken:
            piece = markup_in(sentence)
            if piece is not None:
                return "failed", f"{piece!r} was spoken in {sentence[:120]!r}"
        return "passed", "no markup"
    if expectation.silent_within_ms is not None:
        if facts.voice and not facts.barge_in:
            return "failed", "only a barge_in turn interrupts the agent"
        return _timed(
            facts, facts.silent_after_ms, expectation.silent_within_ms,
            "silent {took:.0f} ms after the caller began", "the agent did not fall silent",
        )  # fmt: skip
    if expectation.no_cut_in is not None:
        if not facts.voice:
            return "skipped", "no audio in text mode"
        if facts.cut_in_ms is None:
            return "passed", "the agent waited for the whole line"
        return "failed", f"the agent began {facts.cut_in_ms:.0f} ms into the caller's line"
    if expectation.voice_to_voice_ms is not None:
        return _timed(
            facts, facts.voice_to_voice_ms, expectation.voice_to_voice_ms,
            "{took:.0f} ms", "the agent was not heard after the caller",
        )  # fmt: skip
    if expectation.judge is not None:
        if facts.judge is None:
            return "skipped", "no judge LLM (give vocable test --judge-base-url or an LLM)"
        try:
            decided = await facts.judge(expectation.judge)
        except Exception as exc:
            return "failed", f"the judge could not decide: {type(exc).__name__}: {exc}"[:300]
        return ("passed" if decided.passed else "failed"), f"judge: {decided.reason}"
    raise AssertionError(f"unhandled expectation {kind}")


def _timed(
    facts: TurnFacts, took: float | None, limit: int, found: str, missing: str
) -> tuple[Outcome, str]:
    """A time measured on the audio (``took`` ms, None: never) against its ``limit``."""
    if not facts.voice:
        return "skipped", "no audio in text mode"
    if took is None:
        return "failed", missing
    detail = f"{found.format(took=took)} (limit {limit} ms)"
    return ("passed" if took <= limit else "failed"), detail


def _text(
    check: TextCheck | str, text: str, subject: str, *, by_ear: bool = False
) -> tuple[Outcome, str]:
    """A text check's outcome; ``by_ear``: ``text`` is a transcript, whose words may be
    slightly off (see :func:`_sounds_like`)."""
    if isinstance(check, str):
        check = TextCheck(contains=check)
    said = words_of(text)
    quoted = f"{subject}: {text[:200]!r}"
    has = _hears_words if by_ear else _has_words
    for part in _listed(check.contains):
        if not has(said, part):
            return "failed", f"{part!r} is not in {quoted}"
    for part in _listed(check.not_contains):
        if has(said, part):
            return "failed", f"{part!r} is in {quoted}"
    if check.matches is not None and not re.search(check.matches, text, re.IGNORECASE):
        return "failed", f"/{check.matches}/ does not match {quoted}"
    if check.max_words is not None and len(said.split()) > check.max_words:
        count = len(said.split())
        return "failed", f"{count} words, more than {check.max_words}: {quoted}"
    return "passed", quoted


def _has_words(said: str, part: str) -> bool:
    """Whether ``part``'s words come in ``said`` (already :func:`words_of`), whole words."""
    return f" {words_of(part)} " in f" {said} "


def _hears_words(said: str, part: str) -> bool:
    """Whether ``part``'s words come in a row in the transcript ``said``, each word as it is
    or as Whisper may slip on it (:func:`_sounds_like`)."""
    heard, wanted = said.split(), words_of(part).split()
    return any(
        all(_sounds_like(h, w) for h, w in zip(heard[i : i + len(wanted)], wanted, strict=True))
        for i in range(len(heard) - len(wanted) + 1)
    )


def _sounds_like(heard: str, wanted: str) -> bool:
    """The same word, or one a recogniser's slip away: an ending lost or added ("close" for
    "closed", "monday" for "mondays"), or one letter off in a word of five or more."""
    if heard == wanted:
        return True
    short, long = sorted((heard, wanted), key=len)
    if len(short) >= 4 and long.startswith(short) and len(long) - len(short) <= 2:
        return True
    return len(short) >= 5 and len(long) - len(short) <= 1 and _one_edit(short, long)


def _one_edit(a: str, b: str) -> bool:
    """Whether ``b`` (as long as ``a`` or one letter longer) is ``a`` with one letter changed,
    added or removed."""
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) <= 1
    return any(b[:i] + b[i + 1 :] == a for i in range(len(b)))


def _listed(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else value
