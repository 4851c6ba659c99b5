"""One conversation through a playbook: its history, its stage (the engine) and its events.

:meth:`PlaybookOrchestrator.turn` starts a :class:`~playbooks.turn.Turn` (one user message and
the agent's answer; the usage is there). The orchestrator serves its turns through the public
methods :class:`~playbooks.turn.TurnHost` names, and can undo a turn with :meth:`snapshot` and
:meth:`restore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .context import PlaybookContext, provide_context
from .delegation import Delegator
from .engine import EngineSnapshot, IntentResult, PlaybookEngine
from .events import EventBus, EventHandler, EventType
from .guided import GuidedMemory
from .history import Conversation, Message
from .identity import language_instruction
from .llm import ChatClient, ChatRequest, LLMError
from .loader import LoadedPlaybook
from .models import NamedToolChoice, Stage, ToolCalling, Transition
from .transfer import TransferOutcome, Transferrer, parse_transfer_call
from .turn import Turn

__all__ = ["OrchestratorOptions", "PlaybookOrchestrator", "Snapshot", "Turn"]

log = logging.getLogger(__name__)

INTENT_MAX_TOKENS = 64
"""The intent classifier's answer is a short JSON object; a model that does not stop after it
(a small one may go on until its context is full, a minute on a CPU) is cut off there, and
the turn goes on without waiting for it."""

DEFAULT_FALLBACK = "Sorry, I'm having trouble right now."
ITERATIVE_NOTE = (
    "Work step by step: call your tools as often as the task needs, check each result, and"
    " answer only when the task is done or you need something from the caller."
)


@dataclass(frozen=True)
class OrchestratorOptions:
    max_tool_calls_per_turn: int = 10
    phase1_timeout_ms: int = 60_000
    history_limit: int = 50
    fallback_answer: str | None = None
    """The line said when a turn fails, over the playbook's (the server's own: it has no LLM);
    None: the spoken language's ``fallback``, the playbook's, else :data:`DEFAULT_FALLBACK`."""
    llm_timeout_ms: int = 10_000
    """The longest the LLM may keep the turn waiting: for a round to start streaming (its
    retries included) or for the round's next chunk. Past it the round fails like an unreachable
    endpoint: an ``error`` event, and the fallback line (after what was already said)."""
    tool_calling: ToolCalling = "native"
    """Who calls the tools where the playbook does not say (its ``llm_config``): the model,
    or the engine (``guided``, for models too small to call tools: :mod:`playbooks.guided`)."""


class PlaybookOrchestrator:
    """Runs one conversation through a playbook. One turn at a time."""

    def __init__(
        self,
        playbook: LoadedPlaybook,
        llm: ChatClient | None,
        options: OrchestratorOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        transferrer: Transferrer | None = None,
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
        self._stage_at_turn_start = self.engine.stage.id
        self._prefills: set[asyncio.Task[None]] = set()
        """Prefills of a new stage's prompt still running (kept so they are not collected)."""
        self._hooks: set[asyncio.Future[Any]] = set()
        """Async stage hooks still running."""
        self.guided_memory = GuidedMemory()
        """What guided tool calling has learned of this call (see ``tool_calling``)."""
        self._greeting_due: str | None = None
        """The greeting of a stage entered by a transition, until it is said."""
        self._greeting_note: str | None = None
        """The greeting said (or due) in this turn, for the prompt."""
        self.engine.on_language = self._language_changed
        self.transferrer = transferrer
        """Carries out ``transfer_call`` (a voice call's, given by the server that builds it);
        None: transfers fail as not supported (a text chat)."""

    @property
    def client(self) -> ChatClient:
        """The LLM; raises :class:`LLMError` when none is configured (turns then answer with
        the fallback line)."""
        if self.llm is None:
            raise LLMError("no LLM endpoint is configured")
        return self.llm

    @property
    def fallback_answer(self) -> str:
        """The line said when a turn fails: the options' line, the spoken language's, the
        playbook's, else :data:`DEFAULT_FALLBACK`."""
        spec = self.engine.playbook.spec
        language = spec.languages.get(self.engine.language or "")
        spoken = language.fallback if language is not None else None
        return self.options.fallback_answer or spoken or spec.fallback or DEFAULT_FALLBACK

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
        preemptive turn the caller talked on through). Later changes do not reach it."""
        return Snapshot(
            messages=copy.deepcopy(self.conversation.messages),
            engine=self.engine.snapshot(),
            guided=copy.deepcopy(self.guided_memory),
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Put the conversation and stage state back to ``snapshot`` (which stays reusable). A
        stage or language the undone turn had changed is announced again (``stage_entered``
        with ``restored``, ``language_changed``), so listeners end up where the conversation
        is. A greeting due is dropped."""
        engine = self.engine
        stage_before, language_before = engine.stage, engine.language
        self.conversation.messages[:] = copy.deepcopy(snapshot.messages)
        engine.restore(snapshot.engine)
        self.guided_memory = copy.deepcopy(snapshot.guided)
        self._greeting_due = self._greeting_note = None
        if engine.stage is not stage_before:
            stage = engine.stage
            self._events.emit(
                "stage_entered", stage={"id": stage.id, "name": stage.name}, restored=True
            )
        if engine.language != language_before:
            self._language_changed(engine.language)

    async def aclose(self) -> None:
        """Stop the work the conversation left running (prefills of a new stage's prompt):
        before the LLM they talk to is closed. Idempotent."""
        for task in tuple(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)

    async def respond(self, user_text: str) -> str:
        """Run a whole turn and return its answer (for text interfaces and tests)."""
        async with self.turn(user_text) as turn:
            async for _ in turn:
                pass
        return turn.answer

    # -- what a turn uses (playbooks.turn.TurnHost); not for other callers ------------------------

    def emit(self, type: EventType, **data: Any) -> None:
        """Report an event to the subscribers (see :meth:`on`)."""
        self._events.emit(type, **data)

    def begin_turn(self) -> None:
        """A turn starts: no other may (see :meth:`turn`) until :meth:`end_turn`; the greeting
        due (if any) is this turn's to say, so the prompt mentions it."""
        self._turn_active = True
        self._greeting_note = self._greeting_due
        self._stage_at_turn_start = self.engine.stage.id
        provide_context(self.context)  # for the turn's tool calls

    def end_turn(self) -> None:
        """The turn ended, completed or not. A turn that moved to another stage has the new
        stage's prompt prefilled (when the LLM keeps prompts, see :meth:`ChatClient.prefill`),
        while its answer is still being spoken: the next turn pays only for its new words."""
        self._turn_active = False
        llm = self.llm
        if llm is None or not llm.prefills or self.engine.stage.id == self._stage_at_turn_start:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to gain
            task = asyncio.get_running_loop().create_task(
                llm.prefill(self.request(with_tools=True, first_round=True)),
                name=f"prefill:{self.engine.stage.id}",
            )
            self._prefills.add(task)
            task.add_done_callback(self._prefills.discard)

    def request(self, *, with_tools: bool, first_round: bool) -> ChatRequest:
        """The next LLM request in the current stage: its prompt, history and model settings;
        with its tools if ``with_tools``; ``first_round`` applies the stage's ``tool_choice``."""
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

    async def read_ahead(self, words: str) -> bool:
        """Have the endpoint read the first request of a turn that begins with ``words`` (the
        stage's prompt and tools, the history, those words) while the caller is still speaking,
        so that the turn's own request finds all but its last words cached. Only for endpoints
        that keep prompts (:attr:`ChatClient.prefills`: llama.cpp's); returns whether a request
        was sent (its failure is only logged)."""
        if self.llm is None or not self.llm.prefills or not words.strip():
            return False
        request = self.request(with_tools=True, first_round=True)
        messages = [*request.messages, {"role": "user", "content": words}]
        await self.llm.prefill(dataclasses.replace(request, messages=messages))
        return True

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

    async def classify_intent(self, user_text: str, intents: Sequence[str]) -> IntentResult:
        """The intent of ``user_text`` among ``intents``, by the stage's LLM; ``"none"`` (and an
        ``error`` event) when the LLM fails."""
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
            max_tokens=INTENT_MAX_TOKENS,
        )
        try:
            return _parse_intent(await self.client.complete(request))
        except LLMError as exc:
            self._events.emit("error", source="intent", message=str(exc))
            return IntentResult("none", 0.0)

    def transition(
        self,
        transition: Transition,
        *,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
        keep: Sequence[Message] = (),
        summary: str | None = None,
    ) -> None:
        """Move stages, emit the transition's events and apply the action's history effects;
        ``keep`` survives clear_history, after the handoff ``summary`` (when given) as an
        assistant note. The new stage's greeting becomes due."""
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
        self._run_hook(old, old.on_exit)
        if action.clear_history:
            self.conversation.clear()
            if summary:
                note = f"Handoff notes from the previous stage: {summary}"
                self.conversation.append({"role": "assistant", "content": note, "handoff": True})
            for message in keep:
                self.conversation.append(message)
        self._events.emit("stage_entered", stage=_stage_event(new))
        self._greeting_due = self._greeting_note = new.greeting or None
        self._run_hook(new, new.on_enter)

    def context(self, stage: Stage | None = None) -> PlaybookContext:
        """The conversation as a tool or a hook sees it, in ``stage`` (default: the current
        one)."""
        spec = self.engine.playbook.spec
        stage = stage or self.engine.stage
        return PlaybookContext(
            playbook_id=spec.id,
            version=spec.version,
            metadata=spec.metadata,
            stage_id=stage.id,
            stage_metadata=stage.metadata,
            data=dict(self.engine.context),
        )

    def _run_hook(self, stage: Stage, name: str | None) -> None:
        """Call a stage's ``on_enter`` / ``on_exit`` function with the context; an async one
        runs as a task of its own. A hook that raises is an ``error`` event, never the turn's
        failure."""
        if name is None:
            return
        function = self.engine.playbook.functions[name]

        def failed(exc: BaseException) -> None:
            log.warning("stage hook %s of %r raised: %r", name, stage.id, exc)
            self._events.emit("error", source="hook", message=f"{name}: {exc}")

        try:
            result = function(self.context(stage))
        except Exception as exc:
            failed(exc)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._hooks.add(task)

            def done(task: asyncio.Future[Any]) -> None:
                self._hooks.discard(task)
                if not task.cancelled() and task.exception() is not None:
                    failed(task.exception())  # type: ignore[arg-type]

            task.add_done_callback(done)

    def take_greeting(self) -> str | None:
        """The greeting of the stage a transition entered, once; emits ``greeting``."""
        greeting, self._greeting_due = self._greeting_due, None
        if greeting:
            self._events.emit("greeting", stage=self.engine.stage.id, text=greeting)
        return greeting

    def return_greeting(self, greeting: str) -> None:
        """``greeting`` (from :meth:`take_greeting`) was retracted with its answer: due again."""
        self._greeting_due = greeting

    async def delegate(self, arguments: str, confirmed: asyncio.Event | None) -> str:
        """Run a ``delegate`` call of the current stage (see :mod:`playbooks.delegation`);
        raises InvalidToolCall for arguments the LLM got wrong."""
        delegation = self.engine.stage.delegates
        assert delegation is not None, "the stage delegates nothing"
        return await self._delegator.run(
            delegation,
            arguments,
            self.client,
            self._default_model,
            confirmed,
            language=self.engine.language,
        )

    async def transfer(self, arguments: str) -> tuple[str, TransferOutcome]:
        """Carry out a ``transfer_call`` call of the current stage through :attr:`transferrer`
        (see :mod:`playbooks.transfer`): emits ``transfer_started``, then
        ``transfer_answered``, ``transfer_requested`` (asked, not confirmed) or
        ``transfer_failed``; returns the tool's JSON result and the outcome. Raises
        InvalidToolCall for arguments the LLM got wrong."""
        transfer = self.engine.transfer()
        assert transfer is not None, "the stage transfers nowhere"
        request = parse_transfer_call(arguments, transfer)
        described = {"destination": request.destination, "mode": request.mode}
        self._events.emit("transfer_started", **described, reason=request.reason)
        outcome = TransferOutcome.failed("not_supported", "this conversation has no phone line")
        try:
            if self.transferrer is not None:
                outcome = await self.transferrer(request)
        except asyncio.CancelledError:
            self._events.emit("transfer_failed", **described, reason="cancelled", detail=None)
            raise
        except Exception as exc:  # a transport bug: the conversation goes on
            log.exception("transfer to %s failed", request.destination)
            outcome = TransferOutcome.failed("failed", f"{type(exc).__name__}: {exc}")
        if outcome.status == "failed":
            self._events.emit(
                "transfer_failed", **described, reason=outcome.reason, detail=outcome.detail
            )
        elif outcome.status == "requested":
            self._events.emit("transfer_requested", **described, how=outcome.how)
        else:
            self._events.emit("transfer_answered", **described, how=outcome.how)
        return outcome.for_llm(request), outcome

    def _language_changed(self, code: str | None) -> None:
        instruction = language_instruction(self.engine.playbook.spec, code)
        self._events.emit("language_changed", language=code, instruction=instruction)


@dataclass(frozen=True)
class Snapshot:
    """What :meth:`PlaybookOrchestrator.restore` puts back: the conversation's messages, the
    engine's state and what guided tool calling had learned."""

    messages: list[Message]
    engine: EngineSnapshot
    guided: GuidedMemory


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


def _stage_event(stage: Stage) -> dict[str, Any]:
    event: dict[str, Any] = {"id": stage.id, "name": stage.name}
    if stage.metadata:
        event["metadata"] = stage.metadata
    return event
