"""Scenario files (``vocable test``): the format, its errors with their lines, the checks, the
script and the reports. No call is placed here; tests/test_vocable_test.py places them."""

from __future__ import annotations

import asyncio
import io
import json
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from server.testkit.caller import ReceivedFrame
from server.testkit.network import LossyLine, NetworkPath
from server.testkit.scenarios import ScenarioError, find_scenarios, load_scenario
from server.testkit.scenarios.checks import TurnFacts, check_turn, markup_in
from server.testkit.scenarios.judge import Verdict, _read_verdict, spoken_line
from server.testkit.scenarios.model import Expectation, Turn
from server.testkit.scenarios.report import pass_rates, write_json, write_junit, write_text
from server.testkit.scenarios.result import CheckResult, ScenarioResult, TurnResult
from server.testkit.scenarios.runner import _settle
from server.testkit.scenarios.script import TurnScript
from tests.conftest import EXAMPLES
from tests.support.processes import run_vocable

pytestmark = pytest.mark.timeout(60)

RESTAURANT = EXAMPLES / "restaurant.yaml"


def _write(folder: Path, text: str, name: str = "case.scenario.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text).replace("PLAYBOOK", str(RESTAURANT)))
    return path


# -- the examples carry their scenarios ------------------------------------------------------


def test_every_example_playbook_has_a_scenario() -> None:
    scenarios = [load_scenario(path) for path in find_scenarios([EXAMPLES])]
    tested = {s.playbook.source.resolve() for s in scenarios if s.playbook.source is not None}
    playbooks = {
        p.resolve()
        for p in [*EXAMPLES.iterdir(), *(EXAMPLES / "markdown").iterdir()]
        if p.suffix in (".yaml", ".md", ".json") and not p.name.endswith(".scenario.yaml")
    }
    assert playbooks <= tested, f"no scenario for {sorted(map(str, playbooks - tested))}"
    kinds = {turn.action for s in scenarios for turn in s.scenario.turns}
    assert {"say", "dtmf", None} <= kinds
    assert any(turn.barge_in for s in scenarios for turn in s.scenario.turns)
    assert any(s.scenario.mode == "text" for s in scenarios)


# -- bad files: every problem, one line each, with its line -----------------------------------


async def test_a_bad_file_lists_every_problem_with_its_line_and_runs_nothing(
    tmp_path: Path,
) -> None:
    bad = _write(
        tmp_path,
        """\
        name: a bad one
        playbook: PLAYBOOK
        colour: blue
        turns:
          - say: Hello
            dtmf: "12"
          - dtmf: "12x"
            expect:
              - stage: bookng
              - tool: {name: book_tabel}
              - answer: {contain: x}
              - stage: booking
                tool: book_table
          - say: Friday
            agent:
              - tools: [{no_such_tool: {}}]
            expect:
              - silent_within_ms: -5
              - answer: {matches: "(unclosed"}
              - wav: missing.wav
          - wav: missing.wav
        """,
    )
    code, out, err = await run_vocable("test", str(bad))
    assert code == 2
    assert out == ""  # nothing ran: no report
    lines = err.splitlines()
    expected = [
        "case.scenario.yaml:3: colour: unknown field",
        "case.scenario.yaml:5: turns[0]: a turn has one of say, wav, dtmf, silence_ms;",
        "case.scenario.yaml:7: turns[1].dtmf: digits are 1 to 32 of 0-9, *, #, A-D",
        "case.scenario.yaml:9: turns[1].expect[0].stage: stage 'bookng' is not in playbook",
        "case.scenario.yaml:10: turns[1].expect[1].tool: tool 'book_tabel' is not in playbook",
        "case.scenario.yaml:11: turns[1].expect[2].answer.contain: unknown field",
        "case.scenario.yaml:12: turns[1].expect[3]: one check per item (this one has stage, tool)",
        "case.scenario.yaml:16: turns[2].agent[0].tools[0]: tool 'no_such_tool' is not in",
        "case.scenario.yaml:18: turns[2].expect[0].silent_within_ms: Input should be greater",
        "case.scenario.yaml:19: turns[2].expect[1].answer.matches: not a regular expression",
        "case.scenario.yaml:20: turns[2].expect[2].wav: unknown field",
        "case.scenario.yaml:21: turns[3].wav: no such file: missing.wav",
    ]
    assert len(lines) == len(expected), err
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(f"vocable: {start}"), line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a list\n", "case.scenario.yaml: a scenario must be a mapping at the top level"),
        ("name: x\nturns: [\n", "case.scenario.yaml: YAML syntax error at line 3"),
        ("name: x\nplaybook: PLAYBOOK\n", "case.scenario.yaml: a scenario needs turns or a"),
        (
            "name: x\nplaybook: nowhere.yaml\nturns: [{}]\n",
            "case.scenario.yaml:2: playbook: nowhere.yaml is not a valid playbook:",
        ),
        (
            "name: x\nplaybook: PLAYBOOK\nagent_llm: script\nturns: [{}]\n",
            "case.scenario.yaml: agent_llm script needs the turns' agent steps",
        ),
    ],
)
def test_a_file_that_is_no_scenario_says_why(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as raised:
        load_scenario(_write(tmp_path, text))
    assert raised.value.lines()[0].startswith(message), raised.value.lines()


async def test_paths_without_scenarios_are_usage_errors(tmp_path: Path) -> None:
    code, out, err = await run_vocable("test", str(tmp_path), str(tmp_path / "gone.yaml"))
    assert code == 2
    assert out == ""
    assert "no scenario files (.scenario.yaml, .scenario.yml) in this folder" in err
    assert "gone.yaml: no such file or folder" in err


# -- checks ------------------------------------------------------------------------------------


def _expect(*items: dict[str, object]) -> list[Expectation]:
    return [Expectation.model_validate(item) for item in items]


def _tool(tool: str, **arguments: object) -> dict[str, object]:
    return {"type": "tool_call_start", "name": tool, "arguments": arguments, "t_ms": 1.0}


async def test_tools_are_matched_in_order_with_a_subset_of_their_arguments() -> None:
    events = [
        _tool("check_availability", day="Friday", time="20:00", guests=2),
        {"type": "stage_change", "stage": "confirmed", "t_ms": 2.0},
        _tool("book_table", day="friday", guests=2, name="Rossi"),
    ]
    facts = TurnFacts(events, ["Booked."], "confirmed", answer="Booked.")
    results = await check_turn(
        _expect(
            {"tool": {"name": "check_availability", "arguments": {"day": "FRIDAY"}}},
            {"tool": {"name": "book_table", "arguments": {"guests": "2", "name": "rossi"}}},
            {"stage": "confirmed"},
            {"no_tool": "opening_hours"},
        ),
        facts,
    )
    assert [r.outcome for r in results] == ["passed"] * 4
    out_of_order = await check_turn(
        _expect({"tool": "book_table"}, {"tool": "check_availability"}), facts
    )
    assert [r.outcome for r in out_of_order] == ["passed", "failed"]
    assert "before an event this turn expected first" in out_of_order[1].detail
    wrong = await check_turn(
        _expect({"tool": {"name": "book_table", "arguments": {"guests": 4}}}, {"tool": "x"}), facts
    )
    assert wrong[0].detail.startswith("called with other arguments (guests is 2, not 4)")
    assert wrong[1].detail == "not called; tools called: check_availability, book_table"


async def test_text_checks_compare_words_and_say_what_was_found() -> None:
    answer = "Friday at eight is free. Shall I book it?"
    facts = TurnFacts([], [answer], "booking", answer=answer)
    results = await check_turn(
        _expect(
            {"answer": "friday at EIGHT"},
            {"answer": {"contains": "fri"}},  # whole words only
            {"answer": {"not_contains": ["book it"]}},
            {"answer": {"matches": r"free\. shall"}},
            {"answer": {"max_words": 5}},
            {"stage": "confirmed"},
        ),
        facts,
    )
    assert [r.outcome for r in results] == [
        "passed",
        "failed",
        "failed",
        "passed",
        "failed",
        "failed",
    ]
    assert results[4].detail.startswith("9 words, more than 5: the answer: 'Friday at eight")
    assert results[5].detail == "the conversation is in stage 'booking'"


async def test_what_was_heard_is_matched_despite_a_recognisers_slips() -> None:
    heard = "No, sorry, we are close on Monday. Traitori Evocable wishes you a good evening."
    facts = TurnFacts([], [], None, heard=heard)
    results = await check_turn(
        _expect(
            {"heard": "closed on Mondays"},
            {"heard": "Trattoria"},  # one letter off in a long word
            {"heard": {"not_contains": "open"}},
            {"heard": "good evenings everyone"},
            {"heard": "we"},  # short words must be exact: "we" is not "wi"
        ),
        facts,
    )
    assert [r.outcome for r in results] == ["passed", "failed", "passed", "failed", "passed"]
    answer = await check_turn(_expect({"answer": "closed"}), TurnFacts([], [], None, answer=heard))
    assert answer[0].outcome == "failed"  # the answer's own text is matched exactly


@pytest.mark.parametrize(
    ("sentence", "markup"),
    [
        ("Your order **A1001** ships today.", "**"),
        ("# Opening hours", "#"),
        ("- Tuesday to Sunday", "-"),
        ("See [the menu](http://x).", "[the menu](http://x)"),
        ('{"day": "friday"}', "{"),
        ("Use `book_table` now.", "`"),
        ("<think>hm</think> Sure.", "<think>"),
        ("It costs 12.50 euros, open 6-10 pm, #1 in town.", None),
    ],
)
def test_markup_is_found_where_a_listener_would_hear_it(sentence: str, markup: str | None) -> None:
    assert markup_in(sentence) == markup


async def test_audio_checks_are_skipped_in_text_mode_and_judged_when_a_judge_is_given() -> None:
    async def judge(statement: str) -> Verdict:
        return Verdict("table" in statement, "the answer offers a table")

    facts = TurnFacts([], ["Sure."], None, voice=False, judge=judge, answer="Sure.")
    results = await check_turn(
        _expect(
            {"heard": "sure"},
            {"voice_to_voice_ms": 100},
            {"judge": "offers a table"},
            {"judge": "offers a room"},
        ),
        facts,
    )
    assert [r.outcome for r in results] == ["skipped", "skipped", "passed", "failed"]
    assert results[2].detail == "judge: the answer offers a table"
    facts.judge = None
    unjudged = await check_turn(_expect({"judge": "offers a table"}), facts)
    assert unjudged[0].outcome == "skipped"


async def test_barge_in_transfer_and_hangup_checks() -> None:
    events = [
        {"type": "transfer_started", "target": "sip:desk@example.com", "t_ms": 1.0},
        {"type": "state", "state": "closed", "t_ms": 2.0},
    ]
    facts = TurnFacts(events, [], None, barge_in=True, silent_after_ms=240.0)
    results = await check_turn(
        _expect(
            {"silent_within_ms": 300},
            {"silent_within_ms": 200},
            {"transfer": "desk"},
            {"hangup": True},
            {"transfer": True},
        ),
        facts,
    )
    assert [r.outcome for r in results] == ["passed", "failed", "passed", "passed", "failed"]
    assert results[1].detail == "silent 240 ms after the caller began (limit 200 ms)"
    assert results[4].detail.startswith("no transfer was requested after the events")


def test_judge_verdicts_are_read_or_refused() -> None:
    assert _read_verdict('{"verdict": "yes", "reason": "it does"}') == Verdict(True, "it does")
    assert _read_verdict('{"verdict": "no", "reason": "').passed is False  # cut off: the word
    with pytest.raises(ValueError, match="not a verdict"):
        _read_verdict("maybe")
    assert spoken_line('Caller: "Hi, where is my order?"\nAgent: ...') == "Hi, where is my order?"
    assert spoken_line("Thanks, that's all. [DONE]") is None


# -- the script --------------------------------------------------------------------------------


def test_a_turns_steps_answer_by_their_place_in_the_tool_loop() -> None:
    turn = Turn.model_validate(
        {
            "say": "Friday",
            "intent": "book_table",
            "agent": [
                {"tools": [{"check_availability": {"day": "friday"}}]},
                {"say": "It is free."},
            ],
        }
    )
    script = TurnScript()
    script.play(2, turn)
    asked = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Friday"}]
    first = script({"stream": True, "messages": asked})
    assert [c.name for c in first.tool_calls] == ["check_availability"]
    again = script({"stream": True, "messages": asked})  # the same request, made again
    assert again.tool_calls == first.tool_calls
    after = [*asked, {"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "{}"}]
    assert script({"stream": True, "messages": after}).content == "It is free."
    intent = json.loads(str(script({"messages": asked}).content))
    assert intent["intent"] == "book_table"
    beyond = [*after, {"role": "assistant", "content": "It is free."}]
    missing = script({"stream": True, "messages": beyond})
    assert missing.status == 400
    script({"stream": True, "messages": beyond})  # asked again: listed once
    assert script.missing == [
        "turn 2 scripts 2 agent step(s); the LLM was asked for step 3 (it was answered with an"
        " error)"
    ]


# -- reports -----------------------------------------------------------------------------------


def _results() -> list[ScenarioResult]:
    passing = ScenarioResult("books", "a.scenario.yaml", "voice", "webrtc", "script", run=1)
    passing.turns = [TurnResult(1, "say 'Hi'", checks=[CheckResult("stage: booking", "passed")])]
    failing = ScenarioResult("books", "a.scenario.yaml", "voice", "webrtc", "script", run=2)
    failing.turns = [
        TurnResult(
            1,
            "say 'Hi'",
            answer="Hello there",
            voice_to_voice_ms=512.0,
            timeline=["+0.36 tts_start", "+0.40 caller hears the agent for 0.20 s", "+0.52 paused"],
            checks=[
                CheckResult("stage: booking", "failed", "the conversation is in stage 'welcome'"),
                CheckResult("judge: greets", "skipped", "no judge LLM"),
            ],
        )
    ]
    stopped = ScenarioResult("cancels", "b.scenario.yaml", "text", "none", "script")
    stopped.error = "the agent did not answer and fall silent within 30 s"
    stopped.notes = ["turn 1 scripts 0 agent step(s); the LLM was asked for step 1"]
    return [passing, failing, stopped]


def test_the_reports_name_each_failure_by_turn_and_give_pass_rates() -> None:
    results = _results()
    text = io.StringIO()
    write_text(results, text, verbose=False)
    report = text.getvalue()
    assert "FAIL a.scenario.yaml: books (run 2)" in report
    assert "-> turn 1: stage: booking: the conversation is in stage 'welcome'" in report
    assert "timeline: +0.36 tts_start; +0.40 caller hears the agent for 0.20 s; +0.52" in report
    assert "stopped: the agent did not answer and fall silent within 30 s" in report
    assert "note: turn 1 scripts 0 agent step(s); the LLM was asked for step 1" in report
    assert "1 of 3 scenario runs passed" in report
    assert "1/2 (50%) a.scenario.yaml: books" in report
    assert [(r.passed, r.runs) for r in pass_rates(results)] == [(1, 2), (0, 1)]

    junit = io.StringIO()
    write_junit(results, junit)
    suite = ET.fromstring(junit.getvalue().split("?>", 1)[1])
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["books (run 1)", "books (run 2)", "cancels"]
    failure = cases[1].find("failure")
    assert failure is not None
    assert (
        failure.get("message") == "turn 1: stage: booking: the conversation is in stage 'welcome'"
    )
    error = cases[2].find("error")
    assert error is not None
    assert "fall silent" in str(error.get("message"))

    document = io.StringIO()
    write_json(results, document)
    data = json.loads(document.getvalue())
    assert data["passed"] is False
    assert data["runs"][1]["failures"] == [
        {"turn": 1, "check": "stage: booking", "reason": "the conversation is in stage 'welcome'"}
    ]
    assert data["pass_rates"][0]["rate"] == 0.5


async def test_a_lossy_network_loses_its_share_of_packets_and_delays_the_rest() -> None:
    """``impairments.network``: each packet lost at the given rate (seeded: the same packets
    every run), the others delivered late by up to the jitter, some out of order."""
    path = NetworkPath(packet_loss=0.1, jitter_ms=40, seed=7)
    arrived: list[tuple[int, float]] = []
    loop = asyncio.get_running_loop()
    line = LossyLine(lambda data, _addr: arrived.append((data[0], loop.time())), path)
    sent_at = {}
    for n in range(200):
        sent_at[n] = loop.time()
        line.sendto(bytes([n % 256]), None)
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.06)
    assert (line.sent, line.lost) == (200, 200 - len(arrived))
    assert 8 <= line.lost <= 35, line.lost
    delays = [at - sent_at[n] for n, at in arrived]
    assert max(delays) > 0.02, max(delays)  # late (a loaded machine only adds to it)
    order = [n for n, _ in arrived]
    assert order != sorted(order)  # jitter beyond the packets' spacing reorders them
    again = LossyLine(lambda data, _addr: None, path)
    for n in range(200):
        again.sendto(bytes([n % 256]), None)
    assert again.lost == line.lost  # the same losses every run


class _LaggingLine:
    """A call line whose caller hears the agent late: what the server has already said
    reaches ``frames`` only when the test appends it."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.frames: list[ReceivedFrame] = []

    def ended(self) -> bool:
        return False

    def hear(self, start: float, seconds: float, dbfs: float) -> None:
        self.frames += [ReceivedFrame(start + n * 0.02, dbfs) for n in range(round(seconds / 0.02))]


async def test_a_turn_waits_for_the_caller_to_hear_the_agent_finish() -> None:
    now = time.monotonic()
    began, ended = now - 4.0, now - 0.1  # the server said a 3.9 s greeting
    line = _LaggingLine(
        [
            {"type": "tts_start", "t_ms": began * 1000},
            {"type": "tts_end", "t_ms": ended * 1000},
            {"type": "state", "state": "listening", "t_ms": ended * 1000},
        ]
    )
    line.hear(began, 0.5, -20.0)  # the caller heard its first half second,
    line.hear(began + 0.5, 3.0, -90.0)  # then nothing (its audio stalled)
    waiting = _settle(line, began - 1.0, expect_answer=True, timeout_s=10.0)  # type: ignore[arg-type]
    settled = asyncio.create_task(waiting)
    await asyncio.sleep(1.0)  # quiet long enough, by the server's events and the first half
    assert not settled.done()
    line.hear(time.monotonic() - 0.5, 0.5, -20.0)  # the rest arrives late: heard up to now
    await asyncio.wait_for(settled, 5.0)
