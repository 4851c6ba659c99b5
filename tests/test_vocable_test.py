"""``vocable test`` through real calls: the examples' scenarios over WebRTC, a scenario made to
fail, and the Python API against a running server. Whisper, Piper, webrtcvad and aiortc are
real; the agent's LLM is each scenario's script (or a scripted stand-in where a test says so).
tests/test_vocable_test_callers.py has SIP, the simulated caller and the embedded model."""

from __future__ import annotations

import ast
import json
import shutil
import textwrap
import wave
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.testkit.scenarios import RigOptions, ScenarioRig, load_scenario
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES
from tests.support.calls import base_url, voice_server
from tests.support.processes import run_vocable
from tests.support.speech import piper_speech

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _junit(path: Path) -> ET.Element:
    return ET.fromstring(path.read_text().split("?>", 1)[1])


async def test_vocable_test_passes_the_examples(tmp_path: Path) -> None:
    junit, report = tmp_path / "junit.xml", tmp_path / "report.json"
    code, out, err = await run_vocable(
        "test", "playbooks/examples/", "--jobs", "3", "--junit", str(junit), "--json", str(report),
        timeout_s=280,
    )  # fmt: skip
    assert code == 0, out + err
    suite = _junit(junit)
    assert suite.get("tests") == "4"
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")
    runs = {Path(r["file"]).name: r for r in json.loads(report.read_text())["runs"]}
    assert all(r["passed"] for r in runs.values())
    barge_in = runs["restaurant-barge-in.scenario.yaml"]["turns"][2]
    assert barge_in["checks"][0]["check"] == "silent_within_ms: 1000"
    keypad = runs["support-order-by-keypad.scenario.yaml"]
    assert keypad["transport"] == "webrtc"
    (network,) = [note for note in keypad["notes"] if note.startswith("network:")]
    assert " 0 of " not in network, network  # the poor network lost some of its packets
    assert keypad["turns"][2]["understood"] == "keypad 1002#"
    looked_up = keypad["turns"][2]["tools"][0]
    assert (looked_up["name"], looked_up["arguments"]) == ("lookup_order", {"order_id": "A1002"})
    assert looked_up["result"]["status"] == "processing"  # what the tool gave back
    assert looked_up["error"] is False
    booking = runs["restaurant-booking.scenario.yaml"]["turns"]
    assert "book a table" in booking[0]["heard"].lower()  # Whisper on what the caller heard
    assert all(t["voice_to_voice_ms"] > 0 for t in booking[1:])
    assert "turn 3: dtmf 1002#" in out  # the readable report, turn by turn


FAILING = """\
    name: books on the wrong stage
    playbook: {playbook}
    turns:
      - expect:
          - stage: welcome
      - say: I would like a table on Friday at eight for two people.
        intent: book_table
        agent:
          - tools: [{{check_availability: {{day: friday, time: "20:00", guests: 2}}}}]
          - say: Good news, Friday at eight for two people is free. Shall I book it now?
        expect:
          - stage: confirmed
          - tool: book_table
          - answer: {{max_words: 12}}
          - tool: check_availability
    """


async def test_a_failing_scenario_says_which_turn_failed_and_why(tmp_path: Path) -> None:
    scenario = tmp_path / "failing.scenario.yaml"
    scenario.write_text(textwrap.dedent(FAILING).format(playbook=EXAMPLES / "restaurant.yaml"))
    junit, audio = tmp_path / "junit.xml", tmp_path / "audio"
    code, out, err = await run_vocable(
        "test", str(scenario), "--junit", str(junit), "--keep-audio", str(audio), timeout_s=200
    )
    assert code == 1, out + err
    failures = [line.strip() for line in out.splitlines() if line.strip().startswith("->")]
    assert failures[0] == "-> turn 2: stage: confirmed: the conversation is in stage 'booking'"
    assert failures[1] == (
        "-> turn 2: tool: book_table: not called; tools called: check_availability"
    )
    assert failures[2].startswith('-> turn 2: answer: {"max_words": 12}: 15 words, more than 12:')
    assert len(failures) == 3  # turn 1, and check_availability, passed
    failure = _junit(junit).find("testcase/failure")
    assert failure is not None
    assert failure.get("message") == (
        "turn 2: stage: confirmed: the conversation is in stage 'booking'"
    )
    [kept] = audio.glob("*.wav")
    with wave.open(str(kept)) as wav:
        assert (wav.getnchannels(), wav.getframerate()) == (2, 16000)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16).reshape(-1, 2)
    caller, agent = np.abs(samples.astype(np.int32)).max(axis=0)
    assert caller > 1000  # what the caller said, left
    assert agent > 1000  # what the caller heard, right


def _make_tools_raise(module: Path) -> list[str]:
    """Make every ``@tool`` function of ``module`` raise as its first statement; their names."""
    source = module.read_text().splitlines()
    broken: dict[int, str] = {}  # line index to insert at -> the raise
    for node in ast.parse("\n".join(source)).body:
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "tool" for d in node.decorator_list
        ):
            first = node.body[0]
            after = first.end_lineno if isinstance(first, ast.Expr) else first.lineno - 1
            assert after is not None
            indent = " " * first.col_offset
            broken[after] = f"{indent}raise RuntimeError('the {node.name} service is down')"
    for at in sorted(broken, reverse=True):  # from the end: earlier indices stay right
        source.insert(at, broken[at])
    module.write_text("\n".join(source) + "\n")
    return [line.split("the ")[1].split(" service")[0] for line in broken.values()]


async def test_the_examples_fail_turn_and_tool_by_name_when_their_tools_raise(
    tmp_path: Path,
) -> None:
    """A scripted answer does not depend on what the tool returned: without the check of tool
    errors, every example passed with every tool broken."""
    examples = Path(shutil.copytree(EXAMPLES, tmp_path / "examples"))
    modules = [examples / "restaurant_tools.py", examples / "support_tools.py"]
    broken = [name for tools in modules for name in _make_tools_raise(tools)]
    assert len(broken) >= 5
    code, out, err = await run_vocable(
        "test", str(examples / "scenarios"), "--mode", "text", timeout_s=120
    )
    assert code == 1, out + err
    failures = [line.strip() for line in out.splitlines() if line.strip().startswith("->")]
    expected = [
        "-> turn 3: tool check_availability ran without error: check_availability failed:",
        "-> turn 4: tool book_table ran without error: book_table failed:",
        "-> turn 2: tool opening_hours ran without error: opening_hours failed:",
        "-> turn 3: tool lookup_order ran without error: lookup_order failed:",
        "-> turn 4: tool cancel_order ran without error: cancel_order failed:",
        "-> turn 2: tool lookup_order ran without error: lookup_order failed:",  # markdown
    ]
    for line in expected:
        assert any(f.startswith(line) and "service is down" in f for f in failures), (
            line,
            failures,
        )


def _by_words(body: dict[str, Any]) -> Reply:
    """An agent for a running server: it books what it is asked for."""
    if not body.get("stream"):
        return Reply(content='{"intent": "book_table", "confidence": 0.9}')
    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(content="Friday at eight is free. Shall I book it?")
    if "friday" in str(last["content"]).lower():
        call = ScriptedToolCall(
            "check_availability", {"day": "friday", "time": "20:00", "guests": 2}
        )
        return Reply(tool_calls=[call])
    return Reply(content="Sure. Which day, and for how many?")


async def test_the_python_api_runs_a_scenario_against_a_running_server(tmp_path: Path) -> None:
    with wave.open(str(tmp_path / "friday.wav"), "wb") as wav:  # a recorded caller line
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(piper_speech("Friday at eight, for two."))
    scenario = tmp_path / "running.scenario.yaml"
    scenario.write_text(
        textwrap.dedent(
            f"""\
            name: books on a running server
            playbook: {EXAMPLES / "restaurant.yaml"}
            turns:
              - expect: [{{stage: welcome}}]
              - silence_ms: 800
                expect: [{{no_tool: check_availability}}]
              - wav: friday.wav
                expect:
                  - tool: {{name: check_availability, arguments: {{day: friday}}}}
                  - answer: is free
                  - voice_to_voice_ms: 5000
            """
        )
    )
    async with ScriptedLLM(_by_words) as llm, voice_server(llm.base_url) as server:
        options = RigOptions(url=base_url(server))
        async with ScenarioRig(options) as bench:
            result = await bench.run(load_scenario(scenario))
    assert result.passed, result.failures
    assert result.agent_llm == "configured"  # the running server's own LLM answered
    assert [t.action for t in result.turns] == [
        "wait for the agent",
        "silence 800 ms",
        "wav friday.wav",
    ]
    assert result.turns[1].answer == ""  # the agent waited through the silence
    understood = result.turns[2].understood
    assert understood is not None
    assert "friday" in understood.lower()
    assert result.turns[2].metrics["stt_ms"] >= 0  # the server's own breakdown of the turn
    assert any(e["type"] == "tts_start" for e in result.events)
