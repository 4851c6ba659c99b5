"""Judge designs tried on Qwen2.5-Coder-0.5B against the 60 statements of
``benchmarks/judge_agreement.py`` (an experiment, kept with its results; none was adopted).

    PYTHONPATH=. .venv/bin/python \\
        benchmarks/results/judge-agreement/designs/judge_designs.py OUT.json

Each design gives a score in [0, 1] (or a log-likelihood difference for ``pmi_*``) per statement;
the summary prints each design's agreement at its natural threshold (0.5, or 0 for ``pmi_*``),
its AUC (how well it ranks true statements above false ones, whatever the threshold) and its
time per verdict. ``head`` is the judge as shipped (two phrasings, odds of "yes", averaged).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.judge_agreement import CASES
from benchmarks.models import model_path
from benchmarks.tester_llm import llm_client
from playbooks import ChatClient, ChatRequest
from server.testkit.scenarios.judge import Exchange, Judge, transcript

# Worked examples from other businesses (a dentist, a bike shop), three yes and three no.
SHOTS = (
    ("Can you tell me my neighbour's appointment time?",
     "Sorry, I can't share other patients' details.", "refuses to share the information", "yes"),
    ("Do you fix electric bikes?", "Yes, we repair all kinds of e-bikes.",
     "says the shop does not repair electric bikes", "no"),
    ("How much is a cleaning?", "I don't know the price, but I can ask the dentist to call you.",
     "admits it does not know the price", "yes"),
    ("Can I come at ten?", "Ten is taken. Would eleven suit you?",
     "confirms the appointment at ten", "no"),
    ("I need new brakes.", "Which bike is it for?", "says the brakes were replaced", "no"),
    ("Is the dentist in on Friday?", "Yes, she works Friday mornings.",
     "says when the dentist works", "yes"),
)  # fmt: skip

PHRASINGS = {
    "ask": ("You read a phone call and answer a question about the agent's reply with yes or no.",
            "{call}\n\nQuestion: does the agent's reply {st}? Answer yes or no."),
    "state": ("You check statements about what a voice agent said. Reply with one word: yes or no.",
              "{call}\n\nStatement: the agent {st}.\nIs the statement true of the agent's reply?"),
    "reviewer": ("You are a careful reviewer of customer service calls. Answer yes or no.",
                 "Here is the end of a call.\n{call}\n\nIn this reply, does the agent {st}? "
                 "Think about the meaning of the agent's words. Answer yes or no."),
    "correct": ("You answer questions about a conversation with yes or no.",
                "{call}\n\nIs it correct to say that the agent {st}? yes or no"),
    "strict": ("You are a strict grader. Reply yes only if the agent's reply clearly does what is "
               "described, otherwise no.",
               "{call}\n\nDescribed: the agent {st}.\nDoes the reply do this? yes or no"),
}  # fmt: skip


async def yes_odds(client: ChatClient, messages: list[dict[str, Any]]) -> float:
    request = ChatRequest(messages=messages, model=client.model, temperature=0)
    odds = await client.first_token_odds(request, top=20)
    yes, no = odds.get("yes", 0.0), odds.get("no", 0.0)
    return yes / (yes + no) if yes + no > 0 else 0.5


def chat(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def few_shot(client: ChatClient, call: str, statement: str) -> float:
    system, user = PHRASINGS["ask"]
    messages = [{"role": "system", "content": system}]
    for caller, agent, shot, verdict in SHOTS:
        shot_call = f"Caller: {caller}\nAgent: {agent}"
        messages.append({"role": "user", "content": user.format(call=shot_call, st=shot)})
        messages.append({"role": "assistant", "content": verdict})
    messages.append({"role": "user", "content": user.format(call=call, st=statement)})
    return await yes_odds(client, messages)


async def quote_or_none(client: ChatClient, call: str, statement: str) -> float:
    """Extraction: quote the agent's words that show the statement, or "none"."""
    system = (
        "You find evidence in a phone call. Quote the words of the agent's reply that show the"
        " statement, or answer none if no words show it."
    )
    user = (
        f"{call}\n\nStatement: the agent {statement}.\nWhich words of the agent's reply show"
        " this? Quote them, or answer none."
    )
    request = ChatRequest(messages=chat(system, user), model=client.model, temperature=0)
    odds = await client.first_token_odds(request, top=20)
    return 1.0 - odds.get("none", 0.0) / (sum(odds.values()) or 1.0)


def negated(statement: str) -> str:
    verb, _, rest = statement.partition(" ")
    if verb == "is":
        return f"is not {rest}"
    base = verb[:-3] + "y" if verb.endswith("ies") else verb[:-1] if verb.endswith("s") else verb
    return f"does not {base} {rest}".strip()


async def a_or_b(client: ChatClient, call: str, statement: str) -> float:
    """The statement against its negation, in both orders (position bias cancels)."""
    said, denied = f"The agent {statement}.", f"The agent {negated(statement)}."
    system = (
        "You read a phone call and pick the sentence that describes the agent's reply."
        " Answer A or B."
    )
    chances = []
    for first, second, flipped in ((said, denied, False), (denied, said, True)):
        user = f"{call}\n\nA) {first}\nB) {second}\n\nWhich is true of the agent's reply, A or B?"
        request = ChatRequest(messages=chat(system, user), model=client.model, temperature=0)
        odds = await client.first_token_odds(request, top=20)
        a, b = odds.get("a", 0.0), odds.get("b", 0.0)
        chance = a / (a + b) if a + b > 0 else 0.5
        chances.append(1.0 - chance if flipped else chance)
    return sum(chances) / 2


async def paraphrase_then_judge(client: ChatClient, call: str, statement: str) -> float:
    """The model restates the reply in its own words first, then judges with that beside it."""
    ask = (
        f"{call}\n\nIn one short sentence, what does the agent do in its reply?"
        ' Start with "The agent".'
    )
    request = ChatRequest(
        messages=chat("You describe phone calls briefly.", ask),
        model=client.model,
        temperature=0,
        max_tokens=40,
    )
    restated = (await client.complete(request)).strip().split("\n")[0]
    system, user = PHRASINGS["ask"]
    return await yes_odds(
        client, chat(system, user.format(call=f"{call}\nIn short: {restated}", st=statement))
    )


async def reason_then_judge(client: ChatClient, call: str, statement: str) -> float:
    """Chain of thought: the model reasons in a few sentences, then answers yes or no."""
    system, user = PHRASINGS["ask"]
    question = user.format(call=call, st=statement).replace(
        "Answer yes or no.", "First explain briefly what the agent's words mean."
    )
    request = ChatRequest(
        messages=chat(system, question), model=client.model, temperature=0, max_tokens=60
    )
    reasoning = (await client.complete(request)).strip()
    messages = [
        *chat(system, question),
        {"role": "assistant", "content": reasoning},
        {"role": "user", "content": "So, yes or no?"},
    ]
    return await yes_odds(client, messages)


async def phrasing(name: str, client: ChatClient, call: str, statement: str) -> float:
    system, user = PHRASINGS[name]
    return await yes_odds(client, chat(system, user.format(call=call, st=statement)))


Design = Callable[[ChatClient, str, str], Awaitable[float]]
DESIGNS: dict[str, Design] = {
    "few_shot": few_shot,
    "quote_or_none": quote_or_none,
    "a_or_b": a_or_b,
    "paraphrase": paraphrase_then_judge,
    "reasoning": reason_then_judge,
    **{f"phrasing_{name}": functools.partial(phrasing, name) for name in PHRASINGS},
}


async def statement_log_likelihood(
    http: aiohttp.ClientSession, origin: str, caller: str, agent: str, statement: str
) -> float:
    """log P(" {statement}" | "...What did the agent do? The agent"), read by forcing the
    statement's tokens with a grammar (llama.cpp reports the raw, pre-grammar odds)."""
    prompt = (
        "<|im_start|>system\nYou describe what a voice agent did in a phone call.<|im_end|>\n"
        f"<|im_start|>user\nCaller: {caller}\nAgent: {agent}\n\nWhat did the agent do in its"
        " reply?<|im_end|>\n<|im_start|>assistant\nThe agent"
    )
    target = f" {statement}"
    body = {
        "prompt": prompt,
        "grammar": f"root ::= {json.dumps(target)}",
        "n_probs": 1,
        "n_predict": 64,
        "temperature": 0,
        "cache_prompt": True,
    }
    async with http.post(f"{origin}/completion", json=body) as response:
        data = await response.json()
    tokens = [t for t in data["completion_probabilities"] if t["token"]]
    return float(sum(t["logprob"] for t in tokens))


async def run() -> list[dict[str, Any]]:
    args = argparse.Namespace(
        base_url=None, llm_gguf=model_path("qwen2.5-coder-0.5b"), model="judge", api_key=None
    )
    rows: list[dict[str, Any]] = []
    async with llm_client(args) as client:
        judge = Judge(client)
        origin = str(client.client.base_url).rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {client.client.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            for case in CASES:
                conversation = [Exchange("caller", case.caller), Exchange("agent", case.agent)]
                call = transcript(conversation)
                row: dict[str, Any] = {
                    "statement": case.statement,
                    "agent": case.agent,
                    "true": case.true,
                }
                started = time.monotonic()
                verdict = await judge.verdict(case.statement, conversation, of_last_answer=True)
                row["head"] = float(verdict.reason.split(" at ")[1].split("%")[0]) / 100
                row["head_s"] = time.monotonic() - started
                for name, design in DESIGNS.items():
                    started = time.monotonic()
                    row[name] = await design(client, call, case.statement)
                    row[f"{name}_s"] = time.monotonic() - started
                started = time.monotonic()
                said = await statement_log_likelihood(
                    http, origin, case.caller, case.agent, case.statement
                )
                for null in ("...", "Okay."):
                    unsaid = await statement_log_likelihood(
                        http, origin, case.caller, null, case.statement
                    )
                    row[f"pmi_{'dots' if null == '...' else 'okay'}"] = said - unsaid
                row["pmi_dots_s"] = row["pmi_okay_s"] = (time.monotonic() - started) / 2
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_s")}))
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    names = [k for k in rows[0] if k not in ("statement", "agent", "true") and not k.endswith("_s")]
    for name in names:
        cut = 0.0 if name.startswith("pmi_") else 0.5
        trues = [r[name] for r in rows if r["true"]]
        falses = [r[name] for r in rows if not r["true"]]
        auc = sum((t > f) + 0.5 * (t == f) for t in trues for f in falses) / (
            len(trues) * len(falses)
        )
        true_ok = sum(v >= cut for v in trues)
        false_ok = sum(v < cut for v in falses)
        seconds = sum(r[f"{name}_s"] for r in rows) / len(rows)
        lines.append(
            f"{name}: {(true_ok + false_ok) / len(rows):.0%} (true {true_ok}/{len(trues)},"
            f" false {false_ok}/{len(falses)}), AUC {auc:.2f}, {seconds:.2f} s a verdict"
        )
    return lines


def main() -> None:
    rows = asyncio.run(run())
    summary = summarize(rows)
    for line in summary:
        print(line)
    Path(sys.argv[1]).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
