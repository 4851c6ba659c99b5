"""Stage voices, greetings after transitions and language voices in real calls (Piper, Whisper,
the loopback transport); only the LLM is scripted.

Only one Piper voice is installable here, so the stages differ by speaking rate: the switch is
measured as the length of the same sentence's audio, and read from the events' voice ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from media.audio import SAMPLE_RATE
from media.tts import default_piper_voice
from playbooks import load_playbook
from playbooks.identity import LANGUAGE_TOOL
from playbooks.loader import LoadedPlaybook
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.support.calls import VoiceCall, start_call, synthesizer, transcriber, words

pytestmark = pytest.mark.slow

SENTENCE = "The fox jumps over the lazy dog."
"""2.1 s at the base voice's rate, one chunk (nothing to split it before a phrase's first
word): long enough for a ratio of lengths; spoken five times."""
BASE_VOICE = "en_US-joe-medium"


@pytest.fixture
def playbook(tmp_path: Path) -> LoadedPlaybook:
    model, _ = default_piper_voice()
    path = tmp_path / "voices.yaml"
    path.write_text(
        f"""\
id: voices
name: Voices
initial_stage: normal
global_tools: [set_language]
languages:
  fr: {{name: French, voice: {{id: joe-fast, speaking_rate: 1.5}}}}
stages:
  - id: normal
    name: Normal
    system_prompt: Read what you are asked to.
  - id: slow
    name: Slow
    system_prompt: Read slowly.
    greeting: Welcome to the slow lane.
    voice: {{id: joe-slow, model: "{model}", speaking_rate: 0.6}}
transitions:
  - id: go_slow
    from: normal
    condition: {{type: keyword, keywords: [slowly], in: user}}
    action: {{target_stage: slow}}
  - id: hand_over
    from: normal
    condition: {{type: keyword, keywords: [transferring]}}
    action: {{target_stage: slow}}
"""
    )
    return load_playbook(path)


@pytest.fixture
async def call(llm: ScriptedLLM, playbook: LoadedPlaybook) -> AsyncIterator[VoiceCall]:
    call = start_call(playbook, llm.base_url)
    try:
        yield call
    finally:
        await call.line.stop()


async def _turn(call: VoiceCall, text: str) -> bytes:
    """Type ``text`` and return the audio of the agent's answer (16 kHz PCM16)."""
    start = len(call.line.recording)
    call.session.submit_text(text)
    await call.wait_idle()
    return call.heard_since(start)


def _voiced_ms(pcm: bytes) -> float:
    """From the first to the last clearly audible sample."""
    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, np.int16).astype(np.int32)) > 500)
    assert loud.size, "the agent said nothing"
    return float(loud[-1] - loud[0]) / SAMPLE_RATE * 1000


def _voices(call: VoiceCall, type: str) -> list[str | None]:
    return [event.data["voice"] for event in call.of_type(type)]


async def test_a_stage_voice_greets_and_speaks_slower_after_a_transition(
    llm: ScriptedLLM, call: VoiceCall
) -> None:
    llm.script([Reply(content=SENTENCE)] * 3)
    normal = await _turn(call, "Read it.")
    greeted = await _turn(call, "Read it slowly.")
    slow = await _turn(call, "Again.")

    ratio = _voiced_ms(slow) / _voiced_ms(normal)
    assert ratio >= 1.2, (ratio, _voiced_ms(normal), _voiced_ms(slow))
    assert ratio <= 2.2, ratio  # 1 / 0.6, give or take Piper's pauses
    heard = set(words((await transcriber().transcribe(greeted)).text))
    assert {"welcome", "slow", "lane"} <= heard, heard
    assert {"fox", "lazy", "dog"} <= heard, heard

    (change,) = call.of_type("stage_change")
    assert (change.data["stage"], change.data["voice"]) == ("slow", "joe-slow")
    assert _voices(call, "tts_start") == [BASE_VOICE, "joe-slow", "joe-slow"]
    sentences = [(e.data["text"], e.data["voice"]) for e in call.of_type("agent_sentence")]
    assert sentences[1:3] == [("Welcome to the slow lane.", "joe-slow"), (SENTENCE, "joe-slow")]
    # the stage names the server's own voice file: no second copy of the model was loaded
    assert len(synthesizer()._voices) == 1


async def test_set_language_switches_to_the_language_voice(
    llm: ScriptedLLM, call: VoiceCall
) -> None:
    llm.script(
        [
            Reply(content=SENTENCE),
            Reply(tool_calls=[ScriptedToolCall(LANGUAGE_TOOL, {"language": "fr"})]),
            Reply(content=SENTENCE),
        ]
    )
    normal = await _turn(call, "Read it.")
    fast = await _turn(call, "En français.")

    ratio = _voiced_ms(fast) / _voiced_ms(normal)
    assert ratio <= 0.8, ratio
    (change,) = call.of_type("language_change")
    assert change.data == {"language": "fr", "voice": "joe-fast"}
    assert _voices(call, "tts_start") == [BASE_VOICE, "joe-fast"]


async def test_an_end_of_turn_transition_finishes_the_answer_in_the_old_voice(
    llm: ScriptedLLM, call: VoiceCall
) -> None:
    llm.script([Reply(content="I am transferring you now")])  # no full stop: still buffered
    audio = await _turn(call, "Help.")

    sentences = [(e.data["text"], e.data["voice"]) for e in call.of_type("agent_sentence")]
    assert sentences == [
        ("I am transferring you now", BASE_VOICE),
        ("Welcome to the slow lane.", "joe-slow"),
    ]
    heard = set(words((await transcriber().transcribe(audio)).text))
    assert {"transferring", "welcome", "slow", "lane"} <= heard, heard
