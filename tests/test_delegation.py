"""Delegation to worker stages (the built-in ``delegate`` tool), through ``vocable chat --json``
against the scripted LLM, whose replies are chosen by each request's system prompt."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from playbooks import (
    ChatClient,
    OrchestratorEvent,
    PlaybookError,
    PlaybookOrchestrator,
    load_playbook,
)
from playbooks.delegation import WORKER_NOTE
from playbooks.loader import check_playbook
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.support.processes import run_vocable
from tests.test_cli import _json_lines

PLAYBOOK = """
id: team
name: Team
initial_stage: desk
tools_module: tools.py
global_system_prompt: GLOBAL PROMPT
stages:
  - id: desk
    name: Front desk
    system_prompt: DESK PROMPT
    delegates:
      workers: [flights, hotels]
      mode: MODE
      say: Let me check with the team.
  - id: flights
    name: Flights
    description: Finds flights.
    system_prompt: FLIGHTS PROMPT
    tools: [find_flight]
  - id: hotels
    name: Hotels
    description: Finds hotels.
    system_prompt: HOTELS PROMPT
"""

TOOLS_PY = '''
from playbooks import tool


@tool(side_effects=False)
def find_flight(city: str) -> dict[str, str]:
    """Find a flight.

    Args:
        city: Where to.
    """
    return {"flight": "VB123", "city": city}
'''

FLIGHT = "Flight VB123 to Paris leaves at nine."
HOTEL = "Hotel Lumiere has a room."
ANSWER = "You fly VB123 at nine and stay at Hotel Lumiere."


def _system(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"])


def _tool_results(body: dict[str, Any]) -> list[str]:
    return [str(m["content"]) for m in body["messages"] if m["role"] == "tool"]


def team_llm(hotels: Reply | None = None) -> Callable[[dict[str, Any]], Reply]:
    """Answers the desk (delegate, then the answer) and each worker by its system prompt."""

    def reply(body: dict[str, Any]) -> Reply:
        system, done = _system(body), bool(_tool_results(body))
        if "FLIGHTS PROMPT" in system:
            if done:
                return Reply(content=FLIGHT)
            return Reply(tool_calls=[ScriptedToolCall("find_flight", {"city": "Paris"})])
        if "HOTELS PROMPT" in system:
            return hotels or Reply(content=HOTEL)
        if done:
            return Reply(content=ANSWER)
        task = {"task": "A trip to Paris tomorrow."}
        return Reply(tool_calls=[ScriptedToolCall("delegate", task)])

    return reply


async def _chat(
    write_playbook: Callable[..., Path], llm: ScriptedLLM, mode: str, *args: str
) -> list[dict[str, Any]]:
    path = write_playbook(PLAYBOOK.replace("MODE", mode), TOOLS_PY)
    code, out, err = await run_vocable(
        "chat",
        str(path),
        "--json",
        *args,
        stdin="Book me a trip to Paris\n",
        env={"VOCABLE_LLM_BASE_URL": llm.base_url, "VOCABLE_LLM_MODEL": "m"},
    )
    assert code == 0, err
    assert "Traceback" not in err
    return _json_lines(out)


def _requests_of(llm: ScriptedLLM, prompt: str) -> list[int]:
    return [i for i, body in enumerate(llm.requests) if prompt in _system(body)]


def _delegate_result(llm: ScriptedLLM, delegation: int = 0) -> list[dict[str, Any]]:
    """The ``results`` of the delegate call, as the desk's last request carries them."""
    desk_last = _requests_of(llm, "DESK PROMPT")[-1]
    result = _tool_results(llm.requests[desk_last])[delegation]
    return list(json.loads(result)["results"])


async def test_parallel_workers_run_as_sub_conversations(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    llm.script(team_llm(Reply(content=HOTEL, first_token_delay_s=0.3)))
    lines = await _chat(write_playbook, llm, "parallel")

    desk = _requests_of(llm, "DESK PROMPT")
    flights = _requests_of(llm, "FLIGHTS PROMPT")
    hotels = _requests_of(llm, "HOTELS PROMPT")
    assert (len(desk), len(flights), len(hotels)) == (2, 2, 1)
    # parallel: the hotels worker was asked before the flights worker's second round
    assert desk[0] < hotels[0] < flights[1] < desk[1]
    # the delegating stage is offered the tool; workers get their own prompt and tools only
    desk_tools = {t["function"]["name"] for t in llm.requests[desk[0]]["tools"]}
    assert "delegate" in desk_tools
    flight_request = llm.requests[flights[0]]
    assert {t["function"]["name"] for t in flight_request["tools"]} == {"find_flight"}
    assert "tools" not in llm.requests[hotels[0]]
    # a fresh history seeded with the task
    assert flight_request["messages"][1:] == [
        {"role": "user", "content": "A trip to Paris tomorrow."}
    ]
    assert "GLOBAL PROMPT" in _system(flight_request)
    assert "DESK PROMPT" not in _system(flight_request)
    # the worker's own tool loop ran the real tool
    assert '"flight": "VB123"' in _tool_results(llm.requests[flights[1]])[0]

    assert _delegate_result(llm) == [
        {"worker": "flights", "result": FLIGHT},
        {"worker": "hotels", "result": HOTEL},
    ]
    # the conversation holds the delegate call and its result, not the workers' messages
    roles = [m["role"] for m in llm.requests[desk[1]]["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    assert lines[-1] == {"type": "answer", "text": ANSWER, "stage": "desk"}

    (start,) = [line for line in lines if line["type"] == "delegation_start"]
    assert start["workers"] == ["flights", "hotels"]
    assert start["mode"] == "parallel"
    assert start["say"] == "Let me check with the team."
    (end,) = [line for line in lines if line["type"] == "delegation_end"]
    assert [(w["worker"], w["ok"], w["tool_calls"]) for w in end["workers"]] == [
        ("flights", True, 1),
        ("hotels", True, 0),
    ]
    assert end["workers"][1]["duration_ms"] >= 300
    assert end["duration_ms"] >= end["workers"][1]["duration_ms"]
    worker_tools = [line for line in lines if line.get("worker") == "flights"]
    assert [line["type"] for line in worker_tools] == ["tool_call_start", "tool_call_complete"]
    types = [line["type"] for line in lines]
    assert types.index("delegation_start") < types.index("delegation_end")
    assert types.index("delegation_end") < types.index("phase2_start")


async def test_sequence_workers_see_the_results_before_them(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    llm.script(team_llm())
    await _chat(write_playbook, llm, "sequence")

    flights = _requests_of(llm, "FLIGHTS PROMPT")
    (hotel_request,) = _requests_of(llm, "HOTELS PROMPT")
    assert flights[-1] < hotel_request  # one after the other
    brief = llm.requests[hotel_request]["messages"][-1]["content"]
    assert brief.startswith("A trip to Paris tomorrow.")
    assert f"- flights: {FLIGHT}" in brief
    assert _delegate_result(llm) == [
        {"worker": "flights", "result": FLIGHT},
        {"worker": "hotels", "result": HOTEL},
    ]


async def test_a_failing_worker_gives_an_error_result_not_a_crash(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    llm.script(team_llm(Reply(status=500)))
    lines = await _chat(write_playbook, llm, "parallel", "--llm-retries", "0")

    flights_result, hotels_result = _delegate_result(llm)
    assert flights_result == {"worker": "flights", "result": FLIGHT}
    assert set(hotels_result) == {"worker", "error"}
    assert hotels_result["worker"] == "hotels"
    (end,) = [line for line in lines if line["type"] == "delegation_end"]
    assert [w["ok"] for w in end["workers"]] == [True, False]
    assert any(line["type"] == "error" and line["source"] == "worker" for line in lines)
    assert lines[-1]["text"] == ANSWER


async def test_a_delegate_call_naming_an_unknown_worker_is_an_error_result(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    bad = {"task": "Trip", "workers": ["cars"]}
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall("delegate", bad)]),
            Reply(content="Sorry, no car team."),
        ]
    )
    lines = await _chat(write_playbook, llm, "parallel")
    (result,) = _tool_results(llm.requests[1])
    assert "workers must be a list drawn from" in json.loads(result)["error"]
    assert len(llm.requests) == 2  # no worker ran
    assert not [line for line in lines if line["type"] == "delegation_start"]


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ("[flights, cars]", "stages[0].delegates.workers[1]: unknown stage 'cars'"),
        ("[desk]", "stages[0].delegates.workers[0]: a stage cannot delegate to itself"),
    ],
)
def test_invalid_workers_are_refused_when_the_playbook_loads(
    write_playbook: Callable[..., Path], workers: str, expected: str
) -> None:
    text = PLAYBOOK.replace("MODE", "parallel").replace("[flights, hotels]", workers)
    with pytest.raises(PlaybookError) as error:
        load_playbook(write_playbook(text, TOOLS_PY))
    assert expected in str(error.value)


@pytest.mark.parametrize("entry", ["delegate", "mcp:team"])
def test_a_delegating_stage_may_not_offer_another_tool_named_delegate(
    tmp_path: Path, entry: str
) -> None:
    """Neither by name nor through an MCP server's tools (checked without starting it: its
    ``tools`` list names them)."""
    path = tmp_path / "clash.yaml"
    path.write_text(
        "id: clash\nname: Clash\ninitial_stage: desk\n"
        "mcp_servers:\n  - {name: team, command: team-server, tools: [delegate, lookup]}\n"
        "stages:\n"
        f"  - {{id: desk, name: Desk, system_prompt: Hi., tools: [{entry}],\n"
        "     delegates: {workers: [helper]}}\n"
        "  - {id: helper, name: Helper, system_prompt: Help.}\n"
    )
    with pytest.raises(PlaybookError) as error:
        check_playbook(path)
    assert "stages[0].delegates: the tool name 'delegate' is reserved for delegation" in str(
        error.value
    )


async def test_worker_tools_with_side_effects_wait_for_a_confirmed_turn(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    side_effects = TOOLS_PY.replace("@tool(side_effects=False)", "@tool")
    playbook = load_playbook(write_playbook(PLAYBOOK.replace("MODE", "parallel"), side_effects))
    llm.script(team_llm())
    client = ChatClient.connect(llm.base_url, None, "scripted")
    orchestrator = PlaybookOrchestrator(playbook, client)
    ran: list[str] = []
    asked = asyncio.Event()

    def on_event(event: OrchestratorEvent) -> None:
        if event.type == "tool_call_start":
            ran.append(event.data["worker"])
            asked.set()

    orchestrator.on(on_event)
    confirmed = asyncio.Event()
    try:
        async with orchestrator.turn("Book me a trip to Paris", confirmed) as turn:
            answer = asyncio.ensure_future(_drain(turn))
            await asyncio.wait_for(asked.wait(), 10)  # flights asked for its booking tool
            await asyncio.sleep(0.2)  # time enough for a tool that did not wait to finish
            # the hotels worker answered; flights' booking tool waits for the confirmation
            assert len(_requests_of(llm, "HOTELS PROMPT")) == 1
            assert len(_requests_of(llm, "FLIGHTS PROMPT")) == 1
            assert ran == ["flights"]
            assert not answer.done()
            confirmed.set()
            await asyncio.wait_for(answer, 10)
    finally:
        await client.aclose()
    assert turn.answer == ANSWER
    assert len(_requests_of(llm, "FLIGHTS PROMPT")) == 2


async def _drain(turn: Any) -> None:
    async for _ in turn:
        pass


async def test_a_worker_tool_marked_finish_completes_when_the_turn_is_cut_off(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    booking = (
        TOOLS_PY
        + '''

import asyncio

BOOKED = []


@tool(on_interrupt="finish")
async def find_flight(city: str) -> str:
    """Book a flight (half a booking is worse than none).

    Args:
        city: Where to.
    """
    await asyncio.sleep(0.5)
    BOOKED.append(city)
    return "booked"
'''
    )
    booking = booking.replace("@tool(side_effects=False)\ndef find_flight", "def unused")
    playbook = load_playbook(write_playbook(PLAYBOOK.replace("MODE", "parallel"), booking))
    llm.script(team_llm())
    client = ChatClient.connect(llm.base_url, None, "scripted")
    orchestrator = PlaybookOrchestrator(playbook, client)
    events: list[tuple[str, dict[str, Any]]] = []
    orchestrator.on(lambda e: events.append((e.type, e.data)))
    started = asyncio.Event()
    orchestrator.on(
        lambda e: started.set() if e.type == "tool_call_start" and e.data.get("worker") else None
    )
    try:
        async with orchestrator.turn("Book me a trip to Paris") as turn:
            answer = asyncio.ensure_future(_drain(turn))
            await asyncio.wait_for(started.wait(), 10)
            answer.cancel()  # the caller barges in while the booking runs
            with contextlib.suppress(asyncio.CancelledError):
                await answer
        booked = playbook.tools["find_flight"].function.__globals__["BOOKED"]
        assert booked == []  # still running
        for _ in range(40):
            if booked:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    assert booked == ["Paris"]  # not cut in half
    (complete,) = [d for t, d in events if t == "tool_call_complete" and d.get("worker")]
    assert (complete["worker"], complete["result"], complete["error"]) == (
        "flights",
        "booked",
        False,
    )
    assert orchestrator._delegator.finishing == set()
    assert turn.answer == ""


async def test_a_worker_runs_with_its_persona_the_conversations_language_and_its_mode(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    text = (
        PLAYBOOK.replace("MODE", "parallel")
        .replace(
            "global_system_prompt: GLOBAL PROMPT\n",
            "global_system_prompt: GLOBAL PROMPT\n"
            "persona: {role: Travel desk clerk}\n"
            "languages: {en: {name: English}, fr: {name: French}}\n"
            "language: en\n",
        )
        .replace(
            "    system_prompt: DESK PROMPT\n",
            "    system_prompt: DESK PROMPT\n    tools: [set_language]\n",
        )
        .replace(
            "    system_prompt: FLIGHTS PROMPT\n",
            "    system_prompt: FLIGHTS PROMPT\n"
            "    persona: {role: Flight finder, description: You know every timetable.}\n",
        )
        .replace(
            "    system_prompt: HOTELS PROMPT\n",
            "    system_prompt: HOTELS PROMPT\n    mode: single-shot\n    tools: [find_flight]\n",
        )
    )

    def reply(body: dict[str, Any]) -> Reply:
        system, last = _system(body), body["messages"][-1]
        if "FLIGHTS PROMPT" in system:
            return Reply(content=FLIGHT)
        if "HOTELS PROMPT" in system:
            return Reply(content=HOTEL)
        if last["role"] == "user" and "French" in last["content"]:
            return Reply(tool_calls=[ScriptedToolCall("set_language", {"language": "fr"})])
        if last["role"] == "user":
            return Reply(tool_calls=[ScriptedToolCall("delegate", {"task": "A trip to Paris."})])
        return Reply(content=ANSWER)

    llm.script(reply)
    path = write_playbook(text, TOOLS_PY)
    code, out, err = await run_vocable(
        "chat",
        str(path),
        "--json",
        stdin="Speak French please\nBook me a trip to Paris\n",
        env={"VOCABLE_LLM_BASE_URL": llm.base_url, "VOCABLE_LLM_MODEL": "m"},
    )
    assert code == 0, err

    (flights,) = [llm.requests[i] for i in _requests_of(llm, "FLIGHTS PROMPT")]
    (hotels,) = [llm.requests[i] for i in _requests_of(llm, "HOTELS PROMPT")]
    # the worker stage's own persona, else the playbook's, as the desk's prompt would have it
    assert _system(flights) == (
        "GLOBAL PROMPT\n\nYour identity:\n- Role: Flight finder\n"
        "- Description: You know every timetable.\n\nFLIGHTS PROMPT\n\n"
        f"{WORKER_NOTE}\n\nAnswer in French."
    )
    assert "Your identity:\n- Role: Travel desk clerk\n\nHOTELS PROMPT" in _system(hotels)
    # the language the conversation speaks now, not the one it started in
    assert _system(hotels).endswith("Answer in French.")
    desk = _requests_of(llm, "DESK PROMPT")
    assert _system(llm.requests[desk[0]]).endswith("Answer in English.")
    # modes: flights (playbook) is offered its tool, hotels (single-shot) none, in one call
    assert {t["function"]["name"] for t in flights["tools"]} == {"find_flight"}
    assert "tools" not in hotels
    assert _delegate_result(llm, delegation=1) == [
        {"worker": "flights", "result": FLIGHT},
        {"worker": "hotels", "result": HOTEL},
    ]
    assert _json_lines(out)[-1] == {"type": "answer", "text": ANSWER, "stage": "desk"}
