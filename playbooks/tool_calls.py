"""A turn's tool calls: each round's calls run concurrently, and their results enter the history.

The turn (:mod:`playbooks.turn`) owns the LLM rounds; :class:`ToolCalls` owns what the calls of
those rounds do: the per-turn budget, the ``playbook_transition`` decision, delegation, the wait
for a preemptive turn's confirmation before side effects, and a valid history when the turn is
interrupted mid-round.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

from .delegation import DELEGATE_TOOL
from .engine import TRANSITION_TOOL, PlaybookEngine, TurnFacts
from .events import EventType
from .history import Conversation, Message
from .llm import ToolCallRequest
from .models import LLMDecisionCondition, Transition
from .tools import InvalidToolCall, ToolError, tool_arguments
from .transfer import TRANSFER_TOOL, TransferOutcome

__all__ = ["CANCELLED_RESULT", "ToolCalls", "ToolHost"]

CANCELLED_RESULT = json.dumps({"error": "cancelled: the caller interrupted before it finished"})

Decision = tuple[Transition, str | None, dict[str, Any], str | None]
"""A ``playbook_transition`` call read: the transition, its reason, data and handoff summary."""


class ToolHost(Protocol):
    """What running tool calls needs from the conversation (the orchestrator provides it)."""

    @property
    def engine(self) -> PlaybookEngine: ...

    @property
    def conversation(self) -> Conversation: ...

    def emit(self, type: EventType, **data: Any) -> None:
        """Report an event to the conversation's listeners."""

    def transition(
        self,
        transition: Transition,
        *,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
        keep: Sequence[Message] = (),
        summary: str | None = None,
    ) -> None:
        """Move to ``transition``'s stage, with its events and history effects; ``keep``
        survives a cleared history."""

    async def delegate(self, arguments: str, confirmed: asyncio.Event | None) -> str:
        """Run a ``delegate`` call of the current stage; raises InvalidToolCall."""
        ...

    async def transfer(self, arguments: str) -> tuple[str, TransferOutcome]:
        """Carry out a ``transfer_call`` call of the current stage: its JSON result and its
        outcome; raises InvalidToolCall."""
        ...


class ToolCalls:
    """The tool calls of one turn, at most ``limit`` of them. ``confirmed``: see
    :attr:`playbooks.turn.Turn.confirmed`."""

    def __init__(
        self, host: ToolHost, facts: TurnFacts, confirmed: asyncio.Event | None, limit: int
    ) -> None:
        self._host = host
        self._facts = facts
        self._confirmed = confirmed
        self._limit = limit
        self.count = 0
        """Calls made so far in the turn (those past the limit not counted)."""
        self.finishing: list[asyncio.Task[str]] = []
        """Tools left to finish after an interruption (see ``Tool.on_interrupt``); the turn
        waits for them before it ends."""
        self._open_calls: list[ToolCallRequest] = []
        self._results: dict[str, str] = {}
        self._acting: set[str] = set()
        """Ids of tool calls whose tool has started (confirmed, when it has side effects)."""
        self.transferred = False
        """Whether a ``transfer_call`` put the caller through (the turn then says nothing)."""

    async def run(
        self, calls: list[ToolCallRequest], deadline: float, user_message: Message
    ) -> bool:
        """Execute one round's calls (concurrently, until ``deadline`` in loop time) and record
        every result; True if the round moved the conversation to another stage."""
        host = self._host
        budget = self._limit - self.count
        host.conversation.append(
            {"role": "assistant", "content": None, "tool_calls": [c.to_message() for c in calls]}
        )
        self._open_calls = list(calls)
        self._results = {}
        pending: dict[str, asyncio.Task[str]] = {}
        decision: Decision | None = None
        for index, call in enumerate(calls):
            self._facts.tools_called.add(call.name)
            host.emit("tool_call_start", call=_call_dict(call))
            if index >= budget:
                self._fail_call(call, "tool_call", "tool call limit for this turn reached")
            elif call.name == TRANSITION_TOOL:
                try:
                    decision = self._decide(call, decision is not None)
                except InvalidToolCall as exc:
                    self._fail_call(call, "tool_call", str(exc))
                else:
                    stage = decision[0].action.target_stage
                    self._finish_call(call, json.dumps({"ok": True, "stage": stage}), 0.0)
            else:
                if self._delegates(call):
                    run = self._delegate(call)
                elif self._transfers(call):
                    run = self._transfer(call)
                else:
                    run = self._call_tool(call)
                pending[call.id] = asyncio.create_task(run, name=f"tool:{call.name}:{call.id}")
        self.count += min(len(calls), budget)
        if pending:
            started = time.monotonic()
            finishing = {
                call.id
                for call in calls
                if call.id in pending and self._finishes_on_interrupt(call.name)
            }
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.gather(
                        *(
                            asyncio.shield(task) if call_id in finishing else task
                            for call_id, task in pending.items()
                        ),
                        return_exceptions=True,
                    )
            except asyncio.CancelledError:
                # interrupted: tools that must not stop half-way run on; the turn's exit
                # waits for them so their real results enter the history. One still waiting
                # for the confirmation of a preemptive turn has not started: it never will.
                self.finishing = [
                    task
                    for call_id, task in pending.items()
                    if call_id in finishing and call_id in self._acting and not task.done()
                ]
                raise
            except TimeoutError:
                # the timeout cancelled the gather and with it every unfinished tool
                for call in calls:
                    if call.id in pending:
                        self._fail_call(
                            call,
                            "tool",
                            "the turn's tool time limit was reached",
                            time.monotonic() - started,
                        )
            finally:
                for task in pending.values():
                    if not task.done() and task not in self.finishing:
                        task.cancel()
        self.close_open(_error("no result"))
        if decision is None:
            return False
        transition, reason, data, summary = decision
        host.transition(transition, reason=reason, data=data, keep=[user_message], summary=summary)
        return True

    def close_open(self, default: str = CANCELLED_RESULT) -> None:
        """Append a result message for every open call, in call order: its own result, else
        ``default``."""
        for call in self._open_calls:
            content = self._results.get(call.id, default)
            self._host.conversation.append(
                {"role": "tool", "tool_call_id": call.id, "content": content}
            )
        self._open_calls = []

    def _finishes_on_interrupt(self, name: str) -> bool:
        if name == TRANSFER_TOOL:
            return self._host.engine.transfer() is not None  # a transfer cannot stop half-way
        tool = self._host.engine.playbook.tools.get(name)
        return tool is not None and tool.on_interrupt == "finish"

    async def _call_tool(self, call: ToolCallRequest) -> str:
        engine = self._host.engine
        started = time.monotonic()
        tool = engine.find_tool(call.name)
        offered = tool is not None and tool in engine.tools()
        try:
            if tool is None or not offered:
                raise InvalidToolCall(f"unknown tool {call.name!r}")
            if tool.side_effects and self._confirmed is not None:
                await self._confirmed.wait()  # never act on words the caller may not have said
                started = time.monotonic()
            self._acting.add(call.id)
            result = await tool.call(call.arguments)
        except ToolError as exc:
            source = "tool_call" if isinstance(exc, InvalidToolCall) else "tool"
            self._fail_call(call, source, str(exc), time.monotonic() - started)
            return _error(str(exc))
        self._finish_call(call, result, time.monotonic() - started)
        return result

    def _delegates(self, call: ToolCallRequest) -> bool:
        return call.name == DELEGATE_TOOL and self._host.engine.stage.delegates is not None

    async def _delegate(self, call: ToolCallRequest) -> str:
        """Run a ``delegate`` call (see :mod:`playbooks.delegation`) and record its result."""
        started = time.monotonic()
        try:
            result = await self._host.delegate(call.arguments, self._confirmed)
        except InvalidToolCall as exc:
            self._fail_call(call, "tool_call", str(exc))
            return _error(str(exc))
        self._finish_call(call, result, time.monotonic() - started)
        return result

    def _transfers(self, call: ToolCallRequest) -> bool:
        return call.name == TRANSFER_TOOL and self._host.engine.transfer() is not None

    async def _transfer(self, call: ToolCallRequest) -> str:
        """Run a ``transfer_call`` call (see :mod:`playbooks.transfer`) once the turn is
        confirmed, and record its result."""
        if self._confirmed is not None:
            await self._confirmed.wait()  # never transfer on words the caller may not have said
        started = time.monotonic()
        self._acting.add(call.id)
        try:
            result, outcome = await self._host.transfer(call.arguments)
        except InvalidToolCall as exc:
            self._fail_call(call, "tool_call", str(exc))
            return _error(str(exc))
        self.transferred = self.transferred or outcome.ok
        failed = outcome.status == "failed"
        self._finish_call(call, result, time.monotonic() - started, failed=failed)
        return result

    def _decide(self, call: ToolCallRequest, already: bool) -> Decision:
        """The transition a ``playbook_transition`` call asks for, with its reason, data and
        handoff summary; raises InvalidToolCall."""
        engine = self._host.engine
        arguments = tool_arguments(call.arguments)
        target = arguments.get("target_stage")
        transition = engine.decision_for(str(target)) if target else None
        if transition is None:
            allowed = [t.action.target_stage for t in engine.decision_transitions()]
            raise InvalidToolCall(f"target_stage must be one of {allowed}")
        if already:
            raise InvalidToolCall("only one stage transition per turn")
        summary = arguments.get("summary")
        summary = summary.strip() if isinstance(summary, str) and summary.strip() else None
        condition = transition.condition
        if (
            summary is None
            and isinstance(condition, LLMDecisionCondition)
            and condition.require_summary
        ):
            raise InvalidToolCall(
                f"summary is required to move to {transition.action.target_stage!r}: the"
                " handoff notes (what the caller wants, the facts gathered so far)"
            )
        data = arguments.get("data")
        reason = arguments.get("reason")
        data = data if isinstance(data, dict) else {}
        return transition, str(reason) if reason else None, data, summary

    def _finish_call(
        self, call: ToolCallRequest, result: str, duration_s: float, *, failed: bool = False
    ) -> bool:
        """Record ``call``'s result (False if it already had one)."""
        if call.id in self._results:
            return False
        self._results[call.id] = result
        self._host.emit(
            "tool_call_complete",
            call=_call_dict(call),
            result=result,
            error=failed,
            duration_ms=round(duration_s * 1000, 1),
        )
        return True

    def _fail_call(
        self, call: ToolCallRequest, source: str, message: str, duration_s: float = 0.0
    ) -> None:
        """Give ``call`` an error result for the LLM and report an ``error`` event: ``source``
        is ``tool_call`` for a call the LLM got wrong, ``tool`` for a tool that failed."""
        if self._finish_call(call, _error(message), duration_s, failed=True):
            self._host.emit("error", source=source, message=message, tool=call.name)


def _call_dict(call: ToolCallRequest) -> dict[str, Any]:
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


def _error(message: str) -> str:
    return json.dumps({"error": message})
