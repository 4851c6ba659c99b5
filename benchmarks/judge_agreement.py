"""How far a judge model's verdicts can be trusted: ``vocable test``'s judge on statements whose
truth is known, about short exchanges of the example playbooks.

    python -m benchmarks.judge_agreement --llm-gguf FILE       # a model in process (llama.cpp)
    python -m benchmarks.judge_agreement --base-url URL --model NAME [--api-key KEY]

Prints each verdict and the agreement: of the true statements, how many were judged true; of the
false ones, how many false; and the time per verdict. ``--out FILE`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from server.testkit.scenarios.judge import Exchange, Judge

from .tester_llm import add_llm_source, llm_client

__all__ = ["CASES", "Case", "main"]


@dataclass(frozen=True)
class Case:
    caller: str
    agent: str
    statement: str
    true: bool


CASES: tuple[Case, ...] = (
    Case("When are you open?", "We are open Tuesday to Sunday, six to half past ten.",
         "tells the caller the opening hours", True),
    Case("When are you open?", "We are open Tuesday to Sunday, six to half past ten.",
         "says the restaurant is open on Mondays", False),
    Case("A table for two on Friday at eight.", "Friday at eight for two is free. Shall I book it?",
         "offers to book a table for Friday", True),
    Case("A table for two on Friday at eight.", "Sorry, Friday at eight is fully booked.",
         "offers to book a table for Friday", False),
    Case("Where is my order A1001?", "Order A1001 was shipped and arrives on Tuesday.",
         "says when the order will arrive", True),
    Case("Where is my order A1001?", "Could you give me your order number, please?",
         "says when the order will arrive", False),
    Case("Please cancel my order.", "Done, order A1002 is cancelled.",
         "confirms that the order was cancelled", True),
    Case("Please cancel my order.", "Which order would you like to cancel?",
         "confirms that the order was cancelled", False),
    Case("Hello?", "Trattoria Vocable, good evening! Would you like to book a table?",
         "greets the caller", True),
    Case("Hello?", "Your booking reference is T101.", "greets the caller", False),
    Case("Is there parking?", "I'm not sure, but the manager can call you back about it.",
         "admits it does not know the answer", True),
    Case("Is there parking?", "Yes, there are forty free spaces behind the restaurant.",
         "admits it does not know the answer", False),
    Case("Book it under Rossi.", "You're booked, Rossi, for two on Friday at eight.",
         "repeats the name of the booking", True),
    Case("Book it under Rossi.", "You're booked for two on Friday at eight.",
         "repeats the name of the booking", False),
    Case("I want to speak to a person.", "Of course, I'm putting you through to a colleague now.",
         "agrees to transfer the caller to a person", True),
    Case("I want to speak to a person.", "I can help you with anything you need right here.",
         "agrees to transfer the caller to a person", False),
)  # fmt: skip
"""Each statement once true and once false of an answer to the same line."""


async def _run(args: argparse.Namespace) -> dict[str, object]:
    rows = []
    async with llm_client(args) as client:
        judge = Judge(client)
        for case in CASES:
            conversation = [Exchange("caller", case.caller), Exchange("agent", case.agent)]
            started = time.monotonic()
            try:
                verdict = await judge.verdict(case.statement, conversation, of_last_answer=True)
                judged: bool | None = verdict.passed
                reason = verdict.reason
            except Exception as exc:  # an unreadable verdict counts as a wrong one
                judged, reason = None, f"{type(exc).__name__}: {exc}"
            took = time.monotonic() - started
            rows.append({**asdict(case), "judged": judged, "reason": reason, "s": round(took, 2)})
            mark = "ok " if judged == case.true else "BAD"
            print(f"{mark} {case.true!s:5} {case.statement!r}: {reason[:70]!r} ({took:.1f} s)")
    trues = [r for r in rows if r["true"]]
    falses = [r for r in rows if not r["true"]]
    summary = {
        "model": args.model if args.base_url else str(args.llm_gguf),
        "cases": len(rows),
        "agreement": sum(r["judged"] == r["true"] for r in rows) / len(rows),
        "true_judged_true": sum(r["judged"] is True for r in trues) / len(trues),
        "false_judged_false": sum(r["judged"] is False for r in falses) / len(falses),
        "unreadable": sum(r["judged"] is None for r in rows),
        "median_s": statistics.median(float(str(r["s"])) for r in rows),
        "rows": rows,
    }
    print(
        f"agreement {summary['agreement']:.0%}: true statements judged true "
        f"{summary['true_judged_true']:.0%}, false ones judged false "
        f"{summary['false_judged_false']:.0%}, unreadable {summary['unreadable']}, "
        f"median {summary['median_s']:.1f} s a verdict"
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llm_source(parser, "judge")
    parser.add_argument("--out", type=Path, help="write the verdicts and agreement as JSON")
    args = parser.parse_args(argv)
    summary = asyncio.run(_run(args))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
