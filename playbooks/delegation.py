"""Delegation: a stage hands a task to worker stages and answers with their results.

A stage with ``delegates`` is offered the built-in ``delegate`` tool. One call runs the chosen
worker stages, all at once (``parallel``) or one after another (``sequence``, each seeing the
results before it), each as a sub-conversation: the worker stage's own prompt (with its persona's
identity block and the conversation's language line) and tools, a fresh history holding only the
task, its own tool loop (at most ``max_tool_calls`` calls; a ``single-shot`` stage gets one call
without tools) and a final answer collected as text, all within ``timeout_ms``. No transitions
happen inside a worker. A
worker that fails (LLM error, time limit, no answer) gives an error entry, never an exception;
the results go back to the delegating stage as the tool's JSON result. Worker tools with side
effects wait for ``confirmed`` like the delegating turn's own tools, and one marked
``on_interrupt="finish"`` runs to its end when the delegation is cancelled (barge-in, time
limit): its completion is still reported (``tool_call_complete``), its result goes nowhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import DELEGATE_TOOL
from .identity import identity_block, language_instruction, stage_persona
from .llm import ChatClient, ChatRequest, ToolCallRequest
from .loader import LoadedPlaybook
from .models import Delegation, Playbook, Stage
from .tools import InvalidToolCall, Tool, ToolError, tool_arguments

__all__ = ["DELEGATE_TOOL", "Delegator", "WorkerResult", "delegate_tool_schema", "worker_prompt"]

log = logging.getLogger(__name__)

WORKER_NOTE = (
    "Another agent delegated a task to you. Use your tools as the task needs, then reply with"
    " the result only, briefly and factually."
)

Emit = Callable[..., None]
"""``emit(event_type, **data)``: the orchestrator's event bus."""


@dataclass(frozen=True)
class WorkerResult:
    """One worker's outcome: ``answer`` or ``error`` (exactly one is set)."""

    worker: str
    answer: str | None
    error: str | None
    tool_calls: int
    duration_ms: float

    def for_llm(self) -> dict[str, Any]:
        if self.error is not None:
            return {"worker": self.worker, "error": self.error}
        return {"worker": self.worker, "result": self.answer}

    def summary(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "ok": self.error is None,
            "tool_calls": self.tool_calls,
            "duration_ms": self.duration_ms,
        }


def delegate_tool_schema(delegation: Delegation, descriptions: dict[str, str]) -> dict[str, Any]:
    """The ``delegate`` tool for a stage with ``delegation``; ``descriptions`` by worker id."""
    listing = "; ".join(f"{w}: {descriptions.get(w, w)}" for w in delegation.workers)
    how = "at the same time" if delegation.mode == "parallel" else "one after another"
    return {
        "type": "function",
        "function": {
            "name": DELEGATE_TOOL,
            "description": (
                f"Hand a task to worker agents ({listing}); they work {how} and their results"
                " come back as this tool's result."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "task": {
                        "type": "string",
                        "description": "What the workers should do, with every fact they need.",
                    },
                    "workers": {
                        "type": "array",
                        "items": {"type": "string", "enum": list(delegation.workers)},
                        "description": "Which workers to ask (default: all of them).",
                    },
                },
                "required": ["task"],
            },
        },
    }


def worker_prompt(spec: Playbook, stage: Stage, language: str | None) -> str:
    """A worker's system prompt: the global prompt, the worker stage's identity block and
    prompt, :data:`WORKER_NOTE`, and the language line of ``language``."""
    parts = (
        spec.global_system_prompt,
        identity_block(stage_persona(spec, stage)),
        stage.system_prompt,
        WORKER_NOTE,
        language_instruction(spec, language),
    )
    return "\n\n".join(part.strip() for part in parts if part and part.strip())


@dataclass(frozen=True)
class _Call:
    """What every worker of one ``delegate`` call shares."""

    delegation: Delegation
    client: ChatClient
    model: str
    confirmed: asyncio.Event | None
    language: str | None


def _parse(arguments: str, delegation: Delegation) -> tuple[str, list[str]]:
    """The task and the workers a ``delegate`` call asks for; raises InvalidToolCall."""
    parsed = tool_arguments(arguments)
    task = parsed.get("task")
    if not isinstance(task, str) or not task.strip():
        raise InvalidToolCall("task is required: say what the workers should do")
    chosen = parsed.get("workers") or list(delegation.workers)
    if not isinstance(chosen, list) or any(w not in delegation.workers for w in chosen):
        raise InvalidToolCall(f"workers must be a list drawn from {list(delegation.workers)}")
    return task.strip(), list(dict.fromkeys(chosen))


class Delegator:
    """Runs the ``delegate`` calls of one conversation.

    ``max_tool_calls`` is each worker's tool-call limit when the delegation sets none.
    """

    def __init__(self, playbook: LoadedPlaybook, emit: Emit, *, max_tool_calls: int) -> None:
        self.playbook = playbook
        self.emit = emit
        self.max_tool_calls = max_tool_calls
        self.finishing: set[asyncio.Task[str]] = set()
        """Worker tools running on after their delegation was cancelled."""

    async def run(
        self,
        delegation: Delegation,
        arguments: str,
        client: ChatClient,
        model: str,
        confirmed: asyncio.Event | None = None,
        *,
        language: str | None = None,
    ) -> str:
        """Run one ``delegate`` call; returns the JSON result for the delegating LLM. Raises
        InvalidToolCall for arguments the LLM got wrong (before any worker starts). ``language``
        is the conversation's (the workers' prompts end with its line)."""
        task, workers = _parse(arguments, delegation)
        self.emit(
            "delegation_start", workers=workers, mode=delegation.mode, task=task, say=delegation.say
        )
        call = _Call(delegation, client, model, confirmed, language)
        started = time.monotonic()
        results: list[WorkerResult] = []
        try:
            if delegation.mode == "parallel":
                results = list(await asyncio.gather(*(self._work(w, task, call) for w in workers)))
            else:
                for worker in workers:
                    results.append(await self._work(worker, _with_results(task, results), call))
        finally:
            self.emit(
                "delegation_end",
                mode=delegation.mode,
                workers=[r.summary() for r in results],
                duration_ms=_ms_since(started),
                cancelled=len(results) < len(workers),
            )
        return json.dumps({"results": [r.for_llm() for r in results]}, ensure_ascii=False)

    async def _work(self, worker: str, task: str, call: _Call) -> WorkerResult:
        """One worker's sub-conversation, bounded by the delegation's time limit."""
        started = time.monotonic()
        counter = [0]
        answer: str | None = None
        error: str | None = None
        delegation = call.delegation
        try:
            async with asyncio.timeout(delegation.timeout_ms / 1000):
                answer = await self._converse(worker, task, call, counter)
        except TimeoutError:
            error = f"no result within {delegation.timeout_ms / 1000:g} s"
        except Exception as exc:  # a failing worker is a result, not a failed turn
            log.warning("worker %r failed: %s", worker, exc)
            error = str(exc) or type(exc).__name__
        if error is not None:
            self.emit("error", source="worker", message=error, worker=worker)
        return WorkerResult(worker, answer, error, counter[0], _ms_since(started))

    async def _converse(self, worker: str, task: str, call: _Call, counter: list[int]) -> str:
        """The worker's tool loop (none in a ``single-shot`` stage), then its answer;
        ``counter[0]`` counts its tool calls."""
        spec = self.playbook.spec
        stage = spec.stage(worker)
        config = stage.llm_config.merged_over(spec.default_llm_config)
        limit = call.delegation.max_tool_calls or self.max_tool_calls
        names = dict.fromkeys([*spec.global_tool_names, *stage.tool_names])
        tools = {n: t for n in names if (t := self.playbook.tools.get(n)) is not None}
        if stage.mode == "single-shot" or stage.tool_choice == "none":
            tools = {}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": worker_prompt(spec, stage, call.language)},
            {"role": "user", "content": task},
        ]
        while True:
            offer = tools if counter[0] < limit else {}
            request = ChatRequest(
                messages=list(messages),
                model=config.model or call.model,
                tools=[t.openai_schema() for t in offer.values()] or None,
                tool_choice="auto" if offer else None,
                temperature=config.temperature,
                max_tokens=config.max_tokens,
                top_p=config.top_p,
            )
            stream = await call.client.stream(request)
            try:
                async for _ in stream:
                    pass
            finally:
                await stream.aclose()
            calls = stream.tool_calls[: max(limit - counter[0], 0)] if offer else []
            if not calls:
                if not stream.content.strip():
                    raise ValueError("the worker gave no answer")
                return stream.content.strip()
            requested = [c.to_message() for c in calls]
            messages.append({"role": "assistant", "content": None, "tool_calls": requested})
            counter[0] += len(calls)
            results = await asyncio.gather(
                *(self._call(worker, c, offer, call.confirmed) for c in calls)
            )
            messages.extend(
                {"role": "tool", "tool_call_id": c.id, "content": result}
                for c, result in zip(calls, results, strict=True)
            )

    async def _call(
        self,
        worker: str,
        call: ToolCallRequest,
        tools: dict[str, Tool],
        confirmed: asyncio.Event | None,
    ) -> str:
        """One worker tool call; failures become an error result for the worker's LLM."""
        described = {"id": call.id, "name": call.name, "arguments": call.arguments}
        self.emit("tool_call_start", call=described, worker=worker)
        started = time.monotonic()
        failed = False
        try:
            tool = tools.get(call.name)
            if tool is None:
                raise InvalidToolCall(f"unknown tool {call.name!r}")
            if tool.side_effects and confirmed is not None:
                await confirmed.wait()  # the same preemption rule as the caller's own tools
                started = time.monotonic()
            if tool.on_interrupt == "finish":
                return await self._finish_anyway(worker, described, tool, call.arguments)
            result = await tool.call(call.arguments)
        except ToolError as exc:
            failed = True
            result = json.dumps({"error": str(exc)})
        self._completed(worker, described, result, failed, started)
        return result

    async def _finish_anyway(
        self, worker: str, described: dict[str, str], tool: Tool, arguments: str
    ) -> str:
        """Run ``tool`` to its end even if this call is cancelled; report its completion."""
        started = time.monotonic()

        async def run() -> str:
            try:
                result = await tool.call(arguments)
            except ToolError as exc:
                self._completed(worker, described, json.dumps({"error": str(exc)}), True, started)
                raise
            self._completed(worker, described, result, False, started)
            return result

        task = asyncio.create_task(run(), name=f"worker-tool:{worker}:{tool.name}")
        self.finishing.add(task)
        task.add_done_callback(self._forget)
        try:
            return await asyncio.shield(task)
        except ToolError as exc:
            return json.dumps({"error": str(exc)})

    def _forget(self, task: asyncio.Task[str]) -> None:
        self.finishing.discard(task)
        if not task.cancelled():
            task.exception()  # mark it retrieved: a ToolError was reported by the task itself

    def _completed(
        self, worker: str, described: dict[str, str], result: str, failed: bool, started: float
    ) -> None:
        self.emit(
            "tool_call_complete",
            call=described,
            result=result,
            error=failed,
            duration_ms=_ms_since(started),
            worker=worker,
        )


def _with_results(task: str, results: Sequence[WorkerResult]) -> str:
    """The task, followed by the results of the workers that ran before (sequence mode)."""
    if not results:
        return task
    lines = [
        f"- {r.worker}: {r.answer if r.error is None else 'failed: ' + r.error}" for r in results
    ]
    return "\n".join([task, "", "Results from the workers before you:", *lines])


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)
