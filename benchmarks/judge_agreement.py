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
    # fixed before the judge was tuned on the 0.5B model (issue: a judge small models can be)
    Case("How much is delivery?", "Delivery is free on orders over thirty euros, else four euros.",
         "gives the price of delivery", True),
    Case("How much is delivery?", "We deliver every day between nine and six.",
         "gives the price of delivery", False),
    Case("Do you have vegetarian dishes?", "Yes, the risotto and two of our pizzas are vegetarian.",
         "says there are vegetarian dishes", True),
    Case("Do you have vegetarian dishes?", "I'm afraid our menu is all meat and fish.",
         "says there are vegetarian dishes", False),
    Case("Can I bring my dog?", "Dogs are welcome on the terrace.",
         "answers in English", True),
    Case("Can I bring my dog?", "Los perros son bienvenidos en la terraza.",
         "answers in English", False),
    Case("¿Tienen mesa para dos esta noche?", "Sí, tenemos una mesa para dos a las nueve.",
         "answers in Spanish", True),
    Case("¿Tienen mesa para dos esta noche?", "Yes, we have a table for two at nine.",
         "answers in Spanish", False),
    Case("My order hasn't arrived.", "I'm sorry about that. What is your order number?",
         "asks for the order number", True),
    Case("My order hasn't arrived.", "I'm sorry about that. It will arrive tomorrow.",
         "asks for the order number", False),
    Case("My order number is A1003.", "Order A1003 is delayed; it should arrive on Thursday.",
         "says the order is delayed", True),
    Case("My order number is A1003.", "Order A1003 was delivered yesterday afternoon.",
         "says the order is delayed", False),
    Case("Can you change my booking to nine?", "Done, your table is now at nine.",
         "confirms the new time of the booking", True),
    Case("Can you change my booking to nine?", "Nine is taken, I'm afraid. Would half past work?",
         "confirms the new time of the booking", False),
    Case("A table for six on Saturday.", "Saturday for six, at what time would you like it?",
         "asks what time the caller wants", True),
    Case("A table for six on Saturday.", "Saturday for six at eight is booked, see you then.",
         "asks what time the caller wants", False),
    Case("What's your phone number?", "You can reach us on 555 0134.",
         "gives a phone number", True),
    Case("What's your phone number?", "You can reach us by email at hello@example.com.",
         "gives a phone number", False),
    Case("Thanks, that's all.", "You're welcome, have a lovely evening. Goodbye!",
         "says goodbye", True),
    Case("Thanks, that's all.", "Is there anything else I can help you with today?",
         "says goodbye", False),
    Case("Is the kitchen open late?", "The kitchen closes at ten, the bar at midnight.",
         "says when the kitchen closes", True),
    Case("Is the kitchen open late?", "We have a lovely late-night cocktail menu.",
         "says when the kitchen closes", False),
    Case("I'd like a refund.", "I've started a refund of twenty euros to your card.",
         "says a refund was started", True),
    Case("I'd like a refund.", "Refunds are only possible within fourteen days of delivery.",
         "says a refund was started", False),
    Case("Can I pay by card?", "Yes, we take all major cards.",
         "says card payment is accepted", True),
    Case("Can I pay by card?", "Sorry, we only take cash.",
         "says card payment is accepted", False),
    Case("Where are you?", "We're at 12 Via Roma, next to the station.",
         "gives an address", True),
    Case("Where are you?", "We're open every evening except Monday.",
         "gives an address", False),
    Case("How long will it take?", "About forty minutes.",
         "gives a time estimate", True),
    Case("How long will it take?", "It depends on many things, I couldn't say.",
         "gives a time estimate", False),
    Case("Book a table for Friday.", "How many people will it be for?",
         "asks how many people are coming", True),
    Case("Book a table for Friday.", "What name should I put it under?",
         "asks how many people are coming", False),
    Case("Can I change the delivery address?", "Yes, I've updated it to 5 Elm Street.",
         "changes the delivery address", True),
    Case("Can I change the delivery address?", "The order has already left, so I can't change it.",
         "changes the delivery address", False),
    Case("Is the tiramisu homemade?", "Yes, our pastry chef makes it every morning.",
         "says the tiramisu is made in house", True),
    Case("Is the tiramisu homemade?", "We buy it from a bakery down the road.",
         "says the tiramisu is made in house", False),
    Case("Do you deliver to Springfield?", "I'm sorry, we don't deliver to Springfield yet.",
         "declines the request politely", True),
    Case("Do you deliver to Springfield?", "Of course, we deliver there every day.",
         "declines the request politely", False),
    Case("Can I speak to the manager?", "The manager isn't in; may I take a message?",
         "offers to take a message", True),
    Case("Can I speak to the manager?", "The manager isn't in today, call again tomorrow.",
         "offers to take a message", False),
    Case("Is it busy tonight?", "It's quiet tonight, you'll have your pick of tables.",
         "says it is not busy tonight", True),
    Case("Is it busy tonight?", "We're fully booked tonight, I'm afraid.",
         "says it is not busy tonight", False),
    Case("What's the wifi password?", "I'm sorry, I can't give that out over the phone.",
         "refuses to give the password", True),
    Case("What's the wifi password?", "It's trattoria2024, all lower case.",
         "refuses to give the password", False),
)  # fmt: skip
"""Each statement once true and once false of an answer to the same line: 60 statements, the
last 44 written before the judge was tuned for small models, and never changed since."""


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
