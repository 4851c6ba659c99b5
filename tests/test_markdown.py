"""Markdown playbooks: the format compiles to the same model as YAML, and errors name the line."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from playbooks import PlaybookError, check_playbook, load_playbook, load_playbooks
from playbooks.markdown import STEPS_INTRO, compile_markdown, slug
from playbooks.models import IntentCondition, KeywordCondition
from tests.conftest import EXAMPLES, REPO

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
def pay(amount: float) -> str:
    """Take a payment.

    Args:
        amount: In euros.
    """
    return "paid"
'''

SHOP = """\
---
id: shop
description: A small shop.
tools_module: tools.py
stages:
  checkout: {max_turns: 3, mode: iterative, llm_config: {temperature: 0.1}}
transitions:
  - id: bye
    from: "*"
    condition: {type: keyword, keywords: [bye], in: user}
    action: {target_stage: done}
---

# Corner shop

You run a corner shop.
Be brief.

## Welcome

Greet the caller.

### Triggers

- The caller wants to pay → Checkout
- The caller wants to pay by card -> `checkout`
- The caller is finished → done

## Checkout {#checkout}

Take the payment.

```text
## not a stage: inside a code block
```

### Steps

1. Ask for the amount.
2. Call pay.
   Only once the caller agreed.

### Tools

- pay: only after the caller agreed
- `lookup_order`

## Done

Say goodbye.
"""


def _write(tmp_path: Path, text: str, name: str = "shop.md") -> Path:
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_sections_compile_to_stages_prompts_tools_and_intent_transitions(
    tmp_path: Path,
) -> None:
    spec = load_playbook(_write(tmp_path, SHOP)).spec
    assert (spec.id, spec.name, spec.description) == ("shop", "Corner shop", "A small shop.")
    assert spec.global_system_prompt == "You run a corner shop.\nBe brief."
    assert spec.initial_stage == "welcome"  # the first stage
    assert [(s.id, s.name) for s in spec.stages] == [
        ("welcome", "Welcome"),
        ("checkout", "Checkout"),
        ("done", "Done"),
    ]
    welcome, checkout, done = spec.stages
    assert welcome.system_prompt == "Greet the caller."
    assert checkout.system_prompt.startswith("Take the payment.\n\n```text\n## not a stage")
    assert checkout.system_prompt.endswith(
        f"{STEPS_INTRO}\n1. Ask for the amount.\n2. Call pay.\n   Only once the caller agreed."
    )
    assert checkout.tools == ["pay", "lookup_order"]
    assert (checkout.max_turns, checkout.mode, checkout.llm_config.temperature) == (
        3,
        "iterative",
        0.1,
    )
    assert (welcome.mode, done.mode) == ("playbook", "playbook")

    # front matter transitions first (they come first in the file), then the triggers
    assert [t.id for t in spec.transitions] == [
        "bye",
        "welcome_to_checkout",
        "welcome_to_checkout_2",
        "welcome_to_done",
    ]
    assert isinstance(spec.transitions[0].condition, KeywordCondition)
    trigger = spec.transitions[1]
    assert trigger.from_stage == "welcome"
    assert trigger.action.target_stage == "checkout"
    assert trigger.condition == IntentCondition(type="intent", intent="The caller wants to pay")
    assert trigger.description == "The caller wants to pay"
    assert spec.transitions[2].condition == IntentCondition(
        type="intent", intent="The caller wants to pay by card"
    )


def test_the_markdown_example_matches_the_yaml_one_where_they_overlap() -> None:
    md = load_playbook(EXAMPLES / "markdown" / "support.md").spec
    yml = load_playbook(EXAMPLES / "support.yaml").spec

    def words(text: str | None) -> list[str]:
        return (text or "").split()

    top = ("id", "name", "description", "initial_stage", "default_llm_config", "global_tools")
    assert {k: getattr(md, k) for k in top} == {k: getattr(yml, k) for k in top}
    assert words(md.global_system_prompt) == words(yml.global_system_prompt)
    same = ("id", "description", "tools", "greeting", "two_phase_execution", "max_turns")
    for md_stage, yml_stage in zip(md.stages, yml.stages, strict=True):
        assert md_stage.model_dump(include=set(same)) == yml_stage.model_dump(include=set(same))
        assert md_stage.timeout_ms == yml_stage.timeout_ms
        assert md_stage.name == yml_stage.name
        if md_stage.id in ("order_help", "farewell"):  # the others use Steps and Triggers
            assert words(md_stage.system_prompt) == words(yml_stage.system_prompt)
    identify = md.stage("identify")
    assert "lookup_order" in identify.system_prompt
    assert "A1001" in identify.system_prompt
    assert (identify.mode, md.stage("farewell").mode) == ("iterative", "single-shot")

    by_id = {t.id: t for t in yml.transitions}
    assert {t.id for t in md.transitions} == set(by_id)
    for transition in md.transitions:
        if transition.id != "greeting_to_identify":
            assert transition == by_id[transition.id]
    # the YAML keyword transition is a natural-language trigger in the Markdown
    trigger = next(t for t in md.transitions if t.id == "greeting_to_identify")
    assert (trigger.from_stage, trigger.action.target_stage) == ("greeting", "identify")
    assert trigger.condition.type == "intent"


def test_a_folder_loads_markdown_beside_yaml(tmp_path: Path) -> None:
    _write(tmp_path, SHOP)
    (tmp_path / "other.yaml").write_text(
        "id: other\nname: Other\ninitial_stage: a\nstages: [{id: a, name: A, system_prompt: hi}]\n"
    )
    assert set(load_playbooks(tmp_path)) == {"shop", "other"}


def test_slug_makes_snake_case_ids() -> None:
    assert slug("Order help") == "order_help"
    assert slug("  Pay & go!  ") == "pay_go"
    assert slug("Begrüßung") == "begrüßung"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("## A\nhi\n", "bad.md:1: a stage before the '# Playbook name' heading"),
        ("intro\n# X\n## A\nhi\n", "bad.md:1: text before the '# Playbook name' heading"),
        ("# X\nhi\n", "bad.md:1: no '## Stage' heading: a playbook needs a stage"),
        ("# X\n## A\nhi\n# Y\n", "bad.md:4: a second '#' heading: one playbook per file"),
        ("# X\n## A\n\n## B\nhi\n", "bad.md:2: stage 'a' has no prompt text or steps"),
        ("# X\n## A\nhi\n## A\nho\n", "bad.md:4: duplicate stage id 'a' (line 2)"),
        ("# X\n## !!!\nhi\n", "bad.md:2: no id can be made of '!!!': add {#id}"),
        (
            "# X\n## A\nhi\n### Notes\n",
            "bad.md:4: unknown section 'Notes'; expected Steps, Triggers, Tools or Transfer",
        ),
        ("# X\n### Steps\n", "bad.md:2: '### Steps' outside a '##' stage"),
        (
            "# X\n## A\nhi\n### Steps\n1. a\n### Steps\n",
            "bad.md:6: a second '### Steps' (first at line 4)",
        ),
        ("# X\n## A\n### Steps\nAsk.\n", "bad.md:4: a step is a numbered line: '1. Ask for ...'"),
        (
            "# X\n## A\nhi\n### Triggers\n- wants B\n",
            "bad.md:5: a trigger is a bullet: '- <condition> → <stage>'",
        ),
        (
            "# X\n## A\nhi\n### Triggers\n\n- wants to pay → billing\n",
            "bad.md:6: unknown stage 'billing' (stages: a)",
        ),
        (
            "# X\n## A\nhi\n### Tools\n- two words\n",
            "bad.md:5: a tool is a bullet with its name: '- lookup_order'",
        ),
        (
            "---\ntools_module: tools.py\n---\n# X\n## A\nhi\n### Tools\n- pay\n- nope\n",
            "bad.md:9: unknown tool 'nope' (tools module defines: lookup_order, pay)",
        ),
        ("# X\n## A\nhi\n```\n## B\n", "bad.md:5: a code block is never closed"),
        ("---\nid: x\n# X\n## A\nhi\n", "bad.md:1: front matter opened with '---' is never closed"),
        ("---\nid: [x\n---\n# X\n## A\nhi\n", "bad.md:2: front matter: expected ','"),
        ("---\n- a\n---\n# X\n## A\nhi\n", "bad.md:2: front matter must be a YAML mapping"),
        ("---\nid: x\n\nd: x\x01\n---\n# X\n## A\nhi\n", "bad.md:4: front matter: special"),
        ("---\nname: Y\n---\n# X\n## A\nhi\n", "bad.md:2: name: set by the # heading"),
        (
            "---\nid: x\nstages:\n  a: {system_prompt: hi}\n---\n# X\n## A\nhi\n",
            "bad.md:4: system_prompt: set by the stage's text",
        ),
        (
            "---\nstages:\n  zz: {}\n---\n# X\n## A\nhi\n",
            "bad.md:3: stages: no stage 'zz' in this file (stages: a)",
        ),
        (
            "---\nid: x\nstages:\n  a:\n    max_turns: 0\n---\n# X\n## A\nhi\n",
            "bad.md:5: max_turns: Input should be greater than 0",
        ),
        (
            "---\nstages:\n  a: {mode: loop}\n---\n# X\n## A\nhi\n",
            "bad.md:3: mode: Input should be 'playbook', 'iterative' or 'single-shot'",
        ),
        ("---\ninitial_stage: b\n---\n# X\n## A\nhi\n", "bad.md:2: initial_stage: unknown stage"),
        (
            "---\ntransitions:\n  - id: t\n    from: a\n    condition: {type: keywrd}\n"
            "    action: {target_stage: a}\n---\n# X\n## A\nhi\n",
            "bad.md:5: condition: unknown condition type 'keywrd'",
        ),
        (
            "---\ntransitions:\n  - id: t\n    from: a\n    condition: {type: llm_decision}\n"
            "    action: {targetStage: q}\n---\n# X\n## A\nhi\n",
            "bad.md:6: target_stage: unknown stage 'q'",
        ),
        (
            "---\ntools_module: missing.py\n---\n# X\n## A\nhi\n",
            "bad.md:2: tools_module: file not found",
        ),
        (
            "# X\n## A\nhi\n### Tools\n- mcp:orders: every order tool\n",
            "bad.md:5: no MCP server 'orders' (mcp_servers: none)",
        ),
    ],
)
def test_errors_name_the_markdown_line(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text, name="bad.md")
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    message = str(caught.value)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_a_front_matter_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    rows = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdef", "bcdefg", strict=True):
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    path = _write(tmp_path, "---\n" + "\n".join(rows) + "\n---\n# X\n## A\nhi\n", "bomb.md")
    with pytest.raises(PlaybookError, match=r"more than 100000 values"):
        load_playbook(path)


MCP_SHOP = """\
---
mcp_servers:
  - {name: orders, command: /nonexistent/orders-mcp}
  - {name: pay-desk, url: "http://127.0.0.1:9/mcp", tools: [pay]}
---
# Shop

## Orders

Help with orders.

### Tools

- mcp:orders: every tool of the orders server
- `mcp:pay-desk`
- mcp: a tool called mcp
"""


def test_a_tools_entry_takes_every_tool_of_an_mcp_server() -> None:
    spec = compile_markdown(textwrap.dedent(MCP_SHOP), "shop.md")[0]
    assert spec["stages"][0]["tools"] == ["mcp:orders", "mcp:pay-desk", "mcp"]


def test_check_playbook_validates_without_running_the_tools_module(tmp_path: Path) -> None:
    path = _write(tmp_path, SHOP)
    (tmp_path / "tools.py").write_text("raise RuntimeError('imported')\n")
    spec = check_playbook(path)  # neither imports tools.py nor starts anything
    assert [stage.id for stage in spec.stages] == ["welcome", "checkout", "done"]
    assert spec.stage("checkout").tools == ["pay", "lookup_order"]
    with pytest.raises(PlaybookError, match=r"importing tools\.py failed: RuntimeError: imported"):
        load_playbook(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # the tools module is not imported, but must be there
            "---\ntools_module: missing.py\n---\n# X\n## A\nhi\n",
            "bad.md:2: tools_module: file not found",
        ),
        (  # no tools module, no MCP server taking all: the file names every tool there is
            "# X\n## A\nhi\n### Tools\n- set_language\n- lookup_order\n",
            "bad.md:6: unknown tool 'lookup_order' (tools module defines: none)",
        ),
        (
            "---\nmcp_servers: [{name: o, url: 'http://h/mcp', tools: [a]}]\n---\n"
            "# X\n## A\nhi\n### Tools\n- a\n- mcp:o\n- b\n",
            "bad.md:10: unknown tool 'b' (MCP server 'o' gives (by its tools list): a)",
        ),
        (
            "---\nmcp_servers: [{name: o, command: x}]\n---\n"
            "# X\n## A\nhi\n### Tools\n- mcp:o\n- mcp:p\n",
            "bad.md:9: no MCP server 'p' (mcp_servers: o)",
        ),
        (
            "---\nstages:\n  a: {delegates: {workers: [b]}}\n---\n# X\n## A\nhi\n",
            "bad.md:3: unknown stage 'b'",
        ),
    ],
)
def test_check_playbook_errors_name_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text, name="bad.md")
    with pytest.raises(PlaybookError) as caught:
        check_playbook(path)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_the_documented_example_is_a_valid_playbook(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "playbooks-markdown.md").read_text()
    match = re.search(r"````markdown\n(.*?)````", doc, re.S)
    assert match, "docs/playbooks-markdown.md shows no example"
    (tmp_path / "shop_tools.py").write_text("")
    (tmp_path / "voices").mkdir()
    for name in ("cashier.onnx", "cashier.onnx.json"):
        (tmp_path / "voices" / name).write_text("")
    path = tmp_path / "shop.md"
    path.write_text(match.group(1))
    spec = check_playbook(path)
    stages = {stage.id: stage for stage in spec.stages}
    assert list(stages) == ["welcome", "checkout", "stock_check", "done"]
    assert stages["checkout"].tools == ["pay", "lookup_order", "mcp:stock"]
    assert stages["stock_check"].mode == "single-shot"
    assert stages["checkout"].persona is not None
    assert stages["checkout"].persona.role == "Cashier"
    assert spec.persona is not None
    assert (spec.language, list(spec.languages)) == ("en", ["en", "fr"])
    assert stages["welcome"].delegates is not None
    assert stages["welcome"].delegates.workers == ["stock_check"]


# -- every problem of a refused Markdown file, each at its line ---------------------------------


def _problems(tmp_path: Path, text: str) -> list[str]:
    """The lines of the error loading ``text`` as bad.md raises: one per problem."""
    path = _write(tmp_path, text, name="bad.md")
    with pytest.raises(PlaybookError) as caught:
        load_playbook(path)
    error = caught.value
    assert str(error).split("\n") == error.lines()
    assert all(problem.line is not None for problem in error.problems)  # always a line
    return error.lines()


def test_every_problem_of_the_body_is_listed(tmp_path: Path) -> None:
    text = (
        "# X\n## A\nhi\n### Steps\nAsk.\n### Notes\n### Triggers\n- wants B\n"
        "### Tools\n- two words\n## !!!\nhi\n## A\nho\n```\n"
    )
    assert _problems(tmp_path, text) == [
        "bad.md:5: a step is a numbered line: '1. Ask for ...'",
        "bad.md:6: unknown section 'Notes'; expected Steps, Triggers, Tools or Transfer",
        "bad.md:8: a trigger is a bullet: '- <condition> → <stage>'",
        "bad.md:10: a tool is a bullet with its name: '- lookup_order'",
        "bad.md:11: no id can be made of '!!!': add {#id}",
        "bad.md:13: duplicate stage id 'a' (line 2)",
        "bad.md:15: a code block is never closed",
    ]


def test_every_problem_of_the_compiled_stages_is_listed(tmp_path: Path) -> None:
    text = (
        "---\nname: Y\nstages:\n  zz: {}\n  a: [x]\n---\n"
        "# X\n## A\nhi\n### Triggers\n- pays → billing\n## B\n## C\nhi\n"
    )
    assert _problems(tmp_path, text) == [
        "bad.md:2: name: set by the # heading, not front matter",
        "bad.md:4: stages: no stage 'zz' in this file (stages: a, b, c)",
        "bad.md:5: stages.a: a mapping of stage options",
        "bad.md:11: unknown stage 'billing' (stages: a, b, c)",
        "bad.md:12: stage 'b' has no prompt text or steps",
    ]


def test_every_problem_of_the_playbook_is_listed_at_its_line(tmp_path: Path) -> None:
    text = (
        "---\nstages:\n  a: {max_turns: 0, mode: loop}\ntransitions:\n"
        "  - {id: t, from: a, condition: {type: llm_decision}, action: {target_stage: q}}\n"
        "---\n# X\n## A\nhi\n### Triggers\n- wants out → nowhere_else\n"
    )
    assert _problems(tmp_path, text) == [  # the body's problems first: the rest waits for them
        "bad.md:11: unknown stage 'nowhere_else' (stages: a)",
    ]
    text = text.replace("- wants out → nowhere_else\n", "- wants out → a\n")
    assert _problems(tmp_path, text) == [
        "bad.md:3: max_turns: Input should be greater than 0",
        "bad.md:3: mode: Input should be 'playbook', 'iterative' or 'single-shot'",
        "bad.md:5: target_stage: unknown stage 'q'",
    ]


def test_text_before_the_playbook_heading_stops_the_reading(tmp_path: Path) -> None:
    """Nothing after it can be read as a playbook: the problems noted so far, and that one."""
    text = "# X\n## A\nhi\n### Steps\nAsk.\n"
    assert _problems(tmp_path, "intro\n" + text) == [
        "bad.md:1: text before the '# Playbook name' heading"
    ]
    assert _problems(tmp_path, "### Tools\n## A\nhi\n") == [
        "bad.md:1: '### Tools' outside a '##' stage",
        "bad.md:2: a stage before the '# Playbook name' heading",
    ]


# -- transfers ---------------------------------------------------------------------------------

TRANSFER_MD = """\
---
id: desk
transfer: {to: "+15550100"}
---
# Desk
You are a phone agent.

## Help
Help the caller.

## Billing
Help with bills.
### Transfer
- to: sip:billing@pbx.example.com
- say: One moment, I will get a colleague.
- mode: warm
- when: The caller disputes a charge.
- ring_timeout_ms: 20000
"""


def test_a_transfer_section_sets_the_stage_transfer(tmp_path: Path) -> None:
    spec = load_playbook(_write(tmp_path, TRANSFER_MD, "desk.md")).spec
    assert spec.transfer is not None
    assert spec.transfer.to == "+15550100"
    assert spec.stage("help").transfer is None  # the playbook's applies there
    billing = spec.stage("billing").transfer
    assert billing is not None
    assert billing.model_dump() == {
        "to": "sip:billing@pbx.example.com",
        "say": "One moment, I will get a colleague.",
        "mode": "warm",
        "ring_timeout_ms": 20000,
        "description": "The caller disputes a charge.",
    }


def test_a_stage_transfer_may_come_from_the_front_matter(tmp_path: Path) -> None:
    text = TRANSFER_MD.replace(
        'transfer: {to: "+15550100"}', "stages:\n  help: {transfer: {to: sip:desk@pbx}}"
    )
    spec = load_playbook(_write(tmp_path, text, "desk.md")).spec
    assert spec.transfer is None
    help_transfer = spec.stage("help").transfer
    assert help_transfer is not None
    assert help_transfer.to == "sip:desk@pbx"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("- mode: warm", "- mode warm", "desk.md:16: a transfer line is a bullet: '- to: sip:"),
        ("- mode: warm", "- colour: red", "desk.md:16: a transfer line is a bullet: '- to: sip:"),
        ("- mode: warm", "- say: again", "desk.md:16: a second 'say:' in ### Transfer"),
        ("- mode: warm", "- mode: cold", "desk.md:13: mode: Input should be 'blind' or 'warm'"),
        (
            "- to: sip:billing@pbx.example.com",
            "- to: billing desk",
            "desk.md:13: to: must be a SIP URI",
        ),
        (
            'transfer: {to: "+15550100"}',
            "stages:\n  billing: {transfer: {to: sip:x@y}}",
            "desk.md:14: transfer: set by both ### Transfer and the front matter",
        ),
    ],
)
def test_transfer_section_mistakes_name_the_line(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert TRANSFER_MD.count(old) == 1
    with pytest.raises(PlaybookError) as caught:
        load_playbook(_write(tmp_path, TRANSFER_MD.replace(old, new), "desk.md"))
    assert str(caught.value).startswith(expected)
