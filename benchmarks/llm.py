"""The benchmark's LLM: the scripted OpenAI-compatible server of the tests, paced like a real one.

Answers stream with a configurable time to first token and rate (word-sized tokens). Questions
asking for "everything" get a long answer (for the barge-in and backchannel scripts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.testkit.scripted_llm import Reply, ScriptedLLM

__all__ = ["LONG_ANSWER", "SHORT_ANSWER", "LLMPacing", "paced_llm"]

SHORT_ANSWER = "Your order left our warehouse yesterday. It should arrive on Friday morning."
LONG_ANSWER = " ".join(
    [
        "Standard delivery takes three to five working days and costs nothing over fifty euros.",
        "Express delivery arrives the next working day if you order before noon.",
        "Weekend delivery is available in most cities for a small extra fee.",
        "You can follow every parcel on our website with the number in your confirmation email.",
        "If nobody is at home, the courier leaves a card and tries again the next day.",
    ]
)


@dataclass(frozen=True)
class LLMPacing:
    first_token_ms: float = 200.0
    tokens_per_s: float = 50.0

    def first_sentence_ms(self, answer: str = SHORT_ANSWER) -> float:
        """When the first sentence of ``answer`` is complete, from the request (the floor)."""
        first = answer.split(". ")[0]
        return self.first_token_ms + (len(first.split()) - 1) * 1000 / self.tokens_per_s


def paced_llm(pacing: LLMPacing, answer: str = SHORT_ANSWER) -> ScriptedLLM:
    """The scripted LLM answering ``answer`` (``LONG_ANSWER`` when asked for "everything")."""

    def reply(body: dict[str, Any]) -> Reply:
        if not body.get("stream"):  # an intent classification
            return Reply(content='{"intent": "none", "confidence": 0.0}')
        last: dict[str, Any] = next(
            (m for m in reversed(body["messages"]) if m["role"] == "user"), {}
        )
        content = str(last.get("content", ""))
        return Reply(
            content=LONG_ANSWER if "everything" in content.lower() else answer,
            first_token_delay_s=pacing.first_token_ms / 1000,
            chunk_delay_s=1 / pacing.tokens_per_s,
        )

    return ScriptedLLM(reply)
