"""The agent's LLM in a scripted scenario: each turn's ``agent`` steps, served by a
:class:`~server.testkit.scripted_llm.ScriptedLLM` over the real wire format.

A turn's script answers the LLM requests made from when the caller starts that turn until the
next turn starts. Within a turn, a request is answered by the step of its place in the tool loop
(the number of assistant messages after the last user message: 0 for the caller's words, 1
after the first step's tool results ...), so a request made again (a turn begun early on the
caller's first words, then undone and redone) gets the same answer. Intent checks (the
non-streamed requests) get the turn's ``intent``, else ``none``.
"""

from __future__ import annotations

import json
from typing import Any

from ..scripted_llm import Reply, ScriptedToolCall
from .model import ScriptStep, Turn

__all__ = ["TurnScript", "reply_of"]

INTENT_CONFIDENCE = 0.95


def reply_of(step: ScriptStep) -> Reply:
    """A step as the scripted LLM's reply."""
    calls = [
        ScriptedToolCall(name, arguments) for call in step.tools for name, arguments in call.items()
    ]
    return Reply(content=step.say, tool_calls=calls, content_after_tools=step.then)


class TurnScript:
    """The reply source of a scripted scenario (pass it to ``ScriptedLLM``); :meth:`play` moves
    it to the next turn. ``missing`` lists the requests the script had no step for."""

    def __init__(self) -> None:
        self.turn_number = 0
        self._turn: Turn | None = None
        self.missing: list[str] = []

    def play(self, number: int, turn: Turn) -> None:
        """From now on, answer as turn ``number`` (1-based) scripts."""
        self.turn_number, self._turn = number, turn

    def __call__(self, body: dict[str, Any]) -> Reply:
        turn = self._turn
        if not body.get("stream"):
            intent = (turn.intent if turn is not None else None) or "none"
            confidence = INTENT_CONFIDENCE if intent != "none" else 0.1
            return Reply(content=json.dumps({"intent": intent, "confidence": confidence}))
        step = _step_of(body.get("messages", []))
        steps = (turn.agent if turn is not None else None) or []
        if step < len(steps):
            return reply_of(steps[step])
        problem = (
            f"turn {self.turn_number} scripts {len(steps)} agent step(s); "
            f"the LLM was asked for step {step + 1} (it was answered with an error)"
        )
        if problem not in self.missing:  # a request made again asks the same
            self.missing.append(problem)
        return Reply(status=400, error={"message": problem, "type": "scenario_script"})


def _step_of(messages: list[dict[str, Any]]) -> int:
    """How many assistant messages follow the last user message."""
    count = 0
    for message in reversed(messages):
        role = message.get("role")
        if role == "user":
            return count
        if role == "assistant":
            count += 1
    return count
