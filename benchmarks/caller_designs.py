"""Two ways to prompt ``vocable test``'s simulated caller, on fixed conversations of the support
example: does the model speak as the caller, with the persona's facts, and stop once done?

    python -m benchmarks.caller_designs --llm-gguf FILE [--tries 4]
    python -m benchmarks.caller_designs --base-url URL --model NAME [--api-key KEY]

- ``chat`` (what :class:`~server.testkit.scenarios.judge.SimulatedCallerLLM` does): the persona
  and goal as the system prompt, the agent's lines as the user's, the caller's as the model's own.
- ``next-line``: one user message with the persona, the goal and the call so far as a
  transcript, asking for the caller's next line.

For each design: lines written, lines that repeat the agent's last line (the model taking the
agent's part), lines with the order number, and ``[done]`` answers once the goal was reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Sequence
from pathlib import Path

from playbooks import ChatRequest
from server.testkit.scenarios.judge import (
    Exchange,
    SimulatedCallerLLM,
    spoken_line,
    transcript,
)

from .tester_llm import add_llm_source, llm_client

__all__ = ["NextLineCaller", "main"]

PERSONA = "You ordered a blue kettle last week. Your order number is A1001."
GOAL = "Find out when your order A1001 will be delivered."
GREETING = Exchange("agent", "Hello, this is Acme support. How can I help you today?")
ASKED = [
    GREETING,
    Exchange("caller", "Hi, I have a question about my order."),
    Exchange("agent", "Sure, what is your order number?"),
]
ANSWERED = [
    GREETING,
    Exchange("caller", "Where is my order A1001?"),
    Exchange("agent", "Order A1001 was shipped and arrives on Tuesday. Anything else?"),
]


class NextLineCaller(SimulatedCallerLLM):
    """The ``next-line`` design: the whole call in one user message."""

    async def next_line(self, conversation: Sequence[Exchange]) -> str | None:
        prompt = (
            f"A caller phones a shop's support line. The caller: {PERSONA}\n"
            f"The caller's goal: {GOAL}\n\nThe call so far:\n{transcript(conversation)}\n\n"
            "Write the caller's next line only (one short sentence). If the goal is reached,"
            " write [done]."
        )
        request = ChatRequest(
            [{"role": "user", "content": prompt}], self.model, temperature=0.3, max_tokens=60
        )
        return spoken_line(await self.client.complete(request))


def _squashed(text: str) -> str:
    return re.sub(r"\W", "", text.lower())


async def _measure(design: SimulatedCallerLLM, tries: int) -> dict[str, object]:
    lines: list[dict[str, object]] = []
    for name, conversation in (("greeted", [GREETING]), ("asked", ASKED), ("answered", ANSWERED)):
        for _ in range(tries):
            line = await design.next_line(conversation)
            agent = next(x.text for x in reversed(conversation) if x.speaker == "agent")
            lines.append({"after": name, "line": line})
            print(f"{type(design).__name__:>18} after {name:8}: {line!r}")
            if line is not None and _squashed(agent)[:24] in _squashed(line):
                lines[-1]["repeats_agent"] = True
    said = [x for x in lines if x["line"] is not None]
    return {
        "lines": len(lines),
        "repeats_agent": sum(1 for x in lines if x.get("repeats_agent")),
        "with_order_number": sum(1 for x in said if "1001" in str(x["line"])),
        "done_once_answered": sum(
            1 for x in lines if x["after"] == "answered" and x["line"] is None
        ),
        "rows": lines,
    }


async def _run(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    async with llm_client(args) as client:
        results: dict[str, dict[str, object]] = {
            "chat": await _measure(SimulatedCallerLLM(client, PERSONA, GOAL), args.tries),
            "next-line": await _measure(NextLineCaller(client, PERSONA, GOAL), args.tries),
        }
    for name, result in results.items():
        print(
            f"{name}: {result['lines']} lines, {result['repeats_agent']} repeat the agent,"
            f" {result['with_order_number']} give the order number,"
            f" {result['done_once_answered']} of {args.tries} stop once answered"
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llm_source(parser, "caller")
    parser.add_argument("--tries", type=int, default=4, help="lines asked of each conversation")
    parser.add_argument("--out", type=Path, help="write the lines and counts as JSON")
    args = parser.parse_args(argv)
    results = asyncio.run(_run(args))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
