"""Delegation in a voice call: the ``say`` line is spoken while the workers run, and their
result follows as the answer. Real webrtcvad, Whisper and Piper; only the LLM is scripted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from playbooks import load_playbook
from server.testkit.scripted_llm import Reply, ScriptedLLM
from tests.support.calls import piper_speech, start_call, synthesize_ahead, transcriber, words
from tests.test_delegation import PLAYBOOK, TOOLS_PY, team_llm

pytestmark = pytest.mark.slow

CALLER = "Book me a trip to Paris."
SAY = "Let me check with the team."


@pytest.fixture(scope="module", autouse=True)
def _caller_speech_ready() -> None:
    synthesize_ahead(CALLER)


async def test_the_say_line_is_spoken_while_workers_run_then_the_answer(
    llm: ScriptedLLM, write_playbook: Callable[..., Path]
) -> None:
    playbook = load_playbook(write_playbook(PLAYBOOK.replace("MODE", "parallel"), TOOLS_PY))
    # the hotels worker takes a while: the line is heard before the workers are done
    llm.script(team_llm(Reply(content="Hotel Lumiere has a room.", first_token_delay_s=2.0)))
    call = start_call(playbook, llm.base_url)
    try:
        await call.say(piper_speech(CALLER), trailing_silence_ms=200)
        await call.wait_event("delegation_end")
        await call.wait_idle()
    finally:
        await call.line.stop()

    sentences = [e.data["text"] for e in call.of_type("agent_sentence")]
    assert sentences[0] == SAY
    assert "You fly VB123 at nine" in " ".join(sentences[1:])
    # the line started playing before the workers finished: it did not hold them up
    (said,) = [e for e in call.of_type("agent_sentence") if e.data["text"] == SAY]
    (ended,) = call.of_type("delegation_end")
    assert said.t < ended.t
    assert [w["worker"] for w in ended.data["workers"]] == ["flights", "hotels"]

    heard = words((await transcriber().transcribe(call.heard_since(0))).text)
    assert {"check", "team"} <= set(heard), heard
    assert heard.index("team") < heard.index("nine"), heard
    # the line is not part of the answer: history holds the answer as it was streamed
    assert call.orchestrator.conversation.messages[-1] == {
        "role": "assistant",
        "content": "You fly VB123 at nine and stay at Hotel Lumiere.",
    }
    (metrics,) = call.of_type("turn_metrics")
    assert metrics.data["llm_first_token_ms"] is not None
