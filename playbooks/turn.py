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

A turn drives the LLM rounds; the conversation it belongs to (:class:`TurnHost`, in practice the
:class:`~playbooks.orchestrator.PlaybookOrchestrator`) builds the requests, moves stages and keeps
the greeting state, and :class:`~playbooks.tool_calls.ToolCalls` runs the rounds' tool calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar

from .engine import IntentResult, TurnFacts
from .events import Retraction
from .guided import GuidedMemory, GuidedSteps, results_as_note, scripted_question
from .history import Message
from .llm import ChatClient, ChatRequest, ChatStream, LLMError
from .tool_calls import ToolCalls, ToolHost

if TYPE_CHECKING:
    from .orchestrator import OrchestratorOptions

__all__ = ["Turn", "TurnHost"]

_T = TypeVar("_T")

_OVERFLOW_MARGIN = 0.7
"""Of the history that fits the context by the endpoint's count, the share kept: room for the
answer and for the tokens a character count misjudges."""


class TurnHost(ToolHost, Protocol):
    """What a turn needs from its conversation, besides running tools (:class:`ToolHost`)."""

    @property
    def options(self) -> OrchestratorOptions: ...

    @property
    def fallback_answer(self) -> str:
        """The line said when a turn fails (:attr:`OrchestratorOptions.fallback_answer`)."""
        ...

    @property
    def guided_memory(self) -> GuidedMemory:
        """What guided tool steps have learned of the call."""
        ...

    @property
    def client(self) -> ChatClient:
        """The LLM; raises :class:`LLMError` when none is configured."""
        ...

    def begin_turn(self) -> None:
        """A turn starts: the greeting due (if any) is this turn's to say."""

    def end_turn(self) -> None:
        """The turn ended (completed or not): another may start."""

    def request(self, *, with_tools: bool, first_round: bool) -> ChatRequest:
        """The next LLM request in the current stage; ``first_round`` applies the stage's
        ``tool_choice``."""
        ...

    async def classify_intent(self, user_text: str, intents: Sequence[str]) -> IntentResult:
        """The intent of ``user_text`` among ``intents`` (``"none"`` on LLM failure)."""
        ...

    def take_greeting(self) -> str | None:
        """The greeting of a stage entered by a transition, once; emits ``greeting``."""
        ...

    def return_greeting(self, greeting: str) -> None:
        """A greeting from :meth:`take_greeting` was retracted with its answer: due again."""


class Turn:
    """One user message and the agent's answer. See the module docstring for the protocol."""

    def __init__(
        self,
        host: TurnHost,
        user_text: str,
        confirmed: asyncio.Event | None = None,
    ) -> None:
        self._host = host
        self.user_text = user_text
        self.confirmed = confirmed
        """Set when a preemptive turn is confirmed; None: confirmed from the start."""
        self.answer = ""
        """The answer text generated so far (after any retraction)."""
        self.delivered = ""
        """What the consumer reported as delivered to the caller."""
        self.interrupted = False
        self.llm_first_token_s: float | None = None
        """Seconds from the answer round's request to its first text, when streamed."""
        self._facts = TurnFacts(user_text)
        self._calls = ToolCalls(host, self._facts, confirmed, host.options.max_tool_calls_per_turn)
        self._answer_message: Message | None = None
        self._user_message: Message | None = None
        self._needs_answer_call = False
        self._phase2_announced = False
        self._round_has_text = False
        self._completed = False
        self._greeted: str | None = None
        """A stage's greeting said at the head of this answer (undone by a retraction)."""
        self._deltas: AsyncIterator[str | Retraction] | None = None
        self._entered = False
        self._guided_missing: tuple[str, ...] = ()
        """Guided: the details the stage's next tool still needs (the answer asks for them)."""

    @property
    def tool_call_count(self) -> int:
        """Tool calls made in this turn."""
        return self._calls.count

    @property
    def _guided(self) -> bool:
        """Whether the engine makes the current stage's tool calls (:mod:`playbooks.guided`)."""
        host = self._host
        return (host.engine.llm_config().tool_calling or host.options.tool_calling) == "guided"

    def mark_delivered(self, text: str) -> None:
        """Report that ``text`` (the next part of the answer) reached the caller."""
        self.delivered += text

    async def __aenter__(self) -> Turn:
        self._host.begin_turn()
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
                if self._calls.finishing:  # tools already acting: each bounded by its own timeout
                    await asyncio.wait(self._calls.finishing)
            finally:
                if exc_type is not None or not self._completed:
                    self._record_interruption()
                self._host.end_turn()

    def __aiter__(self) -> AsyncIterator[str | Retraction]:
        if not self._entered:
            raise RuntimeError("use the turn as `async with orchestrator.turn(...) as turn`")
        if self._deltas is None:
            self._deltas = self._run()
        return self._deltas

    # -- the turn --------------------------------------------------------------------------------

    async def _run(self) -> AsyncIterator[str | Retraction]:
        host = self._host
        conversation = host.conversation
        user_message: Message = {"role": "user", "content": self.user_text}
        self._user_message = user_message
        conversation.append(user_message)
        conversation.trim(keep_from=len(conversation) - 1)

        stage_at_start = host.engine.stage.id
        early = await host.engine.evaluate("before_turn", self._facts, host.classify_intent)
        if early is not None:
            host.transition(early, keep=[user_message])

        host.emit("phase1_start")
        needs_answer_call = host.engine.stage.mode == "single-shot"  # no tool loop at all
        failed = False
        try:
            if not needs_answer_call and self._guided:
                steps = GuidedSteps(host, self._calls, self._llm_step)
                outcome = await steps.run(user_message, self.user_text)
                self._guided_missing = outcome.missing
                stage = host.engine.stage
                question = scripted_question(
                    stage.questions, outcome, self.user_text, entered=stage.id != stage_at_start
                )
                if self._calls.transferred:
                    pass  # the caller is with a person: nothing more to say
                elif question is None:
                    needs_answer_call = True
                else:
                    self._announce_phase2()
                    yield self._add_text(question)
            elif not needs_answer_call:
                async for delta in self._tool_loop(user_message):
                    yield delta
                needs_answer_call = self._needs_answer_call
        except LLMError as exc:
            failed = True
            host.emit("error", source="llm", message=str(exc))

        if needs_answer_call and not failed:
            self._announce_phase2()
            try:
                async for delta in self._answer_round():
                    yield delta
            except LLMError as exc:
                failed = True
                host.emit("error", source="llm", message=str(exc))

        transferred = self._calls.transferred and not self.answer.strip()
        if transferred:
            pass  # the caller is with a person now: the agent has nothing more to say
        elif not self.answer.strip():
            self._announce_phase2()
            self.answer = ""
            yield self._add_text(host.fallback_answer)
        elif failed:  # cut off mid-answer: say so rather than trail off
            cut = "" if self.answer.rstrip()[-1] in ".!?…" else "…"
            tail = f"{cut} {host.fallback_answer}"
            self.answer += tail
            yield tail
        host.emit("phase2_complete", response=self.answer)

        if not transferred:
            self._answer_message = {"role": "assistant", "content": self.answer}
            conversation.append(self._answer_message)
        self._facts.assistant_text = self.answer
        host.engine.complete_turn()
        late = None
        if not transferred:  # (a conversation handed to a person moves no more)
            late = await host.engine.evaluate("after_turn", self._facts, host.classify_intent)
        if late is not None and self._answer_message is not None:
            host.transition(late)
            greeting = host.take_greeting()
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
        host = self._host
        options = host.options
        loop = asyncio.get_running_loop()
        deadline = loop.time() + options.phase1_timeout_ms / 1000
        first_round = True
        while True:
            if self.tool_call_count >= options.max_tool_calls_per_turn:
                self._needs_answer_call = True
                return
            two_phase = host.engine.stage.two_phase_execution
            requested_at = loop.time()
            try:
                stream = await self._open_round(True, first_round, user_message, deadline)
            except TimeoutError:
                self._needs_answer_call = True
                return
            first_round = False
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
                            host.emit("answer_retracted", text=self.answer)
                            self.answer = ""
                            self.delivered = ""  # whatever was heard of it was not the answer
                            if self._greeted:
                                host.return_greeting(self._greeted)
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
            iterative = host.engine.stage.mode == "iterative"
            transitioned = await self._calls.run(calls, deadline, user_message)
            if self._calls.transferred:
                return  # the caller was put through: no answer follows
            if iterative and not transitioned:
                # the stage's exit conditions are checked after every round of tool work
                exit_ = await host.engine.evaluate("in_loop", self._facts)
                if exit_ is not None:
                    host.transition(exit_, keep=[user_message])
                    transitioned = True
            if transitioned or loop.time() >= deadline:
                self._needs_answer_call = True
                return

    async def _answer_round(self) -> AsyncIterator[str]:
        """Phase 2 as its own call: no tools, in the current stage."""
        loop = asyncio.get_running_loop()
        requested_at = loop.time()
        stream = await self._open_round(False, False, self._user_message)
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

    async def _open_round(
        self,
        with_tools: bool,
        first_round: bool,
        user_message: Message | None,
        deadline: float | None = None,
    ) -> ChatStream:
        """Open the next LLM round in the current stage. A request that outgrows the model's
        context sheds the oldest history (this turn's own messages stay) and is sent once more;
        the history stays shed, so the next turns fit too."""
        host = self._host
        request = self._request(with_tools, first_round)
        try:
            return await self._llm_step(host.client.stream(request), deadline)
        except LLMError as exc:
            if exc.context_overflow is None:
                raise
            conversation = host.conversation
            turn_start = next(
                (i for i, m in enumerate(conversation.messages) if m is user_message),
                len(conversation.messages),
            )
            dropped = conversation.shed(exc.context_overflow * _OVERFLOW_MARGIN, turn_start)
            if not dropped:
                raise
            host.emit("history_trimmed", dropped=dropped, reason=str(exc))
            request = self._request(with_tools, first_round)
            return await self._llm_step(host.client.stream(request), deadline)

    def _request(self, with_tools: bool, first_round: bool) -> ChatRequest:
        """The host's request for the next round; in guided mode, with the tools' results
        given as facts (:func:`playbooks.guided.results_as_note`)."""
        request = self._host.request(with_tools=with_tools, first_round=first_round)
        if not self._guided:
            return request
        messages = results_as_note(request.messages, self._guided_missing)
        return dataclasses.replace(request, messages=messages)

    async def _llm_step(self, step: Awaitable[_T], deadline: float | None = None) -> _T:
        """Await one step of the LLM (opening a round, or the round's next chunk). Raises
        :class:`LLMError` when the LLM stays silent for ``llm_timeout_ms``, TimeoutError when
        Phase 1's ``deadline`` (loop time) comes first."""
        timeout_s = self._host.options.llm_timeout_ms / 1000
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
            self._host.emit("phase1_complete", tool_call_count=self.tool_call_count)
            self._host.emit("phase2_start")

    def _add_text(self, text: str) -> str:
        """Append a delta to the answer; the first delta of a later round (single-phase stages
        speak in several rounds) is separated from the text before it by a space. The greeting
        of a stage entered in this turn comes first."""
        greeting = self._host.take_greeting()
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

    def _record_interruption(self) -> None:
        """Leave a valid history after the turn was abandoned mid-way."""
        self.interrupted = True
        self._calls.close_open()
        conversation = self._host.conversation
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
