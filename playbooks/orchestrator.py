"""Two-phase turns: a silent tool loop (Phase 1), then the answer streamed as text (Phase 2).

Usage::

    async with orchestrator.turn("where is my order?") as turn:
        async for delta in turn:
            if isinstance(delta, Retraction): ...  # drop what you buffered of this answer
            else: speak(delta)
            turn.mark_delivered(text_that_was_heard)

Leaving the ``async with`` block by an exception (cancellation included, i.e. barge-in) ends the
turn as interrupted: history then keeps the completed tool pairs, gives in-flight tool calls a
"cancelled" result, and records only the delivered part of the answer, marked interrupted.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from .delegation import DELEGATE_TOOL, Delegator
from .engine import (
    TRANSITION_TOOL,
    IntentResult,
    PlaybookEngine,
    TurnFacts,
)
from .events import EventBus, EventHandler, Retraction
from .history import Conversation, Message
from .identity import language_instruction
from .llm import ChatClient, ChatRequest, LLMError, ToolCallRequest
from .loader import LoadedPlaybook
from .models import LLMDecisionCondition, NamedToolChoice, Stage, Transition
from .tools import InvalidToolCall, ToolError

__all__ = ["OrchestratorOptions", "PlaybookOrchestrator", "Snapshot", "Turn"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_FALLBACK = "Sorry, I'm having trouble right now."
ITERATIVE_NOTE = (
    "Work step by step: call your tools as often as the task needs, check each result, and"
    " answer only when the task is done or you need something from the caller."
)
CANCELLED_RESULT = json.dumps({"error": "cancelled: the caller interrupted before it finished"})


@dataclass(frozen=True)
class OrchestratorOptions:
    max_tool_calls_per_turn: int = 10
    phase1_timeout_ms: int = 60_000
    history_limit: int = 50
    fallback_answer: str = DEFAULT_FALLBACK
    llm_timeout_ms: int = 10_000
    """The longest the LLM may keep the turn waiting: for a round to start streaming (its
    retries included) or for the round's next chunk. Past it the round fails like an unreachable
    endpoint: an ``error`` event, and the fallback line (after what was already said)."""


class PlaybookOrchestrator:
    """Runs one conversation through a playbook. One turn at a time."""

    def __init__(
        self,
        playbook: LoadedPlaybook,
        llm: ChatClient | None,
        options: OrchestratorOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or OrchestratorOptions()
        self.llm = llm
        self.engine = PlaybookEngine(playbook, clock)
        self.conversation = Conversation(self.options.history_limit)
        self._events = EventBus()
        self._delegator = Delegator(
            playbook, self._events.emit, max_tool_calls=self.options.max_tool_calls_per_turn
        )
        self._turn_active = False
        self._greeting_due: str | None = None
        """The greeting of a stage entered by a transition, until it is said."""
        self._greeting_note: str | None = None
        """The greeting said (or due) in this turn, for the prompt."""
        self.engine.on_language = self._language_changed

    @property
    def client(self) -> ChatClient:
        """The LLM; raises :class:`LLMError` when none is configured (turns then answer with
        the fallback line)."""
        if self.llm is None:
            raise LLMError("no LLM endpoint is configured")
        return self.llm

    @property
    def _default_model(self) -> str:
        return self.llm.model if self.llm is not None else ""

    def on(self, handler: EventHandler) -> Callable[[], None]:
        """Subscribe to events; returns the unsubscribe function."""
        return self._events.subscribe(handler)

    def greet(self) -> str | None:
        """The current stage's greeting, recorded as said by the assistant; None if it has none."""
        greeting = self.engine.stage.greeting
        if greeting:
            self.record_said(greeting)
        return greeting

    def record_said(self, text: str, *, interrupted: bool = False) -> None:
        """Record something the assistant said outside a turn (a spoken greeting: as far as it
        was heard). Nothing is recorded for empty text."""
        if text:
            message: Message = {"role": "assistant", "content": text}
            if interrupted:
                message["interrupted"] = True
            self.conversation.append(message)

    def turn(self, user_text: str, confirmed: asyncio.Event | None = None) -> Turn:
        """A turn answering ``user_text``; use as ``async with`` and iterate it. With
        ``confirmed`` (a preemptive turn), tools with side effects wait until it is set."""
        if self._turn_active:
            raise RuntimeError("a turn is already running in this conversation")
        return Turn(self, user_text, confirmed)

    def snapshot(self) -> Snapshot:
        """The conversation and stage state, to :meth:`restore` if a turn must be undone (a
        preemptive turn the caller talked on through)."""
        engine = self.engine
        return Snapshot(
            messages=copy.deepcopy(self.conversation.messages),
            stage=engine.stage,
            turns_in_stage=engine.turns_in_stage,
            entered_at=engine.entered_at,
            context=copy.deepcopy(engine.context),
            history=list(engine.history),
            entry_note=engine.entry_note,
            handoff=engine.handoff,
            language=engine.language,
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Put the conversation and stage state back to ``snapshot``. A stage or language the
        undone turn had changed is announced again (``stage_entered`` with ``restored``,
        ``language_changed``), so listeners end up where the conversation is."""
        engine = self.engine
        stage_before, language_before = engine.stage, engine.language
        self.conversation.messages[:] = snapshot.messages
        engine.stage = snapshot.stage
        engine.turns_in_stage = snapshot.turns_in_stage
        engine.entered_at = snapshot.entered_at
        engine.context = snapshot.context
        engine.history[:] = snapshot.history
        engine.entry_note = snapshot.entry_note
        engine.handoff = snapshot.handoff
        engine.language = snapshot.language
        self._greeting_due = self._greeting_note = None
        if engine.stage is not stage_before:
            stage = engine.stage
            self._events.emit(
                "stage_entered", stage={"id": stage.id, "name": stage.name}, restored=True
            )
        if engine.language != language_before:
            self._language_changed(engine.language)

    async def respond(self, user_text: str) -> str:
        """Run a whole turn and return its answer (for text interfaces and tests)."""
        async with self.turn(user_text) as turn:
            async for _ in turn:
                pass
        return turn.answer

    # -- pieces the Turn uses --------------------------------------------------------------------

    def _request(self, *, with_tools: bool, first_round: bool) -> ChatRequest:
        stage = self.engine.stage
        config = self.engine.llm_config()
        tools = self.engine.tool_schemas() if with_tools and stage.tool_choice != "none" else []
        choice: str | dict[str, Any] | None = None
        if tools:
            choice = "auto"
            if first_round and isinstance(stage.tool_choice, NamedToolChoice):
                choice = {"type": "function", "function": {"name": stage.tool_choice.tool_name}}
            elif first_round and stage.tool_choice == "required":
                choice = "required"
        return ChatRequest(
            messages=self.conversation.for_request(self._system_prompt()),
            model=config.model or self._default_model,
            tools=tools or None,
            tool_choice=choice,
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            top_p=config.top_p,
        )

    def _system_prompt(self) -> str:
        """The engine's prompt; an iterative stage adds how to work and the described
        transitions that can end its loop (:meth:`PlaybookEngine.loop_exits`)."""
        prompt = self.engine.system_prompt()
        if self._greeting_note:
            prompt += (
                f'\n\nOn entering this stage you greet the caller with: "{self._greeting_note}"'
                " Go on from there; do not greet again."
            )
        if self.engine.stage.mode != "iterative":
            return prompt
        # only what can end the tool loop: the caller's words were examined before it
        exits = [f"- {t.description}" for t in self.engine.loop_exits() if t.description]
        ends = "\n".join(["This stage ends when:", *exits]) if exits else ""
        return "\n\n".join(part for part in (prompt, ITERATIVE_NOTE, ends) if part)

    async def _classify_intent(self, user_text: str, intents: Sequence[str]) -> IntentResult:
        listing = "\n".join(f"- {intent}" for intent in intents)
        prompt = (
            "Classify the user's message into exactly one of these intents, or none:\n"
            f"{listing}\n"
            'Answer with JSON only: {"intent": "<intent or none>", "confidence": <0 to 1>}.'
        )
        request = ChatRequest(
            messages=[
                {"role": "system", "content": prompt},
                {"role": "user", "content": user_text},
            ],
            model=self.engine.llm_config().model or self._default_model,
            temperature=0,
        )
        try:
            return _parse_intent(await self.client.complete(request))
        except LLMError as exc:
            self._events.emit("error", source="intent", message=str(exc))
            return IntentResult("none", 0.0)

    def _transition(
        self,
        transition: Transition,
        *,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
        keep: Sequence[Message] = (),
        summary: str | None = None,
    ) -> None:
        """Move stages and apply the action's history effects; ``keep`` survives clear_history,
        after the handoff ``summary`` (when given) as an assistant note."""
        old = self.engine.stage
        record = self.engine.apply(transition, reason=reason, data=data or {}, summary=summary)
        new = self.engine.stage
        action = transition.action
        self._events.emit(
            "transition_triggered",
            transition={
                "id": transition.id,
                "from": record.from_stage,
                "to": record.to_stage,
                "condition": transition.condition.type,
                "reason": reason,
                **({"summary": summary} if summary else {}),
            },
        )
        self._events.emit("stage_exited", stage={"id": old.id, "name": old.name})
        if action.clear_history:
            self.conversation.clear()
            if summary:
                note = f"Handoff notes from the previous stage: {summary}"
                self.conversation.append({"role": "assistant", "content": note, "handoff": True})
            for message in keep:
                self.conversation.append(message)
        self._events.emit("stage_entered", stage={"id": new.id, "name": new.name})
        self._greeting_due = self._greeting_note = new.greeting or None

    def _take_greeting(self) -> str | None:
        """The greeting of the stage a transition entered, once; emits ``greeting``."""
        greeting, self._greeting_due = self._greeting_due, None
        if greeting:
            self._events.emit("greeting", stage=self.engine.stage.id, text=greeting)
        return greeting

    def _language_changed(self, code: str | None) -> None:
        instruction = language_instruction(self.engine.playbook.spec, code)
        self._events.emit("language_changed", language=code, instruction=instruction)


@dataclass(frozen=True)
class Snapshot:
    """What :meth:`PlaybookOrchestrator.restore` puts back."""

    messages: list[Message]
    stage: Stage
    turns_in_stage: int
    entered_at: float
    context: dict[str, Any]
    history: list[Any]
    entry_note: str | None
    handoff: str | None = None
    language: str | None = None


class Turn:
    """One user message and the agent's answer. See the module docstring for the protocol."""

    def __init__(
        self,
        orchestrator: PlaybookOrchestrator,
        user_text: str,
        confirmed: asyncio.Event | None = None,
    ) -> None:
        self._o = orchestrator
        self.user_text = user_text
        self.confirmed = confirmed
        """Set when a preemptive turn is confirmed; None: confirmed from the start."""
        self.answer = ""
        """The answer text generated so far (after any retraction)."""
        self.delivered = ""
        """What the consumer reported as delivered to the caller."""
        self.interrupted = False
        self.tool_call_count = 0
        self.llm_first_token_s: float | None = None
        """Seconds from the answer round's request to its first text, when streamed."""
        self._facts = TurnFacts(user_text)
        self._open_calls: list[ToolCallRequest] = []
        self._results: dict[str, str] = {}
        self._answer_message: Message | None = None
        self._needs_answer_call = False
        self._phase2_announced = False
        self._round_has_text = False
        self._completed = False
        self._finishing: list[asyncio.Task[str]] = []
        """Tools left to finish after an interruption (see ``Tool.on_interrupt``)."""
        self._acting: set[str] = set()
        """Ids of tool calls whose tool has started (confirmed, when it has side effects)."""
        self._greeted: str | None = None
        """A stage's greeting said at the head of this answer (undone by a retraction)."""
        self._deltas: AsyncIterator[str | Retraction] | None = None
        self._entered = False

    def mark_delivered(self, text: str) -> None:
        """Report that ``text`` (the next part of the answer) reached the caller."""
        self.delivered += text

    async def __aenter__(self) -> Turn:
        self._o._turn_active = True
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._deltas is not None:
                await self._deltas.aclose()  # type: ignore[attr-defined]
        finally:
            try:
                if self._finishing:  # tools already acting: each bounded by its own timeout
                    await asyncio.wait(self._finishing)
            finally:
                if exc_type is not None or not self._completed:
                    self._record_interruption()
                self._o._turn_active = False

    def __aiter__(self) -> AsyncIterator[str | Retraction]:
        if not self._entered:
            raise RuntimeError("use the turn as `async with orchestrator.turn(...) as turn`")
        if self._deltas is None:
            self._deltas = self._run()
        return self._deltas

    # -- the turn --------------------------------------------------------------------------------

    async def _run(self) -> AsyncIterator[str | Retraction]:
        o = self._o
        conversation = o.conversation
        user_message: Message = {"role": "user", "content": self.user_text}
        conversation.append(user_message)
        conversation.trim(keep_from=len(conversation) - 1)
        o._greeting_note = o._greeting_due

        early = await o.engine.evaluate("before_turn", self._facts, o._classify_intent)
        if early is not None:
            o._transition(early, keep=[user_message])

        o._events.emit("phase1_start")
        needs_answer_call = o.engine.stage.mode == "single-shot"  # no tool loop at all
        failed = False
        try:
            if not needs_answer_call:
                async for delta in self._tool_loop(user_message):
                    yield delta
                needs_answer_call = self._needs_answer_call
        except LLMError as exc:
            failed = True
            o._events.emit("error", source="llm", message=str(exc))

        if needs_answer_call and not failed:
            self._announce_phase2()
            try:
                async for delta in self._answer_round():
                    yield delta
            except LLMError as exc:
                failed = True
                o._events.emit("error", source="llm", message=str(exc))

        if not self.answer.strip():
            self._announce_phase2()
            self.answer = ""
            yield self._add_text(o.options.fallback_answer)
        elif failed:  # cut off mid-answer: say so rather than trail off
            cut = "" if self.answer.rstrip()[-1] in ".!?…" else "…"
            tail = f"{cut} {o.options.fallback_answer}"
            self.answer += tail
            yield tail
        o._events.emit("phase2_complete", response=self.answer)

        self._answer_message = {"role": "assistant", "content": self.answer}
        conversation.append(self._answer_message)
        self._facts.assistant_text = self.answer
        o.engine.complete_turn()
        late = await o.engine.evaluate("after_turn", self._facts, o._classify_intent)
        if late is not None:
            o._transition(late)
            greeting = o._take_greeting()
            if greeting:  # the new stage greets after this answer
                tail = f" {greeting}"
                self.answer += tail
                self._answer_message["content"] = self.answer
                if not any(m is self._answer_message for m in conversation.messages):
                    self._answer_message = {"role": "assistant", "content": greeting}
                    conversation.append(self._answer_message)  # the history was cleared
                yield tail
        conversation.trim()
        self._completed = True

    async def _tool_loop(self, user_message: Message) -> AsyncIterator[str | Retraction]:
        """Phase 1. Yields answer text only from a round that turns out to be the answer."""
        o = self._o
        options = o.options
        loop = asyncio.get_running_loop()
        deadline = loop.time() + options.phase1_timeout_ms / 1000
        first_round = True
        while True:
            if self.tool_call_count >= options.max_tool_calls_per_turn:
                self._needs_answer_call = True
                return
            two_phase = o.engine.stage.two_phase_execution
            request = o._request(with_tools=True, first_round=first_round)
            first_round = False
            requested_at = loop.time()
            try:
                stream = await self._llm_step(o.client.stream(request), deadline)
            except TimeoutError:
                self._needs_answer_call = True
                return
            streaming_answer = False
            saw_tool_call = False
            self._round_has_text = False
            try:
                iterator = aiter(stream)
                while True:
                    try:
                        # once the answer streams, Phase 1's deadline no longer applies
                        delta = await self._llm_step(
                            anext(iterator), None if streaming_answer else deadline
                        )
                    except StopAsyncIteration:
                        break
                    if delta.is_tool_call:
                        saw_tool_call = True
                        if streaming_answer and two_phase:
                            yield Retraction(self.answer)
                            o._events.emit("answer_retracted", text=self.answer)
                            self.answer = ""
                            self.delivered = ""  # whatever was heard of it was not the answer
                            o._greeting_due = self._greeted or o._greeting_due
                            self._greeted = None
                            self._phase2_announced = False  # that announcement was premature
                            self._round_has_text = False
                            streaming_answer = False
                        continue
                    if saw_tool_call and two_phase:
                        continue  # content after tool calls belongs to the silent phase
                    if not self.answer:
                        self.llm_first_token_s = loop.time() - requested_at
                    self._announce_phase2()
                    streaming_answer = True
                    yield self._add_text(delta.text)
            except TimeoutError:
                self._needs_answer_call = True
                return
            finally:
                await stream.aclose()

            calls = stream.tool_calls
            if not calls:
                # this round is the answer, unless it said nothing (then ask once without tools)
                self._needs_answer_call = not self._round_has_text
                return
            iterative = o.engine.stage.mode == "iterative"
            transitioned = await self._run_tools(calls, deadline, user_message)
            if iterative and not transitioned:
                # the stage's exit conditions are checked after every round of tool work
                exit_ = await o.engine.evaluate("in_loop", self._facts)
                if exit_ is not None:
                    o._transition(exit_, keep=[user_message])
                    transitioned = True
            if transitioned or loop.time() >= deadline:
                self._needs_answer_call = True
                return

    async def _answer_round(self) -> AsyncIterator[str]:
        """Phase 2 as its own call: no tools, in the current stage."""
        o = self._o
        loop = asyncio.get_running_loop()
        requested_at = loop.time()
        request = o._request(with_tools=False, first_round=False)
        stream = await self._llm_step(o.client.stream(request))
        self._round_has_text = False
        try:
            iterator = aiter(stream)
            while True:
                try:
                    delta = await self._llm_step(anext(iterator))
                except StopAsyncIteration:
                    break
                if delta.text:
                    if not self.answer:
                        self.llm_first_token_s = loop.time() - requested_at
                    yield self._add_text(delta.text)
        finally:
            await stream.aclose()

    async def _llm_step(self, step: Awaitable[_T], deadline: float | None = None) -> _T:
        """Await one step of the LLM (opening a round, or the round's next chunk). Raises
        :class:`LLMError` when the LLM stays silent for ``llm_timeout_ms``, TimeoutError when
        Phase 1's ``deadline`` (loop time) comes first."""
        timeout_s = self._o.options.llm_timeout_ms / 1000
        limit = asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout_at(limit if deadline is None else min(limit, deadline)):
                return await step
        except TimeoutError:
            if deadline is not None and deadline <= limit:
                raise
            raise LLMError(f"the LLM sent nothing for {timeout_s:g} s") from None

    def _announce_phase2(self) -> None:
        """Emit ``phase1_complete`` and ``phase2_start`` once, before the answer's first text."""
        if not self._phase2_announced:
            self._phase2_announced = True
            self._o._events.emit("phase1_complete", tool_call_count=self.tool_call_count)
            self._o._events.emit("phase2_start")

    def _add_text(self, text: str) -> str:
        """Append a delta to the answer; the first delta of a later round (single-phase stages
        speak in several rounds) is separated from the text before it by a space. The greeting
        of a stage entered in this turn comes first."""
        greeting = self._o._take_greeting()
        if greeting:
            self._greeted = greeting
            self._round_has_text = False
            text = f"{greeting} {text.lstrip()}"
        if (
            not self._round_has_text
            and self.answer
            and not self.answer[-1].isspace()
            and not text[0].isspace()
        ):
            text = " " + text
        self._round_has_text = True
        self.answer += text
        return text

    async def _run_tools(
        self, calls: list[ToolCallRequest], deadline: float, user_message: Message
    ) -> bool:
        """Execute one round's calls (concurrently) and record every result; True if the
        round moved the conversation to another stage."""
        o = self._o
        budget = o.options.max_tool_calls_per_turn - self.tool_call_count
        o.conversation.append(
            {"role": "assistant", "content": None, "tool_calls": [c.to_message() for c in calls]}
        )
        self._open_calls = list(calls)
        self._results = {}
        pending: dict[str, asyncio.Task[str]] = {}
        decision: tuple[Transition, str | None, dict[str, Any], str | None] | None = None
        for index, call in enumerate(calls):
            self._facts.tools_called.add(call.name)
            o._events.emit("tool_call_start", call=_call_dict(call))
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
                run = self._delegate(call) if self._delegates(call) else self._call_tool(call)
                pending[call.id] = asyncio.create_task(run, name=f"tool:{call.name}:{call.id}")
        self.tool_call_count += min(len(calls), budget)
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
                self._finishing = [
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
                    if not task.done() and task not in self._finishing:
                        task.cancel()
        self._close_open_calls(_error("no result"))
        if decision is None:
            return False
        transition, reason, data, summary = decision
        o._transition(transition, reason=reason, data=data, keep=[user_message], summary=summary)
        return True

    def _finishes_on_interrupt(self, name: str) -> bool:
        tool = self._o.engine.playbook.tools.get(name)
        return tool is not None and tool.on_interrupt == "finish"

    async def _call_tool(self, call: ToolCallRequest) -> str:
        o = self._o
        started = time.monotonic()
        tool = o.engine.find_tool(call.name)
        offered = tool is not None and tool in o.engine.tools()
        try:
            if tool is None or not offered:
                raise InvalidToolCall(f"unknown tool {call.name!r}")
            if tool.side_effects and self.confirmed is not None:
                await self.confirmed.wait()  # never act on words the caller may not have said
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
        return call.name == DELEGATE_TOOL and self._o.engine.stage.delegates is not None

    async def _delegate(self, call: ToolCallRequest) -> str:
        """Run a ``delegate`` call (see :mod:`playbooks.delegation`) and record its result."""
        o = self._o
        started = time.monotonic()
        delegation = o.engine.stage.delegates
        assert delegation is not None
        try:
            result = await o._delegator.run(
                delegation,
                call.arguments,
                o.client,
                o._default_model,
                self.confirmed,
                language=o.engine.language,
            )
        except InvalidToolCall as exc:
            self._fail_call(call, "tool_call", str(exc))
            return _error(str(exc))
        self._finish_call(call, result, time.monotonic() - started)
        return result

    def _decide(
        self, call: ToolCallRequest, already: bool
    ) -> tuple[Transition, str | None, dict[str, Any], str | None]:
        """The transition a ``playbook_transition`` call asks for, with its reason, data and
        handoff summary; raises InvalidToolCall."""
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            raise InvalidToolCall("arguments are not valid JSON") from None
        if not isinstance(arguments, dict):
            raise InvalidToolCall("arguments must be a JSON object")
        target = arguments.get("target_stage")
        transition = self._o.engine.decision_for(str(target)) if target else None
        if transition is None:
            allowed = [t.action.target_stage for t in self._o.engine.decision_transitions()]
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
        self._o._events.emit(
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
            self._o._events.emit("error", source=source, message=message, tool=call.name)

    def _close_open_calls(self, default: str) -> None:
        """Append a result message for every open call, in call order."""
        for call in self._open_calls:
            content = self._results.get(call.id, default)
            self._o.conversation.append(
                {"role": "tool", "tool_call_id": call.id, "content": content}
            )
        self._open_calls = []

    def _record_interruption(self) -> None:
        """Leave a valid history after the turn was abandoned mid-way."""
        self.interrupted = True
        self._close_open_calls(CANCELLED_RESULT)
        conversation = self._o.conversation
        recorded = [i for i, m in enumerate(conversation.messages) if m is self._answer_message]
        if recorded:  # the answer was complete; what came after it was interrupted
            message = conversation.messages[recorded[0]]
            if not self.delivered:
                del conversation.messages[recorded[0]]  # by position: equal messages may exist
            elif self.delivered.split() != self.answer.split():
                message["content"] = self.delivered
                message["interrupted"] = True
        elif self.delivered:
            conversation.append(
                {"role": "assistant", "content": self.delivered, "interrupted": True}
            )
        conversation.trim()


def _call_dict(call: ToolCallRequest) -> dict[str, Any]:
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


def _error(message: str) -> str:
    return json.dumps({"error": message})


_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def _parse_intent(text: str) -> IntentResult:
    match = _JSON_OBJECT.search(text)
    try:
        data = json.loads(match.group(0)) if match else {}
        intent = str(data.get("intent") or "none")
        confidence = float(data.get("confidence", 0.0))
    except (ValueError, TypeError, AttributeError):
        log.warning("unparseable intent classification: %r", text[:200])
        return IntentResult("none", 0.0)
    return IntentResult(intent, max(0.0, min(1.0, confidence)))
