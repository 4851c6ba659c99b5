"""Can the 0.5B model answer guided mode's yes-or-no questions? Fixed cases, read by the odds
of the first token (``yes`` against ``no``), in several phrasings.

Run from the repository: ``PYTHONPATH=. python
benchmarks/results/scenarios-qwen05/guided/yes_no_probe.py`` (the model from ``python -m
benchmarks.models qwen2.5-coder-0.5b``). Prints, per phrasing, how many cases come out right at
even odds and the AUC (how well the odds separate the true cases from the false ones).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

from benchmarks.tester_llm import llm_client
from playbooks.llm import ChatRequest

MODEL = Path.home() / ".cache/vocable-bench-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
WELCOME = "Agent: Trattoria Vocable, good evening! Would you like to book a table?\n"
SHOP = "Agent: Spoke and Chain, hello! How can I help with your bike?\n"
ORDER = "Agent: Order A1002 is still being prepared. Shall I cancel it?\n"
HOURS, PRICE = "The shop's opening hours", "The price of a repair job"
LOOKUP = "Look up an order's status, delivery date and items"
Case = tuple[str, str, bool]

TOOL_CASES: list[Case] = [  # (the turn, a tool's description, does the caller need it)
    (WELCOME + "Caller: When are you open?", "The restaurant's opening hours", True),
    (
        "Agent: We are open from Tuesday to Sunday.\nCaller: Sorry, are you open on Monday?",
        "The restaurant's opening hours",
        True,
    ),
    (
        "Agent: For which day and time, and for how many guests?\n"
        "Caller: Friday at eight, for two people.",
        "The restaurant's opening hours",
        False,
    ),
    (
        WELCOME + "Caller: Hello, I would like to book a table, please.",
        "The restaurant's opening hours",
        False,
    ),
    (SHOP + "Caller: How much do you charge to fix a puncture?", PRICE, True),
    (SHOP + "Caller: How much do you charge to fix a puncture?", HOURS, False),
    ("Agent: Fixing a puncture costs 12 euros.\nCaller: And are you open on Sunday?", HOURS, True),
    ("Agent: Fixing a puncture costs 12 euros.\nCaller: And are you open on Sunday?", PRICE, False),
    (ORDER + "Caller: Yes, please cancel it.", "Cancel an order", True),
    (ORDER + "Caller: When will it arrive?", "Cancel an order", False),
    (ORDER + "Caller: When will it arrive?", LOOKUP, True),
    (
        "Agent: Hello, this is Acme support. How can I help you today?\n"
        "Caller: Where is my order A1001?",
        LOOKUP,
        True,
    ),
    ("Agent: Which day would suit you?\nCaller: Thursday, if you have space.", HOURS, False),
    ("Agent: Which day would suit you?\nCaller: Thursday, if you have space.", PRICE, False),
]
REPAIR = "The caller wants to bring a bike in for a repair."
FOUND = "An order was found and the caller needs help with it."
MOVE_CASES: list[Case] = [  # (the turn, a transition's description, is it true)
    (
        SHOP + "Caller: Hi, my brakes are making a noise. Can I bring my bike in this week?",
        REPAIR,
        True,
    ),
    (SHOP + "Caller: How much do you charge to fix a puncture?", REPAIR, False),
    (SHOP + "Caller: And are you open on Sunday?", REPAIR, False),
    (
        'Agent: What is your order number?\nCaller: Keypad: 1002#\nResult: {"found": true, '
        '"order_id": "A1002", "status": "processing"}',
        FOUND,
        True,
    ),
    ("Agent: What is your order number?\nCaller: Hi, I'd like to cancel my order.", FOUND, False),
    (WELCOME + "Caller: When are you open?", "The caller wants to book a table.", False),
    (WELCOME + "Caller: Yes, for Friday please.", "The caller wants to book a table.", True),
]
SUPPORT = "Agent: Hello, this is Acme support. How can I help you today?\n"
ORDERS = "The caller asks about an order, a delivery, a refund or a cancellation"
INTENT_CASES: list[Case] = [  # (the turn, an intent as the playbook words it, is it the caller's)
    (WELCOME + "Caller: Hello, I would like to book a table, please.", "book_table", True),
    (WELCOME + "Caller: When are you open?", "book_table", False),
    (WELCOME + "Caller: Yes, for Friday please.", "book_table", True),
    (WELCOME + "Caller: No thanks, just a question about parking.", "book_table", False),
    (SUPPORT + "Caller: Where is my order A1001?", ORDERS, True),
    (SUPPORT + "Caller: Hi, I'd like to cancel my order.", ORDERS, True),
    (SUPPORT + "Caller: What are your opening hours?", ORDERS, False),
    (SUPPORT + "Caller: Do you sell gift cards?", ORDERS, False),
    (SUPPORT + "Caller: That's all, goodbye.", "The caller wants to end the call", True),
    (SUPPORT + "Caller: Where is my order A1001?", "The caller wants to end the call", False),
]
Phrasing = Callable[[str], str]
TOOL_PHRASINGS: dict[str, Phrasing] = {
    "need": lambda d: f'Does the agent need "{d}" to answer the caller now?',
    "asking": lambda d: f'Is the caller asking about this: "{d}"?',
    "asks for": lambda d: f'Does the caller\'s last message ask for this: "{d}"?',
    "use": lambda d: f'Should the agent use "{d}" to answer the caller\'s last message?',
}
MOVE_PHRASINGS: dict[str, Phrasing] = {
    "true (shipped)": lambda d: f'Is this true: "{d}"?',
    "true now": lambda d: f'Is this true of the caller\'s last message: "{d}"?',
}
INTENT_PHRASINGS: dict[str, Phrasing] = {
    "true": lambda d: (
        f'Is this true: "{d}"?'
        if " " in d
        else f'Is this true: "The caller\'s intent is: {d.replace("_", " ")}"?'
    ),
}
SYSTEMS = {
    "read (shipped)": "You read a phone call and answer a question about it with yes or no.",
    "one word": "Answer the question with one word: yes or no.",
}


async def main() -> None:
    args = argparse.Namespace(base_url=None, llm_gguf=MODEL, model="qwen", api_key=None)
    async with llm_client(args) as client:
        for title, cases, phrasings in (
            ("does the caller need this tool", TOOL_CASES, TOOL_PHRASINGS),
            ("is this transition's description true", MOVE_CASES, MOVE_PHRASINGS),
            (
                "is this the caller's intent (not used: intents keep the JSON classifier)",
                INTENT_CASES,
                INTENT_PHRASINGS,
            ),
        ):
            print(f"## {title} ({len(cases)} cases)")
            for name, phrase in phrasings.items():
                for system_name, system in SYSTEMS.items():
                    chances: list[tuple[float, bool]] = []
                    for view, about, truth in cases:
                        question = (
                            f"{view}\n\nQuestion: {phrase(about.rstrip('.'))} Answer yes or no."
                        )
                        request = ChatRequest(
                            messages=[
                                {"role": "system", "content": system},
                                {"role": "user", "content": question},
                            ],
                            model="qwen",
                            temperature=0,
                        )
                        odds = await client.first_token_odds(request)
                        yes, no = odds.get("yes", 0.0), odds.get("no", 0.0)
                        chances.append((yes / (yes + no) if yes + no else 0.0, truth))
                    right = sum((chance > 0.5) == truth for chance, truth in chances)
                    true = [c for c, t in chances if t]
                    false = [c for c, t in chances if not t]
                    auc = sum((a > b) + 0.5 * (a == b) for a in true for b in false) / (
                        len(true) * len(false)
                    )
                    print(f"{name:15s} {system_name:15s} right {right}/{len(cases)}  AUC {auc:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
