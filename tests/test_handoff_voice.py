"""Handoff with a summary in a voice call: the caller's spoken question moves the call to another
stage through ``playbook_transition`` with a ``summary``; the new stage greets, answers from the
summary alone (``clear_history``) and is heard; and a handoff begun on words the caller then
speaks on from is undone for clients too. Real webrtcvad, Whisper and Piper; only the LLM is
scripted."""

from __future__ import annotations

from typing import Any

import pytest

from media.audio import silence
from playbooks import load_playbook
from playbooks.loader import LoadedPlaybook
from server.call.endpointing import EndpointSettings
from server.call.session import SessionSettings
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.support.calls import (
    VoiceCall,
    piper_speech,
    start_call,
    synthesize_ahead,
    transcriber,
    words,
)
from tests.support.timed_stt import primed
from tests.test_handoff import NOTE, PLAYBOOK, SUMMARY

pytestmark = pytest.mark.slow

GREETING = "Welcome to billing. I have your notes."
ANSWER = "I will refund the double charge."  # short: heard out in real time, words checked
FIRST_ANSWER = "Go on."

OPENING = "I have a question about my bill."
QUESTION = "I was charged twice for the same invoice."
CHANGE = "I want to talk to billing."
AFTERTHOUGHT = "Actually never mind."

MOVE = {"target_stage": "billing", "reason": "a billing question", "summary": SUMMARY}


@pytest.fixture(scope="module")
def playbook(tmp_path_factory: pytest.TempPathFactory) -> LoadedPlaybook:
    synthesize_ahead(OPENING, QUESTION, CHANGE, AFTERTHOUGHT)  # before any call's clock runs
    billing = "    system_prompt: BILLING PROMPT\n"
    assert billing in PLAYBOOK
    path = tmp_path_factory.mktemp("handoff") / "handoff.yaml"
    path.write_text(PLAYBOOK.replace(billing, f"{billing}    greeting: {GREETING}\n"))
    return load_playbook(path)


def _reply(body: dict[str, Any]) -> Reply:
    """By what is asked, not by the order of requests: in a voice call a request may start early
    on part of the caller's words and be undone."""
    system = str(body["messages"][0]["content"])
    last = words(str(body["messages"][-1]["content"]))
    if "BILLING PROMPT" in system:
        return Reply(content=ANSWER)
    if "twice" in last or "charged" in last:
        return Reply(tool_calls=[ScriptedToolCall("playbook_transition", MOVE)])
    return Reply(content=FIRST_ANSWER)


def _system(request: dict[str, Any]) -> str:
    return str(request["messages"][0]["content"])


def _transcribed(call: VoiceCall, *keys: str) -> str:
    """The transcript the call answered for the caller's words with one of ``keys``."""
    found = [
        str(e.data["text"])
        for e in call.of_type("transcript")
        if set(keys) & set(words(str(e.data["text"])))
    ]
    assert found, [e.data for e in call.of_type("transcript")]
    return found[-1]


async def test_a_spoken_handoff_greets_in_the_new_stage_and_answers_from_the_summary(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    llm.script(_reply)
    call = start_call(playbook, llm.base_url)
    calls.append(call)

    # an exchange in the first stage, for the handoff to leave behind
    await call.say(piper_speech(OPENING), trailing_silence_ms=200)
    await call.wait_idle()
    assert call.orchestrator.engine.stage.id == "intake"
    assert not call.of_type("stage_change")

    start = len(call.line.recording)
    await call.say(piper_speech(QUESTION), trailing_silence_ms=200)
    await call.wait_event("stage_change")
    await call.wait_idle()
    heard_audio = call.heard_since(start)

    # the call entered the target stage, through the LLM's decision, with the summary
    (change,) = call.of_type("stage_change")
    assert change.data["stage"] == "billing", change.data
    assert call.orchestrator.engine.stage.id == "billing"
    (triggered,) = [e for _, e in call.llm_events if e.type == "transition_triggered"]
    assert triggered.data["transition"]["to"] == "billing"
    assert triggered.data["transition"]["summary"] == SUMMARY

    # the request that decided the handoff: the first stage, with the earlier turn in it
    streamed = [r for r in llm.requests if r.get("stream")]
    (handoff_at,) = [
        i
        for i, r in enumerate(streamed)
        if "INTAKE PROMPT" in _system(r) and "twice" in words(str(r["messages"][-1]["content"]))
    ]
    decided = streamed[handoff_at]
    assert NOTE not in _system(decided)
    opening = _transcribed(call, "question", "bill")
    assert {"role": "user", "content": opening} in decided["messages"]
    assert {"role": "assistant", "content": FIRST_ANSWER} in decided["messages"]

    # the next request, in the target stage: its prompt carries the summary, and the cleared
    # history holds only the summary and the words being answered
    question = _transcribed(call, "twice", "charged")
    (answer_request,) = streamed[handoff_at + 1 :]
    assert "BILLING PROMPT" in _system(answer_request)
    assert "INTAKE PROMPT" not in _system(answer_request)
    assert NOTE in _system(answer_request)
    assert f'you greet the caller with: "{GREETING}"' in _system(answer_request)
    assert answer_request["messages"][1:] == [
        {"role": "assistant", "content": NOTE},
        {"role": "user", "content": question},
    ]

    # the greeting, then the answer, in the new stage, heard by the caller
    sentences = [e.data["text"] for e in call.of_type("agent_sentence")]
    assert " ".join(sentences) == f"{FIRST_ANSWER} {GREETING} {ANSWER}", sentences
    heard = words((await transcriber().transcribe(heard_audio)).text)
    assert {"welcome", "billing", "notes"} <= set(heard), heard
    assert {"double", "charge", "refund"} <= set(heard), heard
    assert heard.index("welcome") < heard.index("double"), heard
    assert call.voice.heard == f"{GREETING} {ANSWER}"
    assert call.orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": f"{GREETING} {ANSWER}",
    }


async def test_an_undone_preemptive_handoff_leaves_clients_in_the_stage_the_call_is_in(
    llm: ScriptedLLM, playbook: LoadedPlaybook, calls: list[VoiceCall]
) -> None:
    def reply(body: dict[str, Any]) -> Reply:
        last = words(str(body["messages"][-1]["content"]))
        if "BILLING PROMPT" in _system(body):
            return Reply(content=ANSWER)
        if "never" in last or "mind" in last:
            return Reply(content="No problem.")
        return Reply(tool_calls=[ScriptedToolCall("playbook_transition", MOVE)])

    llm.script(reply)
    # a long end-of-turn silence, and an answer started at 500 ms of silence on words known
    # by then, so the answer to the words before the pause surely starts (preempted) and the
    # caller surely speaks on before the turn ends
    endpoint = EndpointSettings(
        complete_silence_ms=2500, incomplete_silence_ms=2500, preempt_lead_ms=2000
    )
    speech = piper_speech(CHANGE) + silence(1200) + piper_speech(AFTERTHOUGHT) + silence(200)
    stt = await primed(0.0, speech)
    call = start_call(
        playbook, llm.base_url, settings=SessionSettings(greet=False, endpoint=endpoint), stt=stt
    )
    calls.append(call)
    await call.say(speech)
    await call.wait_event("turn_metrics")
    await call.wait_idle()

    # what the call went through: the handoff started on "...billing." was undone
    moved = [e for _, e in call.llm_events if e.type == "transition_triggered"]
    if not moved or call.session.speculations["preempted_wasted"] < 1:
        pytest.fail(f"no undone preemptive handoff: {[(e.type, e.data) for e in call.events]}")
    if call.orchestrator.engine.stage.id != "intake":
        pytest.fail(f"the handoff was not undone: {call.orchestrator.engine.stage.id}")
    sentences = [e.data["text"] for e in call.of_type("agent_sentence")]
    if sentences != ["No problem."]:
        pytest.fail(f"the undone answer was heard: {sentences}")

    # the stage the clients were last told about is the one the call is in
    told = [e.data["stage"] for e in call.of_type("stage_change")]
    assert told == ["billing", "intake"]
    assert call.orchestrator.engine.stage.id == "intake"
