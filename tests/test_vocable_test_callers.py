"""``vocable test`` beyond the examples over WebRTC: its barge-in and keypad scenarios over
SIP, a simulated caller (its LLM and the agent's scripted stand-ins speaking the real wire
format), and the embedded model (llama.cpp in process, SmolLM2) judging semantic checks over
repeated runs."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.conftest import EXAMPLES
from tests.support.models import smollm2_gguf
from tests.support.processes import run_vocable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCENARIOS = EXAMPLES / "scenarios"


async def test_barge_in_and_keypad_scenarios_pass_over_sip(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, out, err = await run_vocable(
        "test", str(SCENARIOS / "restaurant-barge-in.scenario.yaml"),
        str(SCENARIOS / "support-order-by-keypad.scenario.yaml"),
        "--transport", "sip", "--jobs", "2", "--json", str(report), timeout_s=280,
    )  # fmt: skip
    assert code == 0, out + err
    runs = json.loads(report.read_text())["runs"]
    assert [r["transport"] for r in runs] == ["sip", "sip"]
    silent = runs[0]["turns"][2]["checks"][0]
    assert silent["outcome"] == "passed", silent
    assert runs[1]["turns"][2]["understood"] == "keypad 1002#"  # RFC 4733 digits
    (network,) = [note for note in runs[1]["notes"] if note.startswith("network:")]
    assert " 0 of " not in network, network  # the poor network lost some of its packets


SIMULATED = """\
    name: a caller finds out where their order is
    playbook: {playbook}
    simulated_caller:
      persona: You ordered a blue kettle last week; your order number is A1001.
      goal: Find out when order A1001 arrives.
      max_turns: 4
      expect:
        - tool: {{name: lookup_order, arguments: {{order_id: A1001}}}}
        - stage: identify
        - judge: the agent said when the order arrives
    """


def _support_agent(body: dict[str, Any]) -> Reply:
    if not body.get("stream"):
        return Reply(content='{"intent": "none", "confidence": 0.1}')
    last = body["messages"][-1]
    if last["role"] == "tool":
        return Reply(content="Order A1001 was shipped and arrives on Tuesday.")
    if "1001" in re.sub(r"\D", "", str(last["content"])):  # "A1001", or Whisper's "a 1,001"
        return Reply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A1001"})])
    return Reply(content="Sure, what is the order number?")


def _caller_and_judge(body: dict[str, Any]) -> Reply:
    """The tester's side: verdicts for the judge, lines for the simulated caller."""
    system = str(body["messages"][0]["content"])
    if system.startswith("You check"):
        arrives = "tuesday" in str(body["messages"][-1]["content"]).lower()
        verdict = {"verdict": "yes" if arrives else "no", "reason": "it names the day"}
        return Reply(content=json.dumps(verdict))
    heard = " ".join(str(m["content"]) for m in body["messages"][1:] if m["role"] == "user")
    if "tuesday" in heard.lower():
        return Reply(content="[done]")
    if "order number" in heard.lower():
        return Reply(content="It is A1001.")
    return Reply(content="Hi, I have a question about my order.")


async def test_a_simulated_caller_talks_until_its_goal_is_reached(tmp_path: Path) -> None:
    scenario = tmp_path / "simulated.scenario.yaml"
    scenario.write_text(textwrap.dedent(SIMULATED).format(playbook=EXAMPLES / "support.yaml"))
    report = tmp_path / "report.json"
    async with ScriptedLLM(_support_agent) as agent, ScriptedLLM(_caller_and_judge) as tester:
        code, out, err = await run_vocable(
            "test", str(scenario), "--llm-base-url", agent.base_url,
            "--judge-base-url", tester.base_url, "--json", str(report), timeout_s=200,
        )  # fmt: skip
    assert code == 0, out + err
    [run] = json.loads(report.read_text())["runs"]
    said = [t["action"] for t in run["turns"]]
    assert said == [
        "wait for the agent",
        "say 'Hi, I have a question about my order.'",
        "say 'It is A1001.'",
        "the conversation's outcome",
    ]
    outcome = run["turns"][-1]["checks"]
    assert [c["outcome"] for c in outcome] == ["passed", "passed", "passed"]
    assert outcome[2]["detail"] == "judge: it names the day"


async def test_the_embedded_model_judges_and_repeats_give_a_pass_rate(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, out, err = await run_vocable(
        "test", str(SCENARIOS / "restaurant-booking.scenario.yaml"), "--mode", "text",
        "--repeat", "3", "--judge", "configured", "--llm-gguf", str(smollm2_gguf()),
        "--json", str(report), timeout_s=240,
    )  # fmt: skip
    assert code in (0, 1), out + err  # a 135M model's verdicts may go either way
    assert "pass rate per scenario:" in out
    assert "/3 (" in out
    document = json.loads(report.read_text())
    assert len(document["runs"]) == 3
    assert document["pass_rates"][0]["runs"] == 3
    judged = [
        check
        for run in document["runs"]
        for turn in run["turns"]
        for check in turn["checks"]
        if check["check"].startswith("judge:")
    ]
    assert len(judged) == 6  # two semantic checks a run
    scripted = [
        (run["run"], check)
        for run in document["runs"]
        for turn in run["turns"]
        for check in turn["checks"]
        if not check["check"].startswith("judge:") and check["outcome"] != "skipped"
    ]
    # every run books the same table: each starts with the tools' state as written
    assert all(check["outcome"] == "passed" for _, check in scripted), scripted
    for check in judged:  # decided by the model, not skipped, and its reason given
        assert check["outcome"] in ("passed", "failed"), check
        assert check["detail"].startswith("judge: "), check
