"""LLMs on the tester's side: a judge of statements about the agent's answers, and a simulated
caller speaking for a persona with a goal. Both talk to any OpenAI-compatible endpoint (the
configured one, the embedded model's, or another) through :class:`playbooks.ChatClient`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from playbooks import ChatClient, ChatRequest

__all__ = [
    "Exchange",
    "Judge",
    "SimulatedCallerLLM",
    "Verdict",
    "spoken_line",
    "transcript",
]

DONE = "[done]"
VERDICT_SCHEMA: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {
                "verdict": {"type": "string", "enum": ["yes", "no"]},
                "reason": {"type": "string", "maxLength": 160},
            },
            "required": ["verdict", "reason"],
        },
    },
}


@dataclass(frozen=True)
class Exchange:
    """One line of the conversation: who spoke (``caller`` or ``agent``) and what."""

    speaker: str
    text: str


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


def transcript(conversation: Sequence[Exchange]) -> str:
    return "\n".join(f"{line.speaker.capitalize()}: {line.text}" for line in conversation)


class Judge:
    """Judges a statement true or false of a conversation, by an LLM at temperature 0.

    A large model is asked for a verdict and its reason in JSON. A small one cannot give
    that: asked so, Qwen2.5-Coder-0.5B said "no" to all 60 statements of
    ``benchmarks/judge_agreement.py``. What it can give is its odds: the probability of
    "yes" against "no" as its first word, asked in two phrasings and averaged, with "yes" at
    even odds or above (78 % agreement there, 77 % of true statements and 80 % of false
    ones). ``by_odds`` (None: for endpoints that keep prompts, i.e. llama.cpp's) picks that
    way; an endpoint that returns no odds gets the JSON question."""

    def __init__(
        self, client: ChatClient, model: str | None = None, *, by_odds: bool | None = None
    ) -> None:
        self.client = client
        self.model = model or client.model
        self.by_odds = client.prefills if by_odds is None else by_odds

    async def verdict(
        self, statement: str, conversation: Sequence[Exchange], *, of_last_answer: bool
    ) -> Verdict:
        """Whether ``statement`` holds of the agent's last answer (``of_last_answer``) or of
        the whole conversation; raises on an LLM failure or an unreadable verdict."""
        if self.by_odds:
            judged = await self._by_odds(statement, conversation, of_last_answer)
            if judged is not None:
                return judged
        subject = "the agent's LAST answer" if of_last_answer else "the conversation as a whole"
        system = (
            "You check a phone conversation between a caller and a voice agent. Decide whether"
            f" a statement is true of {subject}. Judge the meaning, not the exact words."
            ' Answer with JSON only: {"verdict": "yes" or "no", "reason": "<one short sentence>"}.'
        )
        user = f"Conversation:\n{transcript(conversation)}\n\nStatement: {statement}\nIs it true?"
        request = ChatRequest(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            model=self.model,
            temperature=0,
            max_tokens=160,
            response_format=VERDICT_SCHEMA,
        )
        return _read_verdict(await self.client.complete(request))

    async def _by_odds(
        self, statement: str, conversation: Sequence[Exchange], of_last_answer: bool
    ) -> Verdict | None:
        """The verdict of the odds of "yes" (two phrasings, averaged); None when the endpoint
        gives no odds."""
        reply = "the agent's reply" if of_last_answer else "the agent's side of the call"
        call = transcript(conversation)
        phrasings = (
            (
                f"You read a phone call and answer a question about {reply} with yes or no.",
                f"{call}\n\nQuestion: does {reply} {statement}? Answer yes or no.",
            ),
            (
                "You check statements about what a voice agent said. Reply with one word: "
                "yes or no.",
                f"{call}\n\nStatement: the agent {statement}.\nIs the statement true of {reply}?",
            ),
        )
        chances = []
        for system, user in phrasings:
            request = ChatRequest(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                model=self.model,
                temperature=0,
            )
            odds = await self.client.first_token_odds(request)
            yes, no = odds.get("yes", 0.0), odds.get("no", 0.0)
            if yes + no <= 0.0:
                return None
            chances.append(yes / (yes + no))
        chance = sum(chances) / len(chances)
        said = "yes" if chance >= _EVEN_ODDS else "no"
        return Verdict(chance >= _EVEN_ODDS, f'{said}: "yes" at {chance:.0%} odds')


_EVEN_ODDS = 0.5


def _read_verdict(text: str) -> Verdict:
    try:
        data = json.loads(text)
        verdict, reason = str(data["verdict"]).strip().lower(), str(data.get("reason", ""))
    except (ValueError, KeyError, TypeError):
        found = re.search(r"\b(yes|no)\b", text, re.IGNORECASE)
        if found is None:
            raise ValueError(f"the judge's answer is not a verdict: {text[:200]!r}") from None
        verdict, reason = found.group(1).lower(), text.strip()
    if verdict not in ("yes", "no"):
        raise ValueError(f"the judge's verdict is neither yes nor no: {verdict[:40]!r}")
    return Verdict(verdict == "yes", reason.strip()[:300])


class SimulatedCallerLLM:
    """Speaks the caller's side for a persona with a goal; ``None`` once it is done."""

    def __init__(self, client: ChatClient, persona: str, goal: str, model: str | None = None):
        self.client = client
        self.model = model or client.model
        self.system = (
            f"You are a person calling a business on the phone. {persona.strip()}\n"
            f"Your goal: {goal.strip()}\n"
            "Say only what you would say aloud next: one or two short sentences, plain words,"
            " no stage directions, no quotes. Give details (names, dates, numbers) when asked."
            f" Once your goal is reached, or the agent says goodbye, answer exactly {DONE}."
        )

    async def next_line(self, conversation: Sequence[Exchange]) -> str | None:
        """The caller's next line given the conversation so far; None when done."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for line in conversation:
            role = "assistant" if line.speaker == "caller" else "user"
            messages.append({"role": role, "content": line.text})
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": "(silence)"})
        request = ChatRequest(messages, self.model, temperature=0.3, max_tokens=60)
        return spoken_line(await self.client.complete(request))


def spoken_line(text: str) -> str | None:
    """The line to speak from the LLM's text: one line, without a speaker label or quotes."""
    if DONE in text.lower() or not text.strip():
        return None
    line = text.strip().splitlines()[0]
    line = re.sub(r"^(caller|me|you)\s*:\s*", "", line, flags=re.IGNORECASE)
    line = line.strip().strip('"').strip()
    return line or None
