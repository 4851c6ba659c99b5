"""Loading playbook files: valid YAML/JSON (snake_case and camelCase), and one clear error each."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from playbooks import PlaybookError, load_playbook, load_playbooks
from playbooks.errors import MAX_PROBLEMS, LineMap, Problem
from playbooks.models import (
    CustomCondition,
    IntentCondition,
    KeywordCondition,
    LLMDecisionCondition,
    MaxTurnsCondition,
    NamedToolChoice,
    TimeoutCondition,
    ToolCallCondition,
)
from tests.conftest import EXAMPLES, REPO

WritePlaybook = Callable[..., Path]

TOOLS_PY = '''
from playbooks import tool


@tool
def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order.

    Args:
        order_id: The order number.
    """
    return {"order_id": order_id}


@tool
def cancel_order(order_id: str) -> str:
    """Cancel an order."""
    return "cancelled"


def is_vip(context):
    return False


def _private_helper(context):
    return True
'''

# A valid playbook; the error tests below change one thing in it at a time.
VALID = """\
id: shop
name: Shop line
description: Orders.
initial_stage: greeting
tools_module: tools.py
global_system_prompt: Be brief.
global_tools: [lookup_order]
default_llm_config: {model: small, temperature: 0.3, max_tokens: 200, top_p: 0.9}
stages:
  - id: greeting
    name: Greeting
    system_prompt: Say hello.
    greeting: Hello!
    two_phase_execution: false
  - id: help
    name: Help
    description: Help with the order.
    system_prompt: Help.
    tools: [cancel_order]
    llm_config: {temperature: 0.1}
    tool_choice: {type: tool, tool_name: cancel_order}
    max_turns: 3
    timeout_ms: 60000
  - id: bye
    name: Bye
    system_prompt: Say goodbye.
    tool_choice: none
transitions:
  - id: to_help
    from: greeting
    condition: {type: keyword, keywords: [order, parcel], in: user}
    action: {target_stage: help}
  - id: by_llm
    from: greeting
    condition: {type: llm_decision}
    action: {target_stage: help}
    description: The caller needs help.
  - id: cancelled
    from: help
    priority: 5
    condition: {type: tool_call, tool_name: cancel_order}
    action:
      target_stage: bye
      transition_message: The order was cancelled.
      clear_history: true
      data: {outcome: cancelled}
  - id: wants_out
    from: "*"
    priority: 10
    condition: {type: intent, intent: goodbye, confidence: 0.8}
    action: {target_stage: bye}
  - id: too_long
    from: help
    condition: {type: max_turns}
    action: {target_stage: bye}
  - id: too_slow
    from: help
    condition: {type: timeout}
    action: {target_stage: bye}
  - id: vip
    from: help
    condition: {type: custom, function: is_vip}
    action: {target_stage: bye}
"""


def load_error(path: Path) -> PlaybookError:
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    error = caught.value
    assert "\n" not in str(error), "a loading error is one line"
    return error


def load_errors(path: Path) -> PlaybookError:
    """What loading ``path`` raised: one line per problem (at most MAX_PROBLEMS, then a count),
    each naming the file."""
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    error = caught.value
    lines = str(error).split("\n")
    assert lines == error.lines()
    assert lines[:MAX_PROBLEMS] == [str(problem) for problem in error.problems[:MAX_PROBLEMS]]
    assert all(line.startswith(path.name) for line in lines[:MAX_PROBLEMS])
    return error


def variant(old: str, new: str) -> str:
    assert VALID.count(old) == 1, f"ambiguous edit {old!r}"
    return VALID.replace(old, new)


# -- valid playbooks -------------------------------------------------------------------------------


def test_valid_yaml_loads_with_tools_and_functions(write_playbook: WritePlaybook) -> None:
    path = write_playbook(VALID, TOOLS_PY)
    loaded = load_playbook(path)
    spec = loaded.spec

    assert loaded.source == path
    assert (spec.id, spec.name, spec.description) == ("shop", "Shop line", "Orders.")
    assert spec.initial_stage == "greeting"
    assert spec.global_system_prompt == "Be brief."
    assert spec.global_tools == ["lookup_order"]
    assert spec.default_llm_config.model == "small"
    assert spec.default_llm_config.temperature == 0.3
    assert spec.default_llm_config.max_tokens == 200
    assert spec.default_llm_config.top_p == 0.9
    assert [s.id for s in spec.stages] == ["greeting", "help", "bye"]
    assert [t.id for t in spec.transitions] == [
        "to_help",
        "by_llm",
        "cancelled",
        "wants_out",
        "too_long",
        "too_slow",
        "vip",
    ]

    greeting, help_stage, bye = spec.stages
    assert greeting.greeting == "Hello!"
    assert greeting.two_phase_execution is False
    assert greeting.tool_choice == "auto"
    assert greeting.tools == []
    assert greeting.max_turns is None
    assert greeting.timeout_ms is None
    assert help_stage.description == "Help with the order."
    assert help_stage.tools == ["cancel_order"]
    assert help_stage.two_phase_execution is True
    assert help_stage.llm_config.temperature == 0.1
    assert help_stage.tool_choice == NamedToolChoice(tool_name="cancel_order")
    assert (help_stage.max_turns, help_stage.timeout_ms) == (3, 60000)
    assert bye.tool_choice == "none"

    to_help, by_llm, cancelled, wants_out, too_long, too_slow, vip = spec.transitions
    assert to_help.from_stage == "greeting"
    assert to_help.priority == 0
    assert isinstance(to_help.condition, KeywordCondition)
    assert to_help.condition.keywords == ["order", "parcel"]
    assert to_help.condition.match_in == "user"
    assert to_help.action.target_stage == "help"
    assert to_help.action.transition_message is None
    assert to_help.action.clear_history is False
    assert to_help.action.data == {}
    assert isinstance(by_llm.condition, LLMDecisionCondition)
    assert by_llm.description == "The caller needs help."
    assert cancelled.priority == 5
    assert cancelled.condition == ToolCallCondition(type="tool_call", tool_name="cancel_order")
    assert cancelled.action.transition_message == "The order was cancelled."
    assert cancelled.action.clear_history is True
    assert cancelled.action.data == {"outcome": "cancelled"}
    assert wants_out.from_stage == "*"
    assert wants_out.condition == IntentCondition(type="intent", intent="goodbye", confidence=0.8)
    assert too_long.condition == MaxTurnsCondition(type="max_turns", count=None)
    assert too_slow.condition == TimeoutCondition(type="timeout", duration_ms=None)
    assert vip.condition == CustomCondition(type="custom", function="is_vip")

    assert set(loaded.tools) == {"lookup_order", "cancel_order"}
    assert loaded.tools["lookup_order"].description == "Look up an order."
    assert set(loaded.functions) == {"is_vip"}, "tools and private helpers are not functions"


def test_keyword_condition_defaults_to_the_assistant(write_playbook: WritePlaybook) -> None:
    path = write_playbook(
        variant(
            "{type: keyword, keywords: [order, parcel], in: user}",
            "{type: keyword, keywords: [order]}",
        ),
        TOOLS_PY,
    )
    condition = load_playbook(path).spec.transitions[0].condition
    assert isinstance(condition, KeywordCondition)
    assert condition.match_in == "assistant"


def test_intent_confidence_defaults(write_playbook: WritePlaybook) -> None:
    path = write_playbook(
        variant("{type: intent, intent: goodbye, confidence: 0.8}", "{type: intent, intent: bye}"),
        TOOLS_PY,
    )
    condition = load_playbook(path).spec.transitions[3].condition
    assert isinstance(condition, IntentCondition)
    assert condition.confidence == 0.7


def test_valid_json_loads(write_playbook: WritePlaybook) -> None:
    document = {
        "id": "json_book",
        "name": "JSON book",
        "initial_stage": "a",
        "stages": [
            {"id": "a", "name": "A", "system_prompt": "Stage A."},
            {"id": "b", "name": "B", "system_prompt": "Stage B.", "max_turns": 2},
        ],
        "transitions": [
            {
                "id": "a_to_b",
                "from": "a",
                "priority": 2,
                "condition": {"type": "keyword", "keywords": ["next"], "in": "either"},
                "action": {"target_stage": "b", "data": {"n": 1}},
            },
            {
                "id": "b_to_a",
                "from": "b",
                "condition": {"type": "max_turns"},
                "action": {"target_stage": "a"},
            },
        ],
    }
    path = write_playbook(json.dumps(document, indent=2), name="book.json")
    loaded = load_playbook(path)
    assert loaded.spec.id == "json_book"
    assert [s.id for s in loaded.spec.stages] == ["a", "b"]
    first = loaded.spec.transitions[0]
    assert first.priority == 2
    assert isinstance(first.condition, KeywordCondition)
    assert first.condition.match_in == "either"
    assert first.action.data == {"n": 1}
    assert dict(loaded.tools) == {}
    assert dict(loaded.functions) == {}


def test_yml_suffix_loads(write_playbook: WritePlaybook) -> None:
    path = write_playbook(VALID, TOOLS_PY, name="shop.yml")
    assert load_playbook(path).spec.id == "shop"


def test_camel_case_aliases_are_accepted(write_playbook: WritePlaybook) -> None:
    camel = """\
    id: camel
    name: Camel
    initialStage: start
    toolsModule: tools.py
    globalSystemPrompt: Global.
    globalTools: [lookup_order]
    defaultLlmConfig: {maxTokens: 100, topP: 0.5}
    stages:
      - id: start
        name: Start
        systemPrompt: Start prompt.
        twoPhaseExecution: false
        toolChoice: {type: tool, toolName: lookup_order}
        llmConfig: {model: m, maxTokens: 50}
        maxTurns: 2
        timeoutMs: 5000
      - id: end
        name: End
        systemPrompt: End prompt.
        tools: [cancel_order]
    transitions:
      - id: by_tool
        from: start
        condition: {type: tool_call, toolName: lookup_order}
        action:
          targetStage: end
          transitionMessage: Moved.
          clearHistory: true
          data: {k: v}
      - id: by_time
        from: start
        condition: {type: timeout, durationMs: 1500}
        action: {targetStage: end}
      - id: by_turns
        from: "*"
        condition: {type: max_turns, count: 4}
        action: {targetStage: start}
    """
    loaded = load_playbook(write_playbook(camel, TOOLS_PY))
    spec = loaded.spec
    assert spec.initial_stage == "start"
    assert spec.tools_module == "tools.py"
    assert spec.global_system_prompt == "Global."
    assert spec.global_tools == ["lookup_order"]
    assert (spec.default_llm_config.max_tokens, spec.default_llm_config.top_p) == (100, 0.5)
    start = spec.stage("start")
    assert start.system_prompt == "Start prompt."
    assert start.two_phase_execution is False
    assert start.tool_choice == NamedToolChoice(tool_name="lookup_order")
    assert (start.llm_config.model, start.llm_config.max_tokens) == ("m", 50)
    assert (start.max_turns, start.timeout_ms) == (2, 5000)
    by_tool, by_time, by_turns = spec.transitions
    assert by_tool.condition == ToolCallCondition(type="tool_call", tool_name="lookup_order")
    assert by_tool.action.target_stage == "end"
    assert by_tool.action.transition_message == "Moved."
    assert by_tool.action.clear_history is True
    assert by_tool.action.data == {"k": "v"}
    assert by_time.condition == TimeoutCondition(type="timeout", duration_ms=1500)
    assert by_turns.condition == MaxTurnsCondition(type="max_turns", count=4)


def test_support_example_loads() -> None:
    loaded = load_playbook(EXAMPLES / "support.yaml")
    spec = loaded.spec
    assert spec.id == "support"
    assert spec.initial_stage == "greeting"
    assert [s.id for s in spec.stages] == ["greeting", "identify", "order_help", "farewell"]
    assert {"lookup_order", "cancel_order"} <= set(loaded.tools)
    kinds = {t.condition.type for t in spec.transitions}
    assert {"keyword", "tool_call", "llm_decision", "max_turns", "timeout"} <= kinds


def test_restaurant_example_loads() -> None:
    loaded = load_playbook(EXAMPLES / "restaurant.yaml")
    spec = loaded.spec
    assert spec.id == "restaurant"
    assert {"opening_hours", "check_availability", "book_table"} <= set(loaded.tools)
    assert "is_large_party" in loaded.functions
    assert {t.condition.type for t in spec.transitions} >= {"intent", "custom", "tool_call"}


def test_load_playbooks_from_a_folder_keys_by_id() -> None:
    loaded = load_playbooks(EXAMPLES)
    assert set(loaded) == {"support", "restaurant"}
    assert loaded["support"].spec.name == "Acme customer support"


def test_load_playbooks_rejects_duplicate_ids(write_playbook: WritePlaybook) -> None:
    write_playbook(VALID, TOOLS_PY, name="a.yaml")
    second = write_playbook(VALID, name="b.yaml")
    with pytest.raises(PlaybookError) as caught:
        load_playbooks(second.parent)
    assert str(caught.value) == "b.yaml: id: duplicate playbook id 'shop'"


def test_load_playbooks_of_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(PlaybookError, match=r"no playbook files"):
        load_playbooks(tmp_path)


# -- one clear error per problem -------------------------------------------------------------------


def test_unreadable_file(tmp_path: Path) -> None:
    error = load_error(tmp_path / "absent.yaml")
    assert "absent.yaml" in error.source
    assert "cannot read file" in str(error)


def test_unknown_initial_stage(write_playbook: WritePlaybook) -> None:
    text = variant("initial_stage: greeting", "initial_stage: lobby")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:4: initial_stage: unknown stage 'lobby'"
    assert (error.source, error.path) == ("playbook.yaml", "initial_stage")


def test_duplicate_stage_id(write_playbook: WritePlaybook) -> None:
    """Renaming stage bye also leaves the transitions to it without a stage: each is listed."""
    error = load_errors(write_playbook(variant("  - id: bye\n", "  - id: help\n"), TOOLS_PY))
    assert error.lines() == [
        "playbook.yaml:24: stages[2].id: duplicate stage id 'help'",
        *(
            f"playbook.yaml:{line}: transitions[{i}].action.target_stage: unknown stage 'bye'"
            for i, line in [(2, 43), (3, 51), (4, 55), (5, 59), (6, 63)]
        ),
    ]


def test_duplicate_transition_id(write_playbook: WritePlaybook) -> None:
    error = load_error(
        write_playbook(variant("  - id: too_slow\n", "  - id: cancelled\n"), TOOLS_PY)
    )
    assert str(error) == "playbook.yaml:56: transitions[5].id: duplicate transition id 'cancelled'"


def test_transition_from_unknown_stage(write_playbook: WritePlaybook) -> None:
    text = variant("id: by_llm\n    from: greeting", "id: by_llm\n    from: lobby")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:34: transitions[1].from: unknown stage 'lobby'"


def test_transition_to_unknown_stage(write_playbook: WritePlaybook) -> None:
    text = variant(
        "{type: llm_decision}\n    action: {target_stage: help}",
        "{type: llm_decision}\n    action: {target_stage: billing}",
    )
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == (
        "playbook.yaml:36: transitions[1].action.target_stage: unknown stage 'billing'"
    )


def test_unknown_stage_tool(write_playbook: WritePlaybook) -> None:
    error = load_error(
        write_playbook(variant("tools: [cancel_order]", "tools: [cancel_order, refund]"), TOOLS_PY)
    )
    assert error.path == "stages[1].tools[1]"
    assert str(error).startswith("playbook.yaml:19: stages[1].tools[1]: unknown tool 'refund'")
    assert "cancel_order, lookup_order" in str(error), "names the tools that do exist"


def test_a_question_for_no_argument_of_the_stages_tools(write_playbook: WritePlaybook) -> None:
    asking = "tools: [cancel_order]\n    questions: {order_id: Which order, reason: Why}"
    error = load_error(write_playbook(variant("tools: [cancel_order]", asking), TOOLS_PY))
    assert error.path == "stages[1].questions.reason"
    assert str(error).startswith(
        "playbook.yaml:20: stages[1].questions.reason: no tool of this stage takes 'reason'"
    )
    assert "(their arguments: order_id)" in str(error)


def test_unknown_global_tool(write_playbook: WritePlaybook) -> None:
    error = load_error(
        write_playbook(variant("global_tools: [lookup_order]", "global_tools: [weather]"), TOOLS_PY)
    )
    assert str(error).startswith("playbook.yaml:7: global_tools[0]: unknown tool 'weather'")


def test_tools_without_a_tools_module(write_playbook: WritePlaybook) -> None:
    text = """\
    id: p
    name: P
    initial_stage: a
    stages:
      - {id: a, name: A, system_prompt: x, tools: [lookup_order]}
    """
    error = load_error(write_playbook(text))
    assert str(error) == (
        "playbook.yaml:5: stages[0].tools[0]: "
        "unknown tool 'lookup_order' (tools module defines: none)"
    )


def test_unknown_tool_in_tool_call_condition(write_playbook: WritePlaybook) -> None:
    text = variant("{type: tool_call, tool_name: cancel_order}", "{type: tool_call, tool_name: x}")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.path == "transitions[2].condition.tool_name"
    assert "unknown tool 'x'" in str(error)


def test_named_tool_choice_must_be_offered_in_the_stage(write_playbook: WritePlaybook) -> None:
    text = variant("tool_choice: none", "tool_choice: {type: tool, tool_name: cancel_order}")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == (
        "playbook.yaml:27: stages[2].tool_choice.tool_name: "
        "tool 'cancel_order' is not offered in stage 'bye'"
    )


def test_unknown_custom_function(write_playbook: WritePlaybook) -> None:
    text = variant("function: is_vip", "function: is_gold")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.path == "transitions[6].condition.function"
    assert str(error) == (
        "playbook.yaml:62: transitions[6].condition.function: "
        "unknown function 'is_gold' (define it in the tools module)"
    )


@pytest.mark.parametrize("name", ["_private_helper", "lookup_order", "tool"])
def test_custom_function_must_be_a_plain_public_function_of_the_module(
    write_playbook: WritePlaybook, name: str
) -> None:
    error = load_error(write_playbook(variant("function: is_vip", f"function: {name}"), TOOLS_PY))
    assert error.path == "transitions[6].condition.function"
    assert f"unknown function {name!r}" in str(error)


def test_unknown_condition_type(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("{type: llm_decision}", "{type: magic}"), TOOLS_PY))
    assert error.path == "transitions[1].condition"
    message = str(error)
    assert message.startswith("playbook.yaml:35: transitions[1].condition: unknown condition type")
    assert "'magic'" in message
    for known in ("keyword", "tool_call", "intent", "llm_decision", "max_turns", "timeout"):
        assert f"'{known}'" in message


def test_condition_without_type(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("{type: llm_decision}", "{kind: x}"), TOOLS_PY))
    assert error.path == "transitions[1].condition"
    assert "'type'" in str(error)


def test_yaml_syntax_error_names_the_line(write_playbook: WritePlaybook) -> None:
    text = VALID.replace("    name: Help\n", "    name: Help\n   bad_indent: x\n")
    line = text.splitlines().index("   bad_indent: x") + 1
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.source == "playbook.yaml"
    assert str(error).startswith(f"playbook.yaml: YAML syntax error at line {line}:")


def test_yaml_unclosed_bracket(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook("id: p\nname: P\nglobal_tools: [a, b\ninitial_stage: a\n"))
    assert str(error).startswith("playbook.yaml: YAML syntax error at line ")


def test_json_syntax_error_names_the_line(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook('{\n  "id": "p",\n  "name": \n}\n', name="broken.json"))
    assert str(error).startswith("broken.json: JSON syntax error at line 4:")


@pytest.mark.parametrize(
    ("text", "name"),
    [("- a\n- b\n", "list.yaml"), ("", "empty.yaml"), ('"just text"', "text.json")],
)
def test_top_level_must_be_a_mapping(write_playbook: WritePlaybook, text: str, name: str) -> None:
    error = load_error(write_playbook(text, name=name))
    assert str(error) == f"{name}: a playbook must be a mapping at the top level"


def test_unknown_field_in_a_stage(write_playbook: WritePlaybook) -> None:
    text = variant("    name: Bye\n", "    name: Bye\n    colour: blue\n")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:26: stages[2].colour: unknown field"


def test_unknown_top_level_field(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook("revision: 2\n" + VALID, TOOLS_PY))
    assert str(error) == "playbook.yaml:1: revision: unknown field"


def test_unknown_field_in_an_action(write_playbook: WritePlaybook) -> None:
    text = variant("clear_history: true", "clear_history: true\n      sound: chime")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:46: transitions[2].action.sound: unknown field"


def test_misspelt_field_is_reported_as_unknown(write_playbook: WritePlaybook) -> None:
    """A typo in a required key names the typo, not only the key that is now missing."""
    text = variant("    system_prompt: Say goodbye.", "    sytem_prompt: Say goodbye.")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.path == "stages[2].sytem_prompt"
    assert str(error).startswith("playbook.yaml:26: stages[2].sytem_prompt: unknown field")


def test_missing_field_is_named_in_snake_case(write_playbook: WritePlaybook) -> None:
    text = variant(
        "{type: llm_decision}\n    action: {target_stage: help}",
        "{type: llm_decision}\n    action: {clear_history: true}",
    )
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:36: transitions[1].action.target_stage: Field required"


def test_missing_stage_prompt_is_named_in_snake_case(write_playbook: WritePlaybook) -> None:
    text = variant("    system_prompt: Say goodbye.\n", "")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:24: stages[2].system_prompt: Field required"


def test_missing_condition_field_is_named_without_the_type_tag(
    write_playbook: WritePlaybook,
) -> None:
    text = variant("{type: tool_call, tool_name: cancel_order}", "{type: tool_call}")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:41: transitions[2].condition.tool_name: Field required"


def test_invalid_condition_field_is_named_without_the_type_tag(
    write_playbook: WritePlaybook,
) -> None:
    text = variant("keywords: [order, parcel]", "keywords: []")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.path == "transitions[0].condition.keywords"
    assert "at least 1 item" in str(error)


def test_unknown_field_in_a_condition(write_playbook: WritePlaybook) -> None:
    text = variant("{type: llm_decision}", "{type: llm_decision, model: big}")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == "playbook.yaml:35: transitions[1].condition.model: unknown field"


def test_named_tool_choice_without_tool_name(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("tool_choice: none", "tool_choice: {type: tool}")))
    assert str(error) == "playbook.yaml:27: stages[2].tool_choice.tool_name: Field required"


def test_unknown_tool_choice_mode(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("tool_choice: none", "tool_choice: sometimes")))
    assert str(error) == (
        "playbook.yaml:27: stages[2].tool_choice: Input should be 'auto', 'none' or 'required'"
    )


def test_out_of_range_value(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("max_turns: 3", "max_turns: 0"), TOOLS_PY))
    assert error.path == "stages[1].max_turns"
    assert "greater than 0" in str(error)


def test_wrong_value_type(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("timeout_ms: 60000", "timeout_ms: soon"), TOOLS_PY))
    assert error.path == "stages[1].timeout_ms"
    assert "integer" in str(error)


def test_several_problems_are_each_listed(write_playbook: WritePlaybook) -> None:
    text = variant("    name: Bye\n", "    name: Bye\n    colour: blue\n    size: 3\n")
    error = load_errors(write_playbook(text, TOOLS_PY))
    assert str(error) == (
        "playbook.yaml:26: stages[2].colour: unknown field\n"
        "playbook.yaml:27: stages[2].size: unknown field"
    )


def test_missing_tools_module(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(variant("tools_module: tools.py", "tools_module: gone.py")))
    assert error.path == "tools_module"
    assert str(error).startswith("playbook.yaml:5: tools_module: file not found: ")
    assert "gone.py" in str(error)


def test_tools_module_is_relative_to_the_playbook(
    write_playbook: WritePlaybook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_playbook(VALID, TOOLS_PY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert set(load_playbook(path).tools) == {"lookup_order", "cancel_order"}


def test_tools_module_that_raises_on_import(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(VALID, "raise RuntimeError('no database configured')\n"))
    assert str(error) == (
        "playbook.yaml:5: tools_module: importing tools.py failed: "
        "RuntimeError: no database configured"
    )


def test_tools_module_with_a_syntax_error(write_playbook: WritePlaybook) -> None:
    error = load_error(write_playbook(VALID, "def broken(:\n    pass\n"))
    assert error.path == "tools_module"
    assert "importing tools.py failed: SyntaxError" in str(error)


def test_max_turns_without_count_needs_the_stage_max_turns(write_playbook: WritePlaybook) -> None:
    text = variant("id: too_long\n    from: help", "id: too_long\n    from: greeting")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == (
        "playbook.yaml:54: transitions[4].condition.count: "
        "required when the stage sets no max_turns"
    )


def test_max_turns_without_count_from_any_stage(write_playbook: WritePlaybook) -> None:
    text = variant("id: too_long\n    from: help", 'id: too_long\n    from: "*"')
    error = load_error(write_playbook(text, TOOLS_PY))
    assert error.path == "transitions[4].condition.count"


def test_max_turns_with_count_needs_no_stage_max_turns(write_playbook: WritePlaybook) -> None:
    text = variant(
        "id: too_long\n    from: help\n    condition: {type: max_turns}",
        'id: too_long\n    from: "*"\n    condition: {type: max_turns, count: 2}',
    )
    loaded = load_playbook(write_playbook(text, TOOLS_PY))
    assert loaded.spec.transitions[4].condition == MaxTurnsCondition(type="max_turns", count=2)


def test_timeout_without_duration_needs_the_stage_timeout(write_playbook: WritePlaybook) -> None:
    text = variant("id: too_slow\n    from: help", "id: too_slow\n    from: bye")
    error = load_error(write_playbook(text, TOOLS_PY))
    assert str(error) == (
        "playbook.yaml:58: transitions[5].condition.duration_ms: "
        "required when the stage sets no timeout_ms"
    )


def test_timeout_with_duration_needs_no_stage_timeout(write_playbook: WritePlaybook) -> None:
    text = variant(
        "id: too_slow\n    from: help\n    condition: {type: timeout}",
        "id: too_slow\n    from: bye\n    condition: {type: timeout, duration_ms: 10}",
    )
    loaded = load_playbook(write_playbook(text, TOOLS_PY))
    assert loaded.spec.transitions[5].condition == TimeoutCondition(type="timeout", duration_ms=10)


def test_error_names_the_json_file(write_playbook: WritePlaybook) -> None:
    document = {
        "id": "p",
        "name": "P",
        "initial_stage": "a",
        "stages": [{"id": "a", "name": "A", "system_prompt": "x"}],
        "transitions": [
            {
                "id": "t",
                "from": "a",
                "condition": {"type": "llm_decision"},
                "action": {"targetStage": "zzz"},
            }
        ],
    }
    error = load_error(write_playbook(json.dumps(document), name="flow.json"))
    assert str(error) == "flow.json: transitions[0].action.target_stage: unknown stage 'zzz'"


def test_a_tool_may_not_take_the_reserved_transition_name(
    write_playbook: Callable[..., Path],
) -> None:
    path = write_playbook(
        """
        id: x
        name: X
        initial_stage: a
        tools_module: tools.py
        stages:
          - {id: a, name: A, system_prompt: hi}
        """,
        """
        from playbooks import tool

        @tool
        def playbook_transition(target_stage: str) -> str:
            \"\"\"Shadows the engine's own tool.\"\"\"
            return target_stage
        """,
    )
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    assert str(caught.value) == (
        "playbook.yaml:5: tools_module: the tool name 'playbook_transition' is reserved "
        "for stage transitions"
    )


def test_the_line_of_a_field_path_with_a_bracket_in_a_key_is_found_or_none() -> None:
    where = LineMap("p.yaml")
    where.add("stages[0]", 7)
    assert where.line_of("stages[0].a[b") == 7  # the key "a[b" is not a list position
    assert where.line_of("x.a[b") is None
    assert where.line_of("a[b") is None  # once looped for ever: nothing left to strip


# -- every problem of a refused file, each at its line ------------------------------------------

# Three independent problems: a bad type in stage 0, an unknown field in stage 2 (both found by
# validation) and a transition to a stage there is not (found by the cross-reference checks).
THREE_PROBLEMS = (
    VALID.replace("    two_phase_execution: false\n", "    two_phase_execution: maybe\n")
    .replace("    name: Bye\n", "    name: Bye\n    colour: blue\n")
    .replace(
        "    condition: {type: keyword, keywords: [order, parcel], in: user}\n"
        "    action: {target_stage: help}\n",
        "    condition: {type: keyword, keywords: [order, parcel], in: user}\n"
        "    action: {target_stage: lobby}\n",
    )
)
THREE_PATHS = [
    "stages[0].two_phase_execution",
    "stages[2].colour",
    "transitions[0].action.target_stage",
]


def line_of(text: str, fragment: str) -> int:
    """The line of ``text`` holding ``fragment``, the only one."""
    [line] = [i for i, row in enumerate(text.splitlines(), 1) if fragment in row]
    return line


def test_a_yaml_file_lists_every_problem_at_its_line(write_playbook: WritePlaybook) -> None:
    assert THREE_PROBLEMS.count("maybe") == THREE_PROBLEMS.count("colour") == 1
    error = load_errors(write_playbook(THREE_PROBLEMS, TOOLS_PY))
    lines = [
        line_of(THREE_PROBLEMS, "two_phase_execution: maybe"),
        line_of(THREE_PROBLEMS, "colour: blue"),
        line_of(THREE_PROBLEMS, "target_stage: lobby"),
    ]
    assert lines == sorted(lines)
    assert [(p.path, p.line) for p in error.problems] == list(zip(THREE_PATHS, lines, strict=True))
    assert error.lines() == [
        f"playbook.yaml:{lines[0]}: stages[0].two_phase_execution: Input should be a valid "
        "boolean, unable to interpret input",
        f"playbook.yaml:{lines[1]}: stages[2].colour: unknown field",
        f"playbook.yaml:{lines[2]}: transitions[0].action.target_stage: unknown stage 'lobby'",
    ]
    assert (error.path, error.line) == (THREE_PATHS[0], lines[0])  # the first problem's


def test_a_json_file_lists_every_problem_with_its_path(write_playbook: WritePlaybook) -> None:
    document = yaml.safe_load(THREE_PROBLEMS)
    error = load_errors(write_playbook(json.dumps(document, indent=2), TOOLS_PY, "flow.json"))
    assert [(p.source, p.path, p.line) for p in error.problems] == [
        ("flow.json", path, None) for path in THREE_PATHS
    ]
    assert str(error).splitlines()[1:] == [
        "flow.json: stages[2].colour: unknown field",
        "flow.json: transitions[0].action.target_stage: unknown stage 'lobby'",
    ]


def test_playbook_check_prints_a_line_per_problem_and_exits_2(
    write_playbook: WritePlaybook,
) -> None:
    path = write_playbook(THREE_PROBLEMS, TOOLS_PY)
    done = subprocess.run(
        [sys.executable, "-m", "server", "playbook", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert (done.returncode, done.stdout) == (2, "")
    lines = done.stderr.splitlines()
    assert len(lines) == 3, done.stderr
    for line, field_path in zip(lines, THREE_PATHS, strict=True):
        assert line.startswith("playbook.yaml:"), line
        assert f": {field_path}: " in line


def test_the_list_of_problems_is_capped(write_playbook: WritePlaybook) -> None:
    """A file of thousands of problems prints MAX_PROBLEMS lines and a count; each line is cut
    and has its control characters escaped."""
    extra = "".join(f"    colour{i}: x\n" for i in range(MAX_PROBLEMS + 7))
    extra += '    "evil\\nkey\\x1b[2J' + "k" * 600 + '": x\n'
    error = load_errors(write_playbook(variant("    name: Bye\n", "    name: Bye\n" + extra)))
    assert len(error.problems) == MAX_PROBLEMS + 8
    lines = str(error).split("\n")
    assert len(lines) == MAX_PROBLEMS + 1
    assert lines[-1] == "... and 8 more problems"
    assert (
        lines[0]
        == f"playbook.yaml:{line_of(VALID, 'name: Bye') + 1}: stages[2].colour0: unknown field"
    )
    evil = next(p for p in error.problems if "evil" in p.path)
    assert "\n" not in str(evil)
    assert "\x1b" not in str(evil)
    assert "evil\\nkey\\x1b[2J" in str(evil)
    assert len(str(evil)) <= 500


def test_one_more_problem_is_counted_in_the_singular() -> None:
    problems = [Problem("p.yaml", f"a{i}", "bad", i + 1) for i in range(MAX_PROBLEMS + 1)]
    assert PlaybookError.of(problems).lines()[-1] == "... and 1 more problem"
    assert len(PlaybookError.of(problems[:MAX_PROBLEMS]).lines()) == MAX_PROBLEMS


def test_problems_are_in_file_order_and_listed_once() -> None:
    error = PlaybookError.of(
        [
            Problem("p.yaml", "b", "second", 9),
            Problem("p.yaml", "", "whole file"),
            Problem("p.yaml", "a", "first", 2),
            Problem("p.yaml", "b", "second", 9),
            Problem("p.yaml", "c", "no line either"),
        ]
    )
    assert error.lines() == [
        "p.yaml:2: a: first",
        "p.yaml:9: b: second",
        "p.yaml: whole file",  # those without a line after, in the order found
        "p.yaml: c: no line either",
    ]
    assert (error.source, error.path, error.message, error.line) == ("p.yaml", "a", "first", 2)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.problems) == (PlaybookError, error.problems)
    with pytest.raises(ValueError, match="needs a problem"):
        PlaybookError.of([])


def test_one_problem_reads_as_before() -> None:
    error = PlaybookError("p.yaml", "stages[1].voice", "bad\nvalue", 14)
    assert str(error) == "p.yaml:14: stages[1].voice: bad\\nvalue"
    assert error.problems == (Problem("p.yaml", "stages[1].voice", "bad\nvalue", 14),)
    assert error.lines() == [str(error)]


def test_the_line_map_locates_every_problem() -> None:
    where = LineMap("p.yaml")
    where.add("stages[0]", 7)
    where.add("stages[0].name", 8)
    error = PlaybookError.of(
        [
            Problem("p.yaml", "stages[0].name", "bad"),
            Problem("p.yaml", "stages[0].tools[3]", "unknown tool"),
            Problem("p.yaml", "initial_stage", "not placed"),
            Problem("other.yaml", "stages[0]", "another file's"),
        ]
    )
    assert where.locate(error).lines() == [
        "p.yaml:7: stages[0].tools[3]: unknown tool",
        "p.yaml:8: stages[0].name: bad",
        "p.yaml: initial_stage: not placed",
        "other.yaml: stages[0]: another file's",
    ]
    unplaced = PlaybookError("p.yaml", "nowhere", "x")
    assert where.locate(unplaced) is unplaced


def test_every_broken_reference_is_listed(write_playbook: WritePlaybook) -> None:
    text = (
        variant("initial_stage: greeting", "initial_stage: lobby")
        .replace("  - id: too_slow\n", "  - id: cancelled\n")
        .replace("global_tools: [lookup_order]", "global_tools: [lookup_order, refund]")
    )
    error = load_errors(write_playbook(text, TOOLS_PY))
    assert [(p.line, p.path) for p in error.problems] == [
        (4, "initial_stage"),
        (line_of(text, "global_tools:"), "global_tools[1]"),
        (56, "transitions[5].id"),  # as in test_duplicate_transition_id
    ]
    assert "unknown tool 'refund'" in error.lines()[1]


def test_a_misspelt_key_is_one_problem_beside_an_unrelated_missing_field(
    write_playbook: WritePlaybook,
) -> None:
    text = variant(
        "    name: Bye\n    system_prompt: Say goodbye.", "    sytem_prompt: Say goodbye."
    )
    error = load_errors(write_playbook(text, TOOLS_PY))
    assert error.lines() == [
        "playbook.yaml:24: stages[2].name: Field required",  # at the stage's line
        "playbook.yaml:25: stages[2].sytem_prompt: unknown field",
    ]


def test_a_union_not_discriminated_is_one_problem(write_playbook: WritePlaybook) -> None:
    servers = (
        "mcp_servers:\n"
        "  - {name: a, command: x, tools: alll}\n"
        "  - {name: b, command: x, tools: [1]}\n"
    )
    error = load_errors(write_playbook(VALID + servers, TOOLS_PY))
    base = line_of(VALID + servers, "name: a,")
    assert error.lines() == [
        f"playbook.yaml:{base}: mcp_servers[0].tools: Input should be a valid list, or input "
        "should be 'all'",
        f"playbook.yaml:{base + 1}: mcp_servers[1].tools[0]: Input should be a valid string",
    ]


# -- transfers ---------------------------------------------------------------------------------

TRANSFER_PLAYBOOK = """\
id: desk
name: Desk
initial_stage: help
transfer: {to: "+1 555 0100", say: One moment.}
stages:
  - id: help
    name: Help
    system_prompt: Help.
  - id: billing
    name: Billing
    system_prompt: Bills.
    transfer: {to: "sip:billing@pbx.example.com:5070", mode: warm, ring_timeout_ms: 15000}
"""


def test_a_transfer_per_playbook_and_per_stage(write_playbook: WritePlaybook) -> None:
    spec = load_playbook(write_playbook(TRANSFER_PLAYBOOK)).spec
    assert spec.transfer is not None
    assert spec.transfer.to == "+1 555 0100"
    assert spec.transfer.say == "One moment."
    assert spec.transfer.mode == "blind"
    billing = spec.stage("billing").transfer
    assert billing is not None
    assert (billing.to, billing.mode, billing.ring_timeout_ms) == (
        "sip:billing@pbx.example.com:5070",
        "warm",
        15000,
    )
    assert billing.say == "Let me put you through."  # the default line


def test_a_transfer_in_json_with_camel_case_keys(write_playbook: WritePlaybook) -> None:
    data = yaml.safe_load(TRANSFER_PLAYBOOK)
    data["stages"][1]["transfer"] = {"to": "tel:+15550100", "ringTimeoutMs": 5000}
    spec = load_playbook(write_playbook(json.dumps(data), name="desk.json")).spec
    billing = spec.stage("billing").transfer
    assert billing is not None
    assert (billing.to, billing.ring_timeout_ms) == ("tel:+15550100", 5000)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            '"+1 555 0100"',
            "agent-desk",
            "playbook.yaml:4: transfer.to: must be a SIP URI (sip:agent@pbx.example.com) or a"
            " phone number (+15551234567)",
        ),
        (
            "mode: warm",
            "mode: cold",
            "playbook.yaml:12: stages[1].transfer.mode: Input should be 'blind' or 'warm'",
        ),
        (
            "ring_timeout_ms: 15000",
            "ring_timeout_ms: 0",
            "playbook.yaml:12: stages[1].transfer.ring_timeout_ms: Input should be greater than 0",
        ),
        (
            "    system_prompt: Help.\n",
            "    system_prompt: Help.\n    tools: [transfer_call]\n",
            "playbook.yaml:9: stages[0].tools[0]: transfer_call is built in: give the stage or the"
            " playbook a transfer ({to: ..., say: ...}) instead of listing it",
        ),
    ],
)
def test_transfer_mistakes_name_the_line_and_field(
    write_playbook: WritePlaybook, old: str, new: str, expected: str
) -> None:
    assert TRANSFER_PLAYBOOK.count(old) == 1
    error = load_error(write_playbook(TRANSFER_PLAYBOOK.replace(old, new)))
    assert str(error) == expected


def test_a_tools_module_cannot_define_transfer_call(write_playbook: WritePlaybook) -> None:
    text = "tools_module: tools.py\n" + TRANSFER_PLAYBOOK
    tools = "from playbooks import tool\n\n@tool\ndef transfer_call() -> str:\n    return 'x'\n"
    error = load_error(write_playbook(text, tools))
    assert str(error) == (
        "playbook.yaml:1: tools_module: the tool name 'transfer_call' is reserved for call"
        " transfers"
    )
