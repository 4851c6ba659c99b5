"""The Markdown playbook of docs/playbooks.md compiles to what that page says it does."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from playbooks import load_playbook
from playbooks.models import IntentCondition, LLMDecisionCondition
from playbooks.outline import mermaid, outline
from tests.conftest import REPO
from tests.support.processes import run_vocable

README_SERVER = (
    "{name: orders, command: python, args: [-m, acme_orders_mcp], tools: [lookup_order]}"
)


def _readme_markdown_playbook() -> str:
    reference = (REPO / "docs" / "playbooks.md").read_text()
    section = reference[reference.index("## Markdown playbooks") :]
    match = re.search(r"```markdown\n(.*?)```", section, re.S)
    assert match, "docs/playbooks.md shows no Markdown playbook"
    return match.group(1)


def test_the_readme_markdown_playbook_has_steps_triggers_persona_voice_mcp_and_handoff(
    tmp_path: Path,
) -> None:
    text = _readme_markdown_playbook()
    assert README_SERVER in text
    test_server = {  # the same tool, from the MCP server the tests run
        "name": "orders",
        "command": sys.executable,
        "args": ["-m", "tests.support.mcp_server"],
        "env": {"PYTHONPATH": str(REPO)},
        "tools": ["lookup_order"],
    }
    path = tmp_path / "acme.md"
    path.write_text(text.replace(README_SERVER, json.dumps(test_server)))

    loaded = load_playbook(path)
    spec = loaded.spec
    stages = {stage.id: stage for stage in spec.stages}
    assert list(stages) == ["orders", "billing", "goodbye"]
    orders, billing = stages["orders"], stages["billing"]
    assert "Look it up with lookup_order." in orders.system_prompt  # the steps
    assert orders.tools == ["lookup_order"]  # served by the MCP server
    assert billing.persona is not None
    assert billing.persona.role == "Billing specialist"
    assert billing.voice is not None
    assert billing.voice.speaking_rate == 0.8
    assert billing.greeting == "Hi, this is billing."
    conditions = {t.id: t.condition for t in spec.transitions}
    handoff = conditions["to_billing"]
    assert isinstance(handoff, LLMDecisionCondition)
    assert handoff.require_summary
    (trigger,) = [c for c in conditions.values() if isinstance(c, IntentCondition)]
    assert trigger.intent == "The caller wants to end the call"

    # and `vocable playbook check` / `graph` show them
    listing = outline(loaded)
    assert "MCP server orders:" in listing
    assert "  persona: Billing specialist" in listing
    assert "  voice: id joe-slow, speaking_rate 0.8" in listing
    assert "  -> billing when llm_decision with summary  [to_billing]" in listing
    assert "orders --> billing: llm_decision with summary" in mermaid(spec)


async def test_playbook_check_and_graph_take_the_readme_example_as_it_is(tmp_path: Path) -> None:
    """No `acme_orders_mcp` exists here: both commands read the file without starting it."""
    path = tmp_path / "acme.md"
    path.write_text(_readme_markdown_playbook())
    code, out, err = await run_vocable("playbook", "graph", str(path))
    assert code == 0, err
    assert "    orders --> billing: llm_decision with summary" in out.splitlines()
    assert "    orders --> goodbye: intent 'The caller wants to end the call' (confidence 0.7)" in (
        out.splitlines()
    )
    code, out, err = await run_vocable("playbook", "check", str(path))
    assert code == 0, err
    assert "\ntools: lookup_order (as the file lists them; --connect asks the MCP servers)\n" in out
    assert "  persona: Billing specialist\n" in out
    code, _, err = await run_vocable("playbook", "check", "--connect", str(path))
    assert code == 2
    assert "acme.md:4: cannot connect to MCP server 'orders'" in err
