"""Stage personas, greetings after transitions and ``set_language``, through ``vocable chat
--json`` (a real subprocess and the scripted LLM), plus the loader's checks of these fields."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from playbooks import PlaybookError, load_playbook
from playbooks.identity import LANGUAGE_TOOL
from server.testkit.scripted_llm import Reply, ScriptedLLM, ScriptedToolCall
from tests.support.processes import run_vocable
from tests.test_cli import _json_lines

DESK = """\
id: desk
name: Front desk
initial_stage: reception
global_system_prompt: You answer the phone for Acme.
persona: {role: Receptionist, description: You greet callers and route them.}
languages:
  fr: {name: French, instruction: Réponds en français.}
  de: {name: German}
global_tools: [set_language]
stages:
  - id: reception
    name: Reception
    system_prompt: Find out what the caller needs.
    greeting: Hello, Acme front desk.
  - id: billing
    name: Billing
    system_prompt: Help with invoices.
    persona: {role: Billing specialist, description: You handle invoices and refunds.}
    greeting: Hi, this is billing.
transitions:
  - id: to_billing
    from: reception
    condition: {type: keyword, keywords: [invoice], in: user}
    action: {target_stage: billing}
  - id: hand_over
    from: reception
    condition: {type: keyword, keywords: [transferring]}
    action: {target_stage: billing}
"""


async def _chat(llm: ScriptedLLM, playbook: Path, *lines: str) -> list[dict[str, Any]]:
    code, out, err = await run_vocable(
        "chat",
        str(playbook),
        "--json",
        "--llm-base-url",
        llm.base_url,
        stdin="".join(f"{line}\n" for line in lines),
    )
    assert code == 0, err
    return _json_lines(out)


def _system(request: dict[str, Any]) -> str:
    first = request["messages"][0]
    assert first["role"] == "system"
    return str(first["content"])


@pytest.fixture
def desk(write_playbook: Callable[..., Path]) -> Path:
    return write_playbook(DESK)


async def test_the_stage_persona_is_the_identity_block_of_the_prompt(
    llm: ScriptedLLM, desk: Path
) -> None:
    llm.script([Reply(content="How can I help?"), Reply(content="Which invoice is it?")])
    await _chat(llm, desk, "hello", "a question about an invoice")

    reception, billing = (_system(r) for r in llm.requests)
    assert "Your identity:\n- Role: Receptionist\n- Description: You greet callers" in reception
    # after the global prompt, before the stage's own
    assert reception.index("You answer the phone") < reception.index("Your identity:")
    assert reception.index("Role: Receptionist") < reception.index("Find out what")
    # the billing stage's persona replaces the playbook's
    assert "- Role: Billing specialist" in billing
    assert "You handle invoices and refunds." in billing
    assert "Receptionist" not in billing


async def test_a_transition_into_a_stage_says_its_greeting_before_the_answer(
    llm: ScriptedLLM, desk: Path
) -> None:
    llm.script([Reply(content="Sure, which invoice?"), Reply(content="Got it.")])
    lines = await _chat(llm, desk, "I have a question about an invoice", "number 42")
    types = [line["type"] for line in lines]

    assert lines[0] == {"type": "greeting", "text": "Hello, Acme front desk."}  # the call's start
    entered = types.index("stage_entered")
    greeting = lines[types.index("greeting", 1)]
    assert greeting == {"type": "greeting", "stage": "billing", "text": "Hi, this is billing."}
    assert entered < types.index("greeting", 1) < types.index("answer")
    answers = [line["text"] for line in lines if line["type"] == "answer"]
    assert answers == ["Hi, this is billing. Sure, which invoice?", "Got it."]
    assert types.count("greeting") == 2  # said once, not again on the next turn
    # the LLM knew it had been said, and the history holds it
    assert 'you greet the caller with: "Hi, this is billing."' in _system(llm.requests[0])
    assert "greet" not in _system(llm.requests[1])
    assert llm.requests[1]["messages"][-2] == {
        "role": "assistant",
        "content": "Hi, this is billing. Sure, which invoice?",
    }


async def test_an_end_of_turn_transition_greets_after_the_answer(
    llm: ScriptedLLM, desk: Path
) -> None:
    llm.script([Reply(content="I am transferring you to billing."), Reply(content="Yes?")])
    lines = await _chat(llm, desk, "I need help", "hello?")
    types = [line["type"] for line in lines]

    first_answer = types.index("answer")
    assert types.index("phase2_complete") < types.index("stage_entered") < first_answer
    assert lines[types.index("greeting", 1)]["stage"] == "billing"
    assert lines[first_answer]["text"] == "I am transferring you to billing. Hi, this is billing."
    assert lines[first_answer]["stage"] == "billing"
    history = llm.requests[1]["messages"]
    assert history[-2]["content"] == "I am transferring you to billing. Hi, this is billing."


async def test_set_language_changes_the_language_line_of_the_next_requests(
    llm: ScriptedLLM, desk: Path
) -> None:
    llm.script(
        [
            Reply(content="Hello!"),
            Reply(tool_calls=[ScriptedToolCall(LANGUAGE_TOOL, {"language": "fr"})]),
            Reply(content="Bien sûr."),
            Reply(tool_calls=[ScriptedToolCall(LANGUAGE_TOOL, {"language": "German"})]),
            Reply(content="Natürlich."),
        ]
    )
    lines = await _chat(llm, desk, "hi", "en français s'il vous plaît", "auf Deutsch bitte")

    prompts = [_system(r) for r in llm.requests]
    assert not any("Réponds" in p or "Answer in" in p for p in prompts[:2])
    assert prompts[2].endswith("Réponds en français.")  # the answer after the tool call
    assert prompts[3].endswith("Réponds en français.")  # and the next turn's
    assert prompts[4].endswith("Answer in German.")  # by name; the default line
    (tool,) = [t for t in llm.requests[0]["tools"] if t["function"]["name"] == LANGUAGE_TOOL]
    assert tool["function"]["parameters"]["properties"]["language"]["enum"] == ["fr", "de"]

    changes = [line for line in lines if line["type"] == "language_changed"]
    assert changes == [
        {"type": "language_changed", "language": "fr", "instruction": "Réponds en français."},
        {"type": "language_changed", "language": "de", "instruction": "Answer in German."},
    ]
    results = [json.loads(m["content"]) for m in llm.requests[2]["messages"] if m["role"] == "tool"]
    assert results == [{"language": "fr", "instruction": "Réponds en français."}]


async def test_set_language_refuses_a_language_the_playbook_does_not_offer(
    llm: ScriptedLLM, desk: Path
) -> None:
    llm.script(
        [
            Reply(tool_calls=[ScriptedToolCall(LANGUAGE_TOOL, {"language": "Klingon"})]),
            Reply(content="Sorry, I cannot."),
        ]
    )
    lines = await _chat(llm, desk, "speak Klingon")
    assert not [line for line in lines if line["type"] == "language_changed"]
    (error,) = [line for line in lines if line["type"] == "error"]
    assert error["source"] == "tool_call"
    assert "one of ['de', 'fr']" in error["message"]
    assert "Answer in" not in _system(llm.requests[1])


def test_a_start_language_puts_its_line_in_the_prompt_from_the_first_turn(
    write_playbook: Callable[..., Path],
) -> None:
    from playbooks import PlaybookEngine

    path = write_playbook(DESK.replace("global_tools:", "language: de\nglobal_tools:"))
    engine = PlaybookEngine(load_playbook(path))
    assert engine.system_prompt().endswith("Answer in German.")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("    greeting: Hi, this is billing.\n", "    voice: {model: nowhere.onnx}\n"),
            "stages[1].voice.model: Piper voice file not found:",
        ),
        (("global_tools:", "language: es\nglobal_tools:"), "language: unknown language 'es'"),
        (("global_tools: [set_language]", "global_tools: [set_lang]"), "unknown tool 'set_lang'"),
        (("{role: Receptionist, description:", "{description:"), "persona.role: Field required"),
    ],
)
def test_the_loader_names_a_wrong_identity_field(
    write_playbook: Callable[..., Path], change: tuple[str, str], expected: str
) -> None:
    path = write_playbook(DESK.replace(*change))
    with pytest.raises(PlaybookError) as raised:
        load_playbook(path)
    assert expected in str(raised.value)


def test_a_tools_module_may_not_define_the_built_in_tool(
    write_playbook: Callable[..., Path],
) -> None:
    path = write_playbook(
        DESK.replace("id: desk", "id: desk\ntools_module: tools.py"),
        "from playbooks import tool\n\n@tool\ndef set_language(language: str) -> str:\n"
        '    """Mine."""\n    return language\n',
    )
    with pytest.raises(PlaybookError, match="reserved for the built-in tool"):
        load_playbook(path)


def test_voice_model_paths_are_relative_to_the_playbook(
    write_playbook: Callable[..., Path], tmp_path: Path
) -> None:
    from playbooks import PlaybookEngine

    (tmp_path / "voices").mkdir()
    (tmp_path / "voices" / "anna.onnx").write_bytes(b"")
    (tmp_path / "voices" / "anna.onnx.json").write_text("{}")
    text = DESK.replace(
        "    greeting: Hi, this is billing.\n",
        "    greeting: Hi, this is billing.\n"
        "    voice: {model: voices/anna.onnx, speaking_rate: 0.8}\n",
    ).replace("  de: {name: German}", "  de: {name: German, voice: {id: anna-de, speaker: 2}}")
    engine = PlaybookEngine(load_playbook(write_playbook(text)))
    assert engine.voice() is None  # reception: the server's voice
    engine.stage = engine.playbook.spec.stage("billing")
    voice = engine.voice()
    assert voice is not None
    assert voice.model == str(tmp_path / "voices" / "anna.onnx")
    assert (voice.speaking_rate, voice.id) == (0.8, None)
    engine.set_language("de")  # the language's voice goes over the stage's, field by field
    voice = engine.voice()
    assert voice is not None
    assert (voice.id, voice.speaker, voice.speaking_rate) == ("anna-de", 2, 0.8)
