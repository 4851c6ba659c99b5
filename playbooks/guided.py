"""Guided tool steps, for models too small to call tools on their own.

A small model offered tools mostly answers without them, or calls them on details it made up.
In guided mode the engine makes the calls and asks the model only what it does reliably:

1. **Extract.** One completion held to a JSON schema by grammar: the arguments of the offered
   tools that the caller has given. A value counts only when the caller's own words bear
   it out (:func:`said`): a small model fills what it does not know with "John Doe". What is
   learned is kept for the call, so a later turn adds only what is new.
2. **Act on new details.** A tool whose required arguments the caller's new details have just
   completed is called: the stage's own tools first, then the playbook's global ones (after a
   call, only the stage's own). The engine never makes the same call twice by itself.
3. **Ask yes or no.** Otherwise each ``llm_decision`` transition is a yes-or-no question, its
   answer read from the odds of the model's first token ("is this true: an order was found
   and the caller needs help with it?"), the first yes moving the conversation as
   ``playbook_transition`` would. A call made, one more round follows (its result may call for
   a move).

Not called in guided mode: a tool with no required argument (the shop's hours), or one whose
arguments were all known before the turn (cancelling the order found earlier). Whether the
caller asks for one is a judgement a 0.5B model makes at chance (measured: yes-or-no odds
separate the cases no better than a coin, ``benchmarks/results/scenarios-qwen05/guided``).

The answer is then streamed by the model without tools, the results given as facts and the
details the stage's next tool still needs named (:func:`results_as_note`). Where the stage has
its own line asking for the first of those details (its ``questions``), and the turn called no
tool and asked no question but entered the stage or learned a detail, that line is the answer
and the model is not asked at all (:func:`scripted_question`): a question needs no model, and a
small one words it poorly and slowly.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .delegation import DELEGATE_TOOL
from .engine import TRANSITION_TOOL
from .history import Message
from .llm import ChatRequest, LLMError, ToolCallRequest
from .transfer import TRANSFER_TOOL

if TYPE_CHECKING:
    from .tool_calls import ToolCalls
    from .turn import TurnHost

__all__ = [
    "GuidedMemory",
    "GuidedOutcome",
    "GuidedSteps",
    "results_as_note",
    "said",
    "scripted_question",
]

_NUMBER_WORDS = {
    "zero": 0, "oh": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
}  # fmt: skip

Tools = list[dict[str, Any]]
"""Tools as chat-completions schemas (``{"type": "function", "function": {...}}``)."""


@dataclass
class GuidedMemory:
    """What guided steps have learned of one call."""

    details: dict[str, Any] = field(default_factory=dict)
    """Tool arguments the caller has given, by name."""
    heard: str = ""
    """Everything the caller said in the call (details are checked against it)."""
    made: set[str] = field(default_factory=set)
    """``name + arguments JSON`` of every call the engine made (never made again by itself)."""


@dataclass(frozen=True)
class GuidedOutcome:
    """What a guided Phase 1 did (:meth:`GuidedSteps.run`)."""

    missing: tuple[str, ...]
    """The details the stage's next tool still needs."""
    learned: bool
    """The caller gave a detail not known before."""
    acted: bool
    """A tool ran (a move does not count)."""


LLMStep = Callable[[Awaitable[Any], float | None], Awaitable[Any]]
"""Awaits one LLM step within the turn's timeouts (see ``Turn._llm_step``)."""

_NOT_OFFERED = (TRANSITION_TOOL, DELEGATE_TOOL, TRANSFER_TOOL)
"""Built-in tools the engine does not call on details: moves are asked yes or no."""

_ROUNDS = 2
_EXTRACTION_MAX_TOKENS = 200


class GuidedSteps:
    """Phase 1 of one guided turn. ``calls`` runs the calls made (the turn's budget, events
    and history, as for the model's own calls)."""

    def __init__(self, host: TurnHost, calls: ToolCalls, llm_step: LLMStep) -> None:
        self._host = host
        self._calls = calls
        self._llm_step = llm_step

    async def run(self, user_message: Message, user_text: str) -> GuidedOutcome:
        """Make the turn's calls."""
        host = self._host
        memory = host.guided_memory
        memory.heard += f" {user_text}"
        deadline = asyncio.get_running_loop().time() + host.options.phase1_timeout_ms / 1000
        given: set[str] = set()
        learned = acted = False
        for round_ in range(_ROUNDS):
            own = set(host.engine.stage.tool_names)  # (a call may have moved the stage)
            tools = self._tools(own)
            view = self._view(user_message, user_text)
            extraction = detail_request(tools, memory) if round_ == 0 else None
            if extraction is not None:
                given = take_details(await self._extract(view, *extraction, deadline), memory)
                learned = bool(given)
            # after a call, only the stage's own tools: a global look-up on the same details
            # (a price after the free days) is not what the caller asked for
            offered = tools if round_ == 0 else [t for t in tools if t["function"]["name"] in own]
            call = auto_call(offered, memory, given, f"guided_{round_}")
            if call is None:
                call = await self._move(view, f"guided_{round_}", deadline)
            if call is None:
                break
            transitioned = await self._calls.run([call], deadline, user_message)
            memory.made.add(call.name + call.arguments)  # (not when the turn was cut first)
            acted = acted or call.name != TRANSITION_TOOL
            if transitioned or self._calls.transferred:
                break
        return GuidedOutcome(self._still_needed(), learned, acted)

    def _tools(self, own: set[str]) -> Tools:
        """The tools offered here, the stage's own (``own``) first."""
        offered = [
            s for s in self._host.engine.tool_schemas() if s["function"]["name"] not in _NOT_OFFERED
        ]
        return sorted(offered, key=lambda s: s["function"]["name"] not in own)

    async def _extract(
        self, view: str, instructions: str, schema: dict[str, Any], deadline: float
    ) -> str:
        """The model's extraction; empty (and an ``error`` event) when its request fails, so
        the turn is still answered."""
        request = ChatRequest(
            messages=[
                {"role": "system", "content": instructions},
                {"role": "user", "content": view},
            ],
            model=self._model,
            temperature=0,
            max_tokens=_EXTRACTION_MAX_TOKENS,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "details", "schema": schema},
            },
        )
        try:
            answer = str(await self._llm_step(self._host.client.complete(request), deadline))
        except LLMError as exc:  # (an endpoint without JSON schemas): no calls, still an answer
            self._host.emit("error", source="guided", message=str(exc))
            return ""
        self._host.emit("guided_step", details=answer)
        return answer

    async def _move(self, view: str, call_id: str, deadline: float) -> ToolCallRequest | None:
        """A ``playbook_transition`` call for the first ``llm_decision`` the model says yes
        to, or None."""
        for transition in self._host.engine.decision_transitions():
            about = (transition.description or transition.action.target_stage).rstrip(".")
            question = f'Is this true: "{about}"?'
            request = ChatRequest(
                messages=ask_messages(view, question), model=self._model, temperature=0
            )
            try:
                odds = await self._llm_step(self._host.client.first_token_odds(request), deadline)
            except LLMError as exc:
                self._host.emit("error", source="guided", message=str(exc))
                return None
            yes, no = odds.get("yes", 0.0), odds.get("no", 0.0)
            self._host.emit("guided_step", question=question, yes=round(yes, 3), no=round(no, 3))
            if yes > no:
                arguments = json.dumps({"target_stage": transition.action.target_stage})
                return ToolCallRequest(call_id, TRANSITION_TOOL, arguments)
        return None

    def _still_needed(self) -> tuple[str, ...]:
        """The missing required arguments of the first of the stage's own tools that lacks
        some."""
        memory = self._host.guided_memory
        schemas = {s["function"]["name"]: s["function"] for s in self._host.engine.tool_schemas()}
        for name in self._host.engine.stage.tool_names:
            if name in schemas:
                missing = _arguments(schemas[name], memory)[1]
                if missing:
                    return missing
        return ()

    @property
    def _model(self) -> str:
        """The stage's model, as its answer's request names it (without building one)."""
        host = self._host
        return host.engine.llm_config().model or host.client.model

    def _view(self, user_message: Message, user_text: str) -> str:
        """The turn as the questions show it: the agent's last words, the caller's, and the
        results of this turn's calls so far."""
        messages = self._host.conversation.messages
        at = next((i for i, m in enumerate(messages) if m is user_message), len(messages))
        before = [m for m in messages[:at] if m.get("role") == "assistant" and m.get("content")]
        lines = [f"Agent: {before[-1]['content']}"] if before else []
        lines.append(f"Caller: {user_text}")
        lines += [
            f"Result: {m.get('content')}" for m in messages[at + 1 :] if m.get("role") == "tool"
        ]
        return "\n".join(lines)


def detail_request(tools: Tools, memory: GuidedMemory) -> tuple[str, dict[str, Any]] | None:
    """The instructions and JSON schema that extract ``tools``' arguments from the caller's
    words; None when no tool takes an argument."""
    details: dict[str, Any] = {}
    lines: list[str] = []
    for function in _functions(tools):
        properties = (function.get("parameters") or {}).get("properties", {})
        for name, schema in properties.items():
            if name not in details:
                details[name] = _nullable(schema)
                lines.append(f"- {name}: {schema.get('description') or name}")
    if not details:
        return None
    known = {k: v for k, v in memory.details.items() if k in details}
    instructions = (
        "Copy the details the caller has given into JSON, each in the form its description "
        "asks for. Leave out what the caller has not said; never make a detail up.\n"
        "Details:\n" + "\n".join(lines) + (f"\nKnown already: {json.dumps(known)}" if known else "")
    )
    schema = {
        "type": "object",
        "properties": details,
        "required": [],  # a detail not given is left out: fewer tokens, fewer made up
        "additionalProperties": False,
    }
    return instructions, schema


def take_details(answer: str, memory: GuidedMemory) -> set[str]:
    """Keep the values of the extraction ``answer`` that the caller's words bear out; returns
    the names whose value is new."""
    try:
        parsed = json.loads(answer)
    except json.JSONDecodeError:
        return set()
    if not isinstance(parsed, dict):
        return set()
    given = set()
    for name, value in parsed.items():
        if value is not None and said(value, memory.heard):
            if memory.details.get(name) != value:
                given.add(name)
            memory.details[name] = value
    return given


def auto_call(
    tools: Tools, memory: GuidedMemory, given: set[str], call_id: str
) -> ToolCallRequest | None:
    """The first of ``tools`` whose required arguments are all known, some of them among
    ``given`` (new this turn), unless the engine already made that very call (the caller
    records it in ``memory.made`` once made)."""
    for function in _functions(tools):
        required = set((function.get("parameters") or {}).get("required", []))
        arguments, missing = _arguments(function, memory)
        key = function["name"] + arguments
        if required & given and not missing and key not in memory.made:
            return ToolCallRequest(call_id, function["name"], arguments)
    return None


def scripted_question(
    questions: dict[str, str], outcome: GuidedOutcome, caller: str, *, entered: bool
) -> str | None:
    """The stage's own line (``questions``) asking for the first missing detail that has one,
    when the turn called no tool (there is no result to tell), the ``caller``'s words are not
    a question (theirs is the model's to answer: a small model's yes may have moved the call
    on "When are you open?"), and the turn either ``entered`` the stage or learned a detail.
    None: the model answers."""
    asked = caller.rstrip().endswith("?")
    if outcome.acted or asked or not (entered or outcome.learned):
        return None
    return next((questions[name] for name in outcome.missing if name in questions), None)


def ask_messages(view: str, question: str) -> list[dict[str, Any]]:
    """A yes-or-no question about the turn ``view`` (see the turn's guided view)."""
    return [
        {
            "role": "system",
            "content": "You read a phone call and answer a question about it with yes or no.",
        },
        {"role": "user", "content": f"{view}\n\nQuestion: {question} Answer yes or no."},
    ]


def results_as_note(
    messages: list[dict[str, Any]], missing: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``messages`` (a request's, led by its system prompt) for a small model's answer: the
    tool calls and results leave the history (a small model shown them goes on calling tools,
    in text) and join the system prompt as facts, with the details still to ask for."""
    names: dict[str, str] = {}
    facts: list[str] = []
    kept: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                function = call.get("function") or {}
                names[call.get("id", "")] = f"{function.get('name')}({function.get('arguments')})"
            continue
        if message.get("role") == "tool":
            called = names.get(message.get("tool_call_id", ""), "a tool")
            facts.append(f"- {called} returned {message.get('content')}")
            continue
        kept.append(message)
    notes = []
    if facts:
        notes.append("What the tools returned in this call (latest last):\n" + "\n".join(facts))
    if missing:
        notes.append("Ask the caller for: " + ", ".join(missing) + ".")
    if notes and kept and kept[0].get("role") == "system":
        kept[0] = {**kept[0], "content": "\n\n".join([str(kept[0]["content"]), *notes])}
    return kept


def said(value: Any, heard: str) -> bool:
    """Whether the caller's words ``heard`` bear ``value`` out. A number: it was said, in
    digits or in words. A string: at least half of its words (of three letters or more) and
    digit runs were said; a run of one or two digits (the "8" and "00" of "8:00" for "eight")
    counts once any number was said, a longer one (an order or phone number) only when its
    digits were said, one by one in words included ("four four seven one nine")."""
    tokens = re.findall(r"[a-z]+|\d+", heard.lower())
    words = set(tokens)
    numbers = _numbers(tokens)
    if isinstance(value, bool):
        return True
    if isinstance(value, int | float):
        return str(int(value)) in numbers
    if not isinstance(value, str):
        return False
    parts = [p for p in re.findall(r"[a-z]+|\d+", value.lower()) if p.isdigit() or len(p) > 2]

    def borne(part: str) -> bool:
        if not part.isdigit():
            return part in words
        return part in numbers or (len(part) <= 2 and bool(numbers))

    return bool(parts) and 2 * sum(map(borne, parts)) >= len(parts)


def _numbers(tokens: list[str]) -> set[str]:
    """The numbers in ``tokens``: digit runs, number words, and each run of single digits
    read out one by one ("4 4 7 1 9", "four four seven one nine") joined."""
    found = {t for t in tokens if t.isdigit()} | {
        str(_NUMBER_WORDS[t]) for t in tokens if t in _NUMBER_WORDS
    }
    run = ""
    for token in [*tokens, ""]:
        if token.isdigit() and len(token) == 1:
            run += token
        elif _NUMBER_WORDS.get(token, 10) < 10:
            run += str(_NUMBER_WORDS[token])
        else:
            if len(run) > 1:
                found.add(run)
            run = ""
    return found


def _functions(tools: Tools) -> list[dict[str, Any]]:
    return [t["function"] for t in tools if isinstance(t.get("function"), dict)]


def _arguments(function: dict[str, Any], memory: GuidedMemory) -> tuple[str, tuple[str, ...]]:
    """A tool's arguments from the known details (JSON), and the required ones still unknown."""
    parameters = function.get("parameters") or {}
    names = list(parameters.get("properties", {}))
    arguments = {n: memory.details[n] for n in names if n in memory.details}
    missing = tuple(n for n in parameters.get("required", []) if n not in arguments)
    return json.dumps(arguments, sort_keys=True), missing


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema.get("type")
    if isinstance(kind, str) and "enum" not in schema:
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}
